"""Launch options: parsed and validated once, at the edge, into frozen records.

Everything a user can pass to ``xinference launch``, the REST launch endpoint or the
Python client arrives here as loose keyword values and leaves as one ``LaunchSpec``;
nothing downstream re-parses a string or looks up a default again. Every rule that
can reject a launch lives in ``LaunchSpec.from_options``, so the three front doors
give the same errors.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model.llm.vllm.xavier.config import DEFAULT_TRANSPORT, XavierConfig, parse_size
from .engine_args import EngineArgumentError, check_names, validate_engine_args
from .registry import registered_models
from .sampling import DEFAULT_GENERATION_CONFIG, GENERATION_CONFIG_MODES

logger = logging.getLogger(__name__)

SUPPORTED_ENGINES = ("vllm",)
ROUTERS = ("round-robin", "cache-aware")
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class LaunchOptionError(ValueError):
    """A launch option is invalid; the message says which and why."""


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """vLLM engine arguments we expose; None leaves vLLM's own default."""

    block_size: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    seed: int = 0
    # "auto": the model's generation_config.json supplies default sampling
    # parameters; "vllm": it does not (vLLM's --generation-config, same values).
    generation_config: str = DEFAULT_GENERATION_CONFIG
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Further vLLM engine arguments, already checked by vLLM's parser: (name, value).
    extra: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """How requests spread over replicas (see ``router.py``)."""

    kind: str = "round-robin"
    # Cache-aware only: the prefix holder is skipped when it has more than this many
    # requests in flight beyond the least busy replica.
    busy_margin: int = 2


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """One model deployment, validated. ``model_path`` is resolved by the supervisor
    when the user gave a registry name (building an offline model can take seconds)."""

    model_uid: str
    model_engine: str
    replica: int
    xavier: XavierConfig
    engine: EngineOptions = field(default_factory=EngineOptions)
    router: RouterSettings = field(default_factory=RouterSettings)
    model_path: str | None = None
    model_name: str | None = None
    # Where the replicas run: a worker's IP (None: any) and the GPU indexes they
    # spread over (None: all of the worker's GPUs).
    worker_ip: str | None = None
    gpu_idx: tuple[int, ...] | None = None

    @classmethod
    def from_options(
        cls,
        *,
        model_uid: str | None = None,
        model_name: str | None = None,
        model_path: str | None = None,
        model_engine: str | None = "vllm",
        replica: int = 1,
        enable_xavier: bool = False,
        xavier_gpu_cache_bytes: int | str | None = None,
        xavier_transport: str = DEFAULT_TRANSPORT,
        xavier_cross_layer_blocks: bool = False,
        xavier_remote_loads: bool = True,
        xavier_fast_path: bool | None = None,
        router: str = "round-robin",
        router_busy_margin: int = 2,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        block_size: int | None = None,
        max_model_len: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool = False,
        gpu_memory_utilization: float | None = None,
        max_num_seqs: int | None = None,
        seed: int = 0,
        generation_config: str = DEFAULT_GENERATION_CONFIG,
        # Upstream Xinference's launch keys (its client always sends them).
        model_type: str | None = "LLM",
        model_size_in_billions: int | str | None = None,
        model_format: str | None = None,
        quantization: str | None = None,
        n_gpu: int | str | None = "auto",
        n_worker: int = 1,
        gpu_idx: int | list[int] | None = None,
        worker_ip: str | None = None,
        peft_model_config: dict[str, Any] | None = None,
        request_limits: int | None = None,
        replica_config: list[Any] | None = None,
        enable_thinking: bool | None = None,
        enable_virtual_env: bool | None = None,
        virtual_env_packages: list[str] | None = None,
        virtual_env_find_links: list[str] | None = None,
        envs: dict[str, str] | None = None,
        **engine_args: Any,
    ) -> LaunchSpec:
        """Validate raw options; raises ``LaunchOptionError`` with a clear message.

        Keys that are not options here are vLLM engine arguments (``engine_args``),
        checked by vLLM's own parser.
        """
        # A misspelt option first: the checks below would see its default instead.
        try:
            check_names(engine_args, _launch_option_names())
        except EngineArgumentError as error:
            raise LaunchOptionError(str(error)) from None
        _check_upstream_options(
            model_type=model_type,
            model_format=model_format,
            n_worker=n_worker,
            peft_model_config=peft_model_config,
            request_limits=request_limits,
            replica_config=replica_config,
            enable_thinking=enable_thinking,
            enable_virtual_env=enable_virtual_env,
            virtual_env_packages=virtual_env_packages,
            virtual_env_find_links=virtual_env_find_links,
            envs=envs,
        )
        if model_size_in_billions is not None:
            logger.info(
                "model_size_in_billions=%r noted and not used: the model directory "
                "says what it holds",
                model_size_in_billions,
            )
        if quantization is not None and quantization.lower() != "none":
            engine_args.setdefault("quantization", quantization)
        tensor_parallel_size = _tensor_parallel_from_n_gpu(n_gpu, tensor_parallel_size)
        gpus = _gpu_indexes(gpu_idx)
        if model_name is None and model_path is None:
            raise LaunchOptionError("give model_name (a registry name) or model_path")
        if model_path is not None and not Path(model_path).is_dir():
            raise LaunchOptionError(f"model_path {model_path!r} is not a directory")
        # With model_path, model_name only names the model (as upstream allows).
        if model_name is not None and model_path is None:
            known = registered_models()
            if model_name not in known:
                raise LaunchOptionError(
                    f"unknown model_name {model_name!r}; known: "
                    f"{', '.join(sorted(known))} (or pass model_path)"
                )
        engine_name = (model_engine or "vllm").lower()
        uid = model_uid or default_model_uid(model_name, model_path)
        if not _UID.match(uid):
            raise LaunchOptionError(
                f"model_uid {uid!r} must be 1-128 letters, digits, '.', '_' or '-'"
            )
        _require_int("replica", replica, minimum=1)
        _require_int("tensor_parallel_size", tensor_parallel_size, minimum=1)
        _require_int("pipeline_parallel_size", pipeline_parallel_size, minimum=1)
        _require_int("router_busy_margin", router_busy_margin, minimum=0)
        xavier = _xavier_config(
            enable_xavier,
            xavier_gpu_cache_bytes,
            xavier_transport,
            xavier_cross_layer_blocks,
            xavier_remote_loads,
            xavier_fast_path,
            engine=engine_name,
            replica=replica,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
        )
        if engine_name not in SUPPORTED_ENGINES:
            raise LaunchOptionError(
                f"unsupported model_engine {model_engine!r}; "
                f"supported: {', '.join(SUPPORTED_ENGINES)}"
            )
        if router not in ROUTERS:
            raise LaunchOptionError(
                f"unknown router {router!r}; choose one of {', '.join(ROUTERS)}"
            )
        if router == "cache-aware" and not xavier.enabled:
            raise LaunchOptionError(
                "the cache-aware router needs enable_xavier: it routes by the "
                "Xavier block tracker"
            )
        if block_size is not None:
            _require_int("block_size", block_size, minimum=1)
        if max_model_len is not None:
            _require_int("max_model_len", max_model_len, minimum=1)
        if max_num_seqs is not None:
            _require_int("max_num_seqs", max_num_seqs, minimum=1)
        if generation_config not in GENERATION_CONFIG_MODES:
            raise LaunchOptionError(
                f"generation_config must be one of "
                f"{', '.join(GENERATION_CONFIG_MODES)} (auto: the model's "
                f"generation_config.json sets default sampling parameters; vllm: "
                f"neutral defaults), got {generation_config!r}"
            )
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise LaunchOptionError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        try:
            extra = validate_engine_args(engine_args, xavier=xavier.enabled)
        except EngineArgumentError as error:
            raise LaunchOptionError(str(error)) from None
        return cls(
            model_uid=uid,
            model_engine=engine_name,
            replica=replica,
            xavier=xavier,
            engine=EngineOptions(
                block_size=block_size,
                max_model_len=max_model_len,
                dtype=dtype,
                enforce_eager=bool(enforce_eager),
                gpu_memory_utilization=gpu_memory_utilization,
                max_num_seqs=max_num_seqs,
                seed=int(seed),
                generation_config=generation_config,
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                extra=extra,
            ),
            router=RouterSettings(kind=router, busy_margin=router_busy_margin),
            model_path=None if model_path is None else str(Path(model_path).resolve()),
            model_name=model_name,
            worker_ip=worker_ip or None,
            gpu_idx=gpus,
        )

    def with_model_path(self, path: str) -> LaunchSpec:
        """The same spec once the registry resolved ``model_name`` to a directory."""
        return dataclasses.replace(self, model_path=path)


@functools.cache
def _launch_option_names() -> frozenset[str]:
    """The options ``LaunchSpec.from_options`` names (its other keys are vLLM
    engine arguments)."""
    parameters = inspect.signature(LaunchSpec.from_options).parameters
    return frozenset(
        name
        for name, parameter in parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
        or parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    )


def _xavier_config(
    enable_xavier: bool,
    gpu_cache_bytes: int | str | None,
    transport: str,
    cross_layer_blocks: bool,
    remote_loads: bool,
    fast_path: bool | None,
    *,
    engine: str,
    replica: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
) -> XavierConfig:
    if not _require_bool("enable_xavier", enable_xavier):
        if gpu_cache_bytes is not None:
            raise LaunchOptionError(
                "xavier_gpu_cache_bytes is set but enable_xavier is not; "
                "pass enable_xavier to use the GPU-first cache"
            )
        if cross_layer_blocks:
            raise LaunchOptionError(
                "xavier_cross_layer_blocks is set but enable_xavier is not"
            )
        if not _require_bool("xavier_remote_loads", remote_loads):
            raise LaunchOptionError(
                "xavier_remote_loads=false (routing only) needs enable_xavier: the "
                "replicas publish what they hold through Xavier's block tracker"
            )
        if fast_path is not None:
            raise LaunchOptionError(
                "xavier_fast_path is set but enable_xavier is not; the fast path "
                "is how Xavier loads a peer's KV"
            )
        return XavierConfig(enabled=False)
    if engine != "vllm":
        raise LaunchOptionError(
            f"Xavier works with the vLLM engine only, got model_engine {engine!r}"
        )
    if replica < 2:
        raise LaunchOptionError(
            f"Xavier shares KV cache between replicas: it needs replica >= 2, "
            f"got {replica}"
        )
    # Tensor parallel is served rank to rank (every replica of the launch runs the
    # same size); pipeline stages would split the layers, which Xavier does not.
    if pipeline_parallel_size > 1:
        raise LaunchOptionError(
            "Xavier shares KV between whole replicas: pipeline_parallel_size must "
            f"be 1, got {pipeline_parallel_size} (use tensor_parallel_size for "
            "several devices per replica)"
        )
    try:
        size = None if gpu_cache_bytes is None else parse_size(gpu_cache_bytes)
    except ValueError as error:
        raise LaunchOptionError(f"invalid xavier_gpu_cache_bytes: {error}") from None
    try:
        return XavierConfig(
            enabled=True,
            gpu_cache_bytes=size,
            transport=transport,
            cross_layer_blocks=_require_bool(
                "xavier_cross_layer_blocks", cross_layer_blocks
            ),
            remote_loads=_require_bool("xavier_remote_loads", remote_loads),
            # None: the engine's environment decides (XAVIER_FAST_PATH)
            fast_path=(
                None
                if fast_path is None
                else _require_bool("xavier_fast_path", fast_path)
            ),
        )
    except ValueError as error:
        raise LaunchOptionError(str(error)) from None


# Upstream keys that carry nothing here when left at these values; any other value
# asks for something this server does not do, and is refused rather than dropped.
_UNSUPPORTED_UNLESS_EMPTY = {
    "n_worker": (1, "a replica runs on one worker here"),
    "request_limits": (None, "per-model request limits are not implemented"),
    "replica_config": (None, "placement per replica is not implemented; use gpu_idx"),
    "enable_thinking": (None, "chat template options are not implemented"),
    "enable_virtual_env": (None, "models run in the server's own environment"),
    "virtual_env_packages": (None, "models run in the server's own environment"),
    "virtual_env_find_links": (None, "models run in the server's own environment"),
    "envs": (None, "replicas inherit the worker's environment"),
}
# Weight formats vLLM loads from a model directory (GGUF and the rest are not).
_MODEL_FORMATS = ("pytorch", "safetensors", "gptq", "awq", "fp8", "bnb")


def _check_upstream_options(
    *,
    model_type: str | None,
    model_format: str | None,
    peft_model_config: dict[str, Any] | None,
    **settings: Any,
) -> None:
    if model_type is not None and model_type.upper() != "LLM":
        raise LaunchOptionError(
            f"model_type {model_type!r} is not served here: only LLM models "
            "(through vLLM) are"
        )
    if model_format is not None and model_format.lower() not in _MODEL_FORMATS:
        raise LaunchOptionError(
            f"model_format {model_format!r} is not supported: vLLM here loads "
            f"{', '.join(_MODEL_FORMATS)} model directories"
        )
    if peft_model_config and any(peft_model_config.values()):
        raise LaunchOptionError(
            "peft_model_config (LoRA adapters) is not supported by this server"
        )
    for name, value in settings.items():
        neutral, why = _UNSUPPORTED_UNLESS_EMPTY[name]
        if value != neutral and value not in (None, False, [], {}):
            raise LaunchOptionError(f"{name}={value!r} is not supported: {why}")


def _tensor_parallel_from_n_gpu(n_gpu: Any, tensor_parallel_size: Any) -> Any:
    """Upstream's ``n_gpu`` is GPUs per replica: here the tensor-parallel size."""
    if isinstance(n_gpu, str) and n_gpu.lower() == "auto":
        return tensor_parallel_size
    if n_gpu is None or (isinstance(n_gpu, str) and n_gpu.lower() == "none"):
        raise LaunchOptionError(
            "n_gpu=None (CPU only) cannot be chosen per model: the engine runs on "
            "the device the installed vLLM build targets"
        )
    if isinstance(n_gpu, str) and n_gpu.isdigit():
        n_gpu = int(n_gpu)
    _require_int("n_gpu", n_gpu, minimum=1)
    if tensor_parallel_size not in (1, n_gpu):
        raise LaunchOptionError(
            f"n_gpu={n_gpu} and tensor_parallel_size={tensor_parallel_size} "
            "disagree: give one of them"
        )
    return n_gpu


def _gpu_indexes(gpu_idx: Any) -> tuple[int, ...] | None:
    if gpu_idx is None:
        return None
    indexes = [gpu_idx] if isinstance(gpu_idx, int) else gpu_idx
    if not isinstance(indexes, list | tuple) or not indexes:
        raise LaunchOptionError(
            f"gpu_idx must be a GPU index or a list of them, got {gpu_idx!r}"
        )
    for index in indexes:
        _require_int("gpu_idx", index, minimum=0)
    if len(set(indexes)) != len(indexes):
        raise LaunchOptionError(f"gpu_idx repeats a GPU: {list(indexes)}")
    return tuple(indexes)


def _require_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise LaunchOptionError(f"{name} must be a boolean, got {value!r}")
    return value


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LaunchOptionError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise LaunchOptionError(f"{name} must be >= {minimum}, got {value}")


def default_model_uid(model_name: str | None, model_path: str | None) -> str:
    """A model's uid when the user gives none: its registry name or its dir name."""
    if model_name:
        return model_name
    if not model_path:
        raise LaunchOptionError("give model_name or model_path")
    return Path(model_path).resolve().name
