"""Frozen records that cross actor and process boundaries in the serving layer.

The supervisor, the worker, the replica model actors and the HTTP front end talk in
these types only (they pickle through xoscar); a field renamed breaks at the sender.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..model.llm.vllm.xavier.config import XavierReplicaSettings
from ..model.llm.vllm.xavier.stats import XavierStats
from .options import EngineOptions, RouterSettings


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """Everything one replica's model actor needs to load its engine."""

    model_uid: str
    rank: int
    num_replicas: int
    model_path: str
    engine: EngineOptions
    # None when Xavier is off; otherwise reaches the connector unchanged.
    xavier: XavierReplicaSettings | None = None


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """A loaded replica: where its model actor lives and what its engine looks like."""

    rank: int
    address: str  # the replica's sub-pool address (nixl:// with Xavier)
    actor_uid: str
    pid: int  # the sub-pool process
    num_kv_blocks: int
    block_size: int
    load_seconds: float
    hash_namespace: str | None = None  # Xavier's block-hash namespace (None: off)
    worker: str = ""  # the address of the worker whose host runs it
    # What a request must fit, as the engine sees it: the context length in tokens
    # and the model's vocabulary size (0: not known).
    max_model_len: int = 0
    vocab_size: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What a replica process itself observed, for checks made *there*.

    ``xavier`` is parsed back from the engine's own ``KVTransferConfig`` (what the
    connector receives), not echoed from the launcher's arguments.
    """

    rank: int
    pid: int
    env: dict[str, str]  # the UCX_* and CUDA_VISIBLE_DEVICES variables seen there
    xavier: XavierReplicaSettings | None
    kv_connector: str | None
    kv_connector_module_path: str | None
    disable_hybrid_kv_cache_manager: bool
    tensor_parallel_size: int
    pipeline_parallel_size: int
    block_size: int
    transfer_actor_alive: bool


@dataclass(frozen=True, slots=True)
class DeploymentInfo:
    """What the front end needs to dispatch requests over a model's replicas."""

    model_uid: str
    model_path: str
    model_engine: str
    replicas: tuple[ReplicaInfo, ...]
    router: RouterSettings
    xavier_enabled: bool
    xavier_description: str
    tracker_address: str | None = None
    tracker_uid: str | None = None
    hash_namespace: str | None = None  # how the connector names its block hashes
    created: float = 0.0
    model_name: str = ""  # the registry name, or the model directory's name
    quantization: str | None = None  # as given to vLLM, None: the checkpoint's own
    generation_config: str = "auto"  # "vllm": no sampling defaults from the model
    # rank -> why the replica is out of service: gone for good (its worker was
    # lost, its engine or process died) or, for now, missing health probes
    gone: dict[int, str] = field(default_factory=dict)
    unresponsive: dict[int, str] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return self.replicas[0].block_size

    @property
    def max_model_len(self) -> int:
        """The context length in tokens (0: not known)."""
        return self.replicas[0].max_model_len if self.replicas else 0

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (0: not known)."""
        return self.replicas[0].vocab_size if self.replicas else 0

    def replica_state(self, rank: int) -> str:
        """ "serving", "unresponsive: <why>" or "gone: <why>"."""
        if rank in self.gone:
            return f"gone: {self.gone[rank]}"
        if rank in self.unresponsive:
            return f"unresponsive: {self.unresponsive[rank]}"
        return "serving"


@dataclass(frozen=True, slots=True)
class ReplicaStates:
    """Which replicas of a model must not get requests: ``gone`` (dead for good:
    its engine or its process died; rank -> reason) and ``unresponsive`` (missed
    its last health probe; it serves again once it answers)."""

    gone: dict[int, str] = field(default_factory=dict)
    unresponsive: dict[int, str] = field(default_factory=dict)


class ServiceUnavailable(RuntimeError):
    """No replica can take the request now (the HTTP API answers 503)."""


class ReplicaFailed(ServiceUnavailable):
    """A replica could not finish a request: its engine or its process died, or it
    stopped answering. The model's other replicas keep serving."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"replica {rank} failed: {reason}")
        self.rank = rank
        self.reason = reason

    def __reduce__(self) -> tuple[type[ReplicaFailed], tuple[int, str]]:
        # Pickled across processes (xoscar): rebuild from the two fields.
        return (type(self), (self.rank, self.reason))


class ModelNotLaunched(LookupError):
    """No model of this uid is launched (the HTTP API answers 404). ``launched``
    names the models that are, as (uid, state), for the API to list to a caller
    who may list models."""

    def __init__(
        self, model_uid: str, launched: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(f"model {model_uid!r} is not launched")
        self.model_uid = model_uid
        self.launched = tuple(launched)

    def __reduce__(
        self,
    ) -> tuple[type[ModelNotLaunched], tuple[str, tuple[tuple[str, str], ...]]]:
        # Pickled across processes (xoscar): rebuild from the two fields.
        return (type(self), (self.model_uid, self.launched))

    def listing(self) -> str:
        """The launched models in words: which to use instead."""
        if not self.launched:
            return "no model is launched"
        models = ", ".join(f"{uid} ({state})" for uid, state in self.launched)
        close = difflib.get_close_matches(
            self.model_uid, [uid for uid, _ in self.launched], n=1
        )
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"launched: {models}{hint}"


@dataclass(frozen=True, slots=True)
class LaunchProgress:
    """A model's life so far, for `xinference launch` and `GET /v1/models/{uid}`."""

    model_uid: str
    state: str  # "launching", "ready", "failed", "terminating"
    replicas_ready: int
    replicas_total: int
    detail: str
    # seconds since the launch began; while terminating, since the terminate did
    elapsed_s: float
    error: str | None = None
    # share of the launch's steps done, 0..1 (``launch_phases``); 1 once ready
    fraction: float = 0.0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One prompt to complete, already tokenised by the front end."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int | None = 16  # None: until end of sequence or the context's end
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # vLLM's per-request prefix cache salt (None: unsalted); Xavier and the
    # router hash the prompt's blocks under it too
    cache_salt: str | None = None
    # Further ``SamplingParams`` arguments (n, penalties, logprobs, ...), as vLLM's
    # own request model mapped the request's fields (``api/vllm_sampling.py``);
    # only those that differ from ``SamplingParams``' defaults.
    options: Mapping[str, Any] = field(default_factory=dict)


# One generated token's logprobs as vLLM's engine returned them: (token id,
# logprob, decoded text or None) for each entry, in vLLM's order (the sampled
# token first, then the top ones by rank).
StepLogprobs = tuple[tuple[int, float, str | None], ...]


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """New output since the previous chunk of one request (the whole output when
    the request is not streamed)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens the engine did not compute (local prefix cache or Xavier load).
    cached_prompt_tokens: int | None = None
    # Of those, the tokens Xavier loaded from another replica, and that replica's
    # rank (set on a request's last chunk; 0 and None when nothing was loaded).
    external_prompt_tokens: int = 0
    external_holder_rank: int | None = None
    # Which of the request's ``n`` choices this is (0 with n=1).
    index: int = 0
    # Logprobs of this chunk's tokens, one entry per token (None: not asked for).
    logprobs: tuple[StepLogprobs, ...] | None = None
    # A non-streamed request's other choices (n > 1), each complete.
    more: tuple[GenerationChunk, ...] = ()


@dataclass(frozen=True, slots=True)
class StreamBatch:
    """The chunks a stream produced since the last poll; ``done`` after the last."""

    chunks: tuple[GenerationChunk, ...]
    done: bool


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """Counters of one replica: serving counters plus its transfer actor's stats."""

    model_uid: str
    rank: int
    block_size: int
    requests_total: int
    requests_in_flight: int
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    generated_tokens_total: int
    # The transfer actor's ``stats()`` (a tensor-parallel replica's: summed over
    # its engine ranks); None with Xavier off.
    xavier: XavierStats | None = field(default=None)
    # Each engine rank's own, rank 0 first, when the replica has several.
    xavier_ranks: tuple[XavierStats, ...] = ()


def format_counters(stats: dict[str, Any], prefix: str = "") -> str:
    """``a.b=1, a.c=2, d=3`` from nested counters, for one log or console line."""
    parts = []
    for key, value in stats.items():
        if isinstance(value, dict):
            inner = format_counters(value, f"{prefix}{key}.")
            if inner:
                parts.append(inner)
        else:
            parts.append(f"{prefix}{key}={value}")
    return ", ".join(parts)
