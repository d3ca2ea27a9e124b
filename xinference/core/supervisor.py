"""The supervisor actor: launches, lists and terminates model deployments.

Launching a model with ``replica=N``:

1. validate the options (``LaunchSpec``) and log the Xavier settings in one line;
2. with Xavier, create the model's block tracker in this pool;
3. ask the worker to start one sub-pool per replica (``nixl://`` with Xavier) and
   assign ranks 0..N-1;
4. load every replica's engine, each told (``XavierReplicaSettings``) its rank, the
   tracker and where its transfer actor will live;
5. once every replica has loaded, create the transfer actors.

Terminating reverses it: engines first (no new loads start), then the transfer
actors (they drain and log their counters), then the sub-pools and whatever they
spawned, then the tracker. A launch that fails half-way is torn down the same way.

The workers (registration, heartbeats, which worker gets which rank, what a lost
worker's replicas become) are ``core/workers.py``'s; the record of a deployment is
``core/deployment.py``'s, shared with the replica liveness monitor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import xoscar as xo

from ..model.llm.vllm.xavier.config import XavierReplicaSettings, transfer_actor_uid
from ..model.llm.vllm.xavier.tracker import BlockTrackerActor, tracker_uid
from .deployment import Deployment
from .heartbeat import HeartbeatSettings
from .liveness import PROBE_TIMEOUT_S, LivenessMonitor
from .messages import (
    DeploymentInfo,
    LaunchProgress,
    ModelNotLaunched,
    ReplicaReport,
    ReplicaSpec,
    ReplicaStates,
    ReplicaStats,
    format_counters,
)
from .model import model_actor_uid
from .options import LaunchOptionError, LaunchSpec
from .registry import resolve_model
from .tracker_relays import relays_enabled, replica_tracker, start_relays, stop_relays
from .workers import WorkerRegistry, host_of

logger = logging.getLogger(__name__)

# Deadlines for waits on other processes. Loading covers engine start on a busy CPU.
LOAD_TIMEOUT_S = 900.0
POOL_START_TIMEOUT_S = 120.0
RPC_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 120.0
# ``collect_stats`` (``/stats``, ``/metrics``): a replica that does not answer in a
# health probe's time is left out, so that it neither holds up nor fails the
# figures of the others (a scraper gives up after 10 s by default).
STATS_TIMEOUT_S = PROBE_TIMEOUT_S
XAVIER_READY_TIMEOUT_S = 120.0
PROGRESS_LOG_INTERVAL_S = 10.0

T = TypeVar("T")


class TeardownError(RuntimeError):
    """Some teardown steps failed; every step was still attempted."""


class LaunchCancelled(RuntimeError):
    """The launch was cancelled (``cancel_launch``, or a terminate) before every
    replica served."""


class SupervisorActor(xo.StatelessActor, WorkerRegistry):
    """One per cluster. Also hosts each Xavier model's block tracker; its workers
    are ``WorkerRegistry``'s."""

    def __init__(
        self,
        heartbeat: HeartbeatSettings | None = None,
        cluster_secret: str | None = None,
    ) -> None:
        super().__init__()
        self._models: dict[str, Deployment] = {}  # model uid -> record
        self._init_workers(heartbeat, cluster_secret)

    @classmethod
    def default_uid(cls) -> str:
        return "supervisor"

    async def __post_create__(self) -> None:
        self._start_watching()

    async def __pre_destroy__(self) -> None:
        self._stop_watching()

    async def gone_replicas(self, model_uid: str) -> dict[int, str]:
        return dict(self._record(model_uid).gone)

    # ---- launch -------------------------------------------------------------------

    async def launch_model(
        self, options: dict[str, Any], wait_ready: bool = True
    ) -> DeploymentInfo | str:
        """Validate raw launch options, then launch; see ``launch``. Without
        ``wait_ready`` the launch goes on in the background and its uid returns as
        soon as it is registered (``progress``, ``cancel_launch`` follow it)."""
        # Free engine arguments are checked by vLLM's parser, whose import takes
        # seconds: not on the actor's event loop.
        spec = await asyncio.to_thread(lambda: LaunchSpec.from_options(**options))
        record = self._register(spec)
        record.task = asyncio.create_task(self._run_launch(record))
        if not wait_ready:
            record.task.add_done_callback(_log_background_failure)
            return spec.model_uid
        return await _launch_result(record)

    async def launch(self, spec: LaunchSpec) -> DeploymentInfo:
        """Launch ``spec`` and return once every replica serves."""
        record = self._register(spec)
        record.task = asyncio.create_task(self._run_launch(record))
        return await _launch_result(record)

    async def cancel_launch(self, model_uid: str) -> None:
        """Stop a launch in progress; what it started is torn down before this
        returns. A model that is already ready is terminated, not cancelled."""
        record = self._record(model_uid)
        if record.state != "launching" or record.task is None:
            raise LaunchOptionError(
                f"model {model_uid!r} is {record.state}, not launching: "
                "terminate it instead"
            )
        record.task.cancel()
        await asyncio.gather(record.task, return_exceptions=True)

    def _register(self, spec: LaunchSpec) -> Deployment:
        uid = spec.model_uid
        if uid in self._models:
            raise LaunchOptionError(f"model {uid!r} is already launched")
        if not self._workers:
            raise RuntimeError("no worker is registered with the supervisor")
        self._assign_workers(spec)  # refuse an unknown worker_ip up front
        record = Deployment(spec)
        self._models[uid] = record
        return record

    async def _run_launch(self, record: Deployment) -> DeploymentInfo:
        spec = record.spec
        uid = spec.model_uid
        logger.info(
            "launching %s: %d replica(s) of %s with %s, router %s; %s",
            uid,
            spec.replica,
            spec.model_name or spec.model_path,
            spec.model_engine,
            spec.router.kind,
            spec.xavier.describe(),
        )
        ticker = asyncio.create_task(self._log_progress(record))
        try:
            await self._launch(record)
        except BaseException as error:
            record.state = "failed"
            logger.error("launching %s failed: %r; tearing down", uid, error)
            task = asyncio.current_task()
            if isinstance(error, asyncio.CancelledError) and task is not None:
                # A cancel (cancel_launch, terminate) is handled here: clear it, or
                # the teardown's own timeouts would take it for theirs and stop
                # half-way, leaving processes behind. Re-raised below.
                while task.cancelling():
                    task.uncancel()
            try:
                await self._teardown(record)
            except TeardownError as teardown_error:
                # The launch failure is what the caller must see; log this one.
                logger.error("%s", teardown_error)
            finally:
                del self._models[uid]
            raise
        finally:
            ticker.cancel()
        record.state = "ready"
        record.detail = f"ready in {time.monotonic() - record.started:.1f} s"
        logger.info("%s is ready: %s", uid, record.detail)
        record.monitor = asyncio.create_task(
            LivenessMonitor(record, self._mark_replicas_gone).run()
        )
        return self._deployment_info(record)

    async def _launch(self, record: Deployment) -> None:
        spec = record.spec
        uid = spec.model_uid
        if spec.model_path is None:
            assert spec.model_name is not None
            record.phase = "resolving"
            record.detail = f"resolving model {spec.model_name!r}"
            record.model_path = str(
                await asyncio.to_thread(resolve_model, spec.model_name)
            )
        else:
            record.model_path = spec.model_path
        record.workers = dict(enumerate(self._assign_workers(spec)))
        if spec.xavier.enabled:
            record.phase, record.detail = "tracker", "creating the block tracker"
            record.tracker = await xo.create_actor(
                BlockTrackerActor, address=self.address, uid=tracker_uid(uid)
            )
            if relays_enabled():
                await start_relays(record, self.address)
        placements = await self._plan(record)
        record.phase = "pools"
        record.detail = f"starting {spec.replica} replica sub-pool(s)"

        async def start_pool(rank: int) -> None:
            call = asyncio.ensure_future(
                _deadline(
                    record.workers[rank].start_replica_pool(placements[rank]),
                    POOL_START_TIMEOUT_S,
                )
            )
            # Cancelled (terminate or cancel during the launch) while the pool
            # starts: let it finish, through every further cancel (``_all`` cancels
            # its calls again once one of them ended cancelled), so that teardown
            # knows the pool and removes it. The call ends at its own deadline.
            cancelled = False
            while not call.done():
                try:
                    await asyncio.shield(call)
                except asyncio.CancelledError:
                    cancelled = cancelled or not call.cancelled()
                except Exception:
                    break  # the call failed: raised below
            if cancelled:
                if not call.cancelled() and call.exception() is None:
                    record.addresses[rank] = call.result()
                raise asyncio.CancelledError()
            record.addresses[rank] = call.result()

        await _all(start_pool(rank) for rank in range(spec.replica))
        record.phase, record.detail = "engines", f"loading {spec.replica} engine(s)"

        async def load(rank: int) -> None:
            address = record.addresses[rank]
            engine = spec.engine
            shared = placements[rank].gpu_memory_utilization
            if engine.gpu_memory_utilization is None and shared is not None:
                engine = dataclasses.replace(engine, gpu_memory_utilization=shared)
            replica_spec = ReplicaSpec(
                model_uid=uid,
                rank=rank,
                num_replicas=spec.replica,
                model_path=record.model_path,
                engine=engine,
                xavier=self._xavier_settings(
                    spec, rank, address, replica_tracker(record, rank, self.address)
                ),
            )
            worker = record.workers[rank]
            info = await _deadline(
                worker.load_replica(address, replica_spec), LOAD_TIMEOUT_S
            )
            info = dataclasses.replace(info, worker=worker.address)
            record.models[rank] = await xo.actor_ref(
                address=address, uid=model_actor_uid(uid, rank)
            )
            record.replicas[rank] = info
            logger.info(
                "%s replica %d loaded in %.1f s (%d/%d): %d KV blocks of %d tokens",
                uid,
                rank,
                info.load_seconds,
                len(record.replicas),
                spec.replica,
                info.num_kv_blocks,
                info.block_size,
            )

        if any(placement.shares_gpu for placement in placements):
            # vLLM sizes its cache from the free memory it sees while starting: engines
            # sharing a GPU must not start at the same time.
            for rank in range(spec.replica):
                await load(rank)
        else:
            await _all(load(rank) for rank in range(spec.replica))
        if spec.xavier.enabled:
            record.phase = "transfer actors"
            record.detail = "creating the Xavier transfer actors"
            await _all(
                _deadline(record.models[rank].start_transfer_actor(), RPC_TIMEOUT_S)
                for rank in range(spec.replica)
            )
            record.phase = "mapping"
            record.detail = "waiting for the engines to map their KV caches"
            await _all(
                _deadline(
                    record.models[rank].wait_xavier_ready(XAVIER_READY_TIMEOUT_S),
                    XAVIER_READY_TIMEOUT_S + RPC_TIMEOUT_S,
                )
                for rank in range(spec.replica)
            )

    async def _plan(self, record: Deployment) -> list[Any]:
        """Each worker plans its share of the ranks (its GPUs, its environment);
        the placements come back renumbered with the deployment's ranks."""
        spec = record.spec
        shares: dict[str, list[int]] = {}
        for rank, worker in record.workers.items():
            shares.setdefault(worker.address, []).append(rank)
        plans = await _all(
            _deadline(
                record.workers[ranks[0]].plan(
                    len(ranks),
                    spec.xavier.enabled,
                    spec.gpu_idx,
                    spec.xavier.gpu_cache_bytes if spec.xavier.enabled else None,
                    spec.engine.tensor_parallel_size,
                ),
                RPC_TIMEOUT_S,
            )
            for ranks in shares.values()
        )
        placements: list[Any] = [None] * spec.replica
        accounts: dict[str, list[str]] = {}
        for (address, ranks), plan in zip(shares.items(), plans, strict=True):
            for rank, placement in zip(ranks, plan, strict=True):
                placements[rank] = dataclasses.replace(placement, rank=rank)
            if plan and plan[0].ucx:
                accounts.setdefault(plan[0].ucx, []).append(host_of(address))
        if len(accounts) == 1 or len(shares) == 1:
            record.ucx = next(iter(accounts), "")
        else:  # the workers differ (a GPU host and a CPU host, say): name them
            record.ucx = "; ".join(
                f"{', '.join(hosts)}: {ucx}" for ucx, hosts in accounts.items()
            )
        return placements

    def _xavier_settings(
        self, spec: LaunchSpec, rank: int, address: str, tracker: tuple[str, str]
    ) -> XavierReplicaSettings | None:
        """``tracker``: (address, uid) the replica calls its tracker: its host's
        relay (``tracker_relays.py``) or the tracker."""
        if not spec.xavier.enabled:
            return None
        return XavierReplicaSettings(
            config=spec.xavier,
            model_uid=spec.model_uid,
            rank=rank,
            tracker_address=tracker[0],
            tracker_uid=tracker[1],
            transfer_address=address,
            transfer_uid=transfer_actor_uid(spec.model_uid, rank),
            tensor_parallel_size=spec.engine.tensor_parallel_size,
        )

    async def _log_progress(self, record: Deployment) -> None:
        while True:
            await asyncio.sleep(PROGRESS_LOG_INTERVAL_S)
            progress = record.progress()
            logger.info(
                "%s: %s (%d/%d replicas ready, %.0f s)",
                progress.model_uid,
                progress.detail,
                progress.replicas_ready,
                progress.replicas_total,
                progress.elapsed_s,
            )

    # ---- replica failures ---------------------------------------------------------

    async def replica_states(self, model_uid: str) -> ReplicaStates:
        """Which replicas must get no requests now (the front end asks often)."""
        record = self._record(model_uid)
        return ReplicaStates(
            gone=dict(record.gone), unresponsive=dict(record.unresponsive)
        )

    # ---- queries ------------------------------------------------------------------

    async def progress(self, model_uid: str) -> LaunchProgress:
        return self._record(model_uid).progress()

    async def list_models(self) -> list[LaunchProgress]:
        return [record.progress() for record in self._models.values()]

    async def describe_model(self, model_uid: str) -> DeploymentInfo:
        record = self._record(model_uid)
        if record.state != "ready":
            raise LookupError(f"model {model_uid!r} is {record.state}, not ready")
        return self._deployment_info(record)

    async def describe_models(self) -> list[DeploymentInfo]:
        return [
            self._deployment_info(record)
            for record in self._models.values()
            if record.state == "ready"
        ]

    async def report_replicas(self, model_uid: str) -> list[ReplicaReport]:
        """Each replica's own account of what it received (asked in its process)."""
        record = self._record(model_uid)
        return await _all(
            _deadline(record.models[rank].report(), RPC_TIMEOUT_S)
            for rank in record.serving_ranks()
        )

    async def collect_stats(self, model_uid: str) -> list[ReplicaStats]:
        """The counters of each serving replica that answers within
        ``STATS_TIMEOUT_S``; one that does not is left out and logged (the
        liveness monitor decides whether it is unresponsive)."""
        record = self._record(model_uid)
        if record.state != "ready":
            return []
        ranks = record.serving_ranks()
        outcomes = await asyncio.gather(
            *(
                _deadline(record.models[rank].stats(), STATS_TIMEOUT_S)
                for rank in ranks
            ),
            return_exceptions=True,
        )
        answered = []
        for rank, outcome in zip(ranks, outcomes, strict=True):
            if isinstance(outcome, Exception):
                logger.warning(
                    "%s replica %d: no stats (%r); left out", model_uid, rank, outcome
                )
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                answered.append(outcome)
        return answered

    # ---- terminate ----------------------------------------------------------------

    async def terminate_model(self, model_uid: str) -> dict[int, dict[str, Any]]:
        """Tear a model down; each replica's final Xavier counters (rank -> stats)."""
        record = self._record(model_uid)
        if record.state == "launching":
            # Cancelling tears down whatever the launch started; nothing to count.
            await self.cancel_launch(model_uid)
            return {}
        if record.state == "terminating":
            raise LaunchOptionError(f"model {model_uid!r} is {record.state}")
        record.state = "terminating"
        record.detail = "terminating"
        record.terminating_since = time.monotonic()
        if record.monitor is not None:
            record.monitor.cancel()
            await asyncio.gather(record.monitor, return_exceptions=True)
        try:
            return await self._teardown(record)
        finally:
            del self._models[model_uid]

    async def terminate_all(self) -> None:
        """Every model, launches in progress included (they are cancelled)."""
        for uid in [
            u for u, r in self._models.items() if r.state in ("ready", "launching")
        ]:
            await self.terminate_model(uid)

    async def _teardown(self, record: Deployment) -> dict[int, dict[str, Any]]:
        uid = record.spec.model_uid
        errors: list[str] = []

        async def step(name: str, calls: dict[int, Awaitable[T]]) -> dict[int, T]:
            results: dict[int, T] = {}
            outcomes = await asyncio.gather(
                *(_deadline(call, SHUTDOWN_TIMEOUT_S) for call in calls.values()),
                return_exceptions=True,
            )
            for rank, outcome in zip(calls, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    errors.append(f"{name} of replica {rank}: {outcome!r}")
                else:
                    results[rank] = outcome
            return results

        # A gone replica's process is unreachable (or dead): nothing to ask it.
        models = {
            rank: ref for rank, ref in record.models.items() if rank not in record.gone
        }
        await step(
            "engine shutdown",
            {rank: ref.shutdown_engine() for rank, ref in models.items()},
        )
        finals = await step(
            "transfer actor close",
            {rank: ref.close_transfer_actor() for rank, ref in models.items()},
        )
        counters = {rank: stats for rank, stats in finals.items() if stats is not None}
        for rank in sorted(counters):
            logger.info(
                "%s replica %d Xavier counters at shutdown: %s",
                uid,
                rank,
                format_counters(counters[rank]),
            )
        if record.workers:
            killed = await step(
                "sub-pool removal",
                {
                    rank: record.workers[rank].remove_replica(address)
                    for rank, address in record.addresses.items()
                    if rank not in record.gone
                },
            )
            leftovers = [pid for pids in killed.values() for pid in pids]
            if leftovers:
                errors.append(f"killed processes that outlived their pool: {leftovers}")
        await stop_relays(record)
        if record.tracker is not None:
            try:
                await _deadline(xo.destroy_actor(record.tracker), RPC_TIMEOUT_S)
            except Exception as error:  # reported below with the other failures
                errors.append(f"tracker destruction: {error!r}")
        if errors:
            raise TeardownError(f"terminating {uid}: " + "; ".join(errors))
        logger.info("%s terminated", uid)
        return counters

    # ---- helpers ------------------------------------------------------------------

    def _record(self, model_uid: str) -> Deployment:
        record = self._models.get(model_uid)
        if record is None:
            launched = tuple(
                (uid, model.listed_state()) for uid, model in self._models.items()
            )
            raise ModelNotLaunched(model_uid, launched)
        return record

    def _deployment_info(self, record: Deployment) -> DeploymentInfo:
        spec = record.spec
        return DeploymentInfo(
            model_uid=spec.model_uid,
            model_path=record.model_path,
            model_engine=spec.model_engine,
            replicas=tuple(record.replicas[rank] for rank in sorted(record.replicas)),
            gone=dict(record.gone),
            router=spec.router,
            xavier_enabled=spec.xavier.enabled,
            xavier_description="; ".join(
                part for part in (spec.xavier.describe(), record.ucx) if part
            ),
            tracker_address=self.address if record.tracker is not None else None,
            tracker_uid=tracker_uid(spec.model_uid) if record.tracker else None,
            hash_namespace=record.hash_namespace(),
            created=record.created,
            model_name=spec.model_name or Path(record.model_path).name,
            quantization=dict(spec.engine.extra).get("quantization"),
            unresponsive=dict(record.unresponsive),
        )


async def _launch_result(record: Deployment) -> DeploymentInfo:
    """Wait for a launch; a launch that was cancelled raises ``LaunchCancelled``
    (our caller being cancelled still raises ``CancelledError``)."""
    assert record.task is not None
    try:
        return await asyncio.shield(record.task)
    except asyncio.CancelledError:
        if record.task.cancelled():
            raise LaunchCancelled(
                f"the launch of {record.spec.model_uid!r} was cancelled"
            ) from None
        raise


def _log_background_failure(task: asyncio.Task[Any]) -> None:
    """A launch nobody waits for: its failure is logged (and shows in progress)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("background launch failed: %r", task.exception())


async def _deadline(call: Awaitable[T], seconds: float) -> T:
    # xo.wait_for: asyncio.wait_for waits for the cancelled call to end, which a
    # stopped process never lets an actor call do
    result: T = await xo.wait_for(call, seconds)
    return result


async def _all(calls: Any) -> list[Any]:
    """Run ``calls`` concurrently; on the first failure cancel the rest and raise."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
