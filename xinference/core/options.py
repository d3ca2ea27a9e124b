"""Launch options: parsed and validated once, at the edge, into frozen records.

Everything a user can pass to ``xinference launch``, the REST launch endpoint or the
Python client arrives here as loose keyword values and leaves as one ``LaunchSpec``;
nothing downstream re-parses a string or looks up a default again. Every rule that
can reject a launch lives in ``LaunchSpec.from_options``, so the three front doors
give the same errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model.llm.vllm.xavier.config import DEFAULT_TRANSPORT, XavierConfig, parse_size
from .registry import registered_models

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
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


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

    @classmethod
    def from_options(
        cls,
        *,
        model_uid: str | None = None,
        model_name: str | None = None,
        model_path: str | None = None,
        model_engine: str = "vllm",
        replica: int = 1,
        enable_xavier: bool = False,
        xavier_gpu_cache_bytes: int | str | None = None,
        xavier_transport: str = DEFAULT_TRANSPORT,
        xavier_cross_layer_blocks: bool = False,
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
    ) -> LaunchSpec:
        """Validate raw options; raises ``LaunchOptionError`` with a clear message."""
        if (model_name is None) == (model_path is None):
            raise LaunchOptionError(
                "give exactly one of model_name (a registry name) or model_path"
            )
        if model_path is not None and not Path(model_path).is_dir():
            raise LaunchOptionError(f"model_path {model_path!r} is not a directory")
        if model_name is not None:
            known = registered_models()
            if model_name not in known:
                raise LaunchOptionError(
                    f"unknown model_name {model_name!r}; known: "
                    f"{', '.join(sorted(known))} (or pass model_path)"
                )
        engine_name = (model_engine or "").lower()
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
        if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
            raise LaunchOptionError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
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
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
            ),
            router=RouterSettings(kind=router, busy_margin=router_busy_margin),
            model_path=None if model_path is None else str(Path(model_path).resolve()),
            model_name=model_name,
        )

    def with_model_path(self, path: str) -> LaunchSpec:
        """The same spec once the registry resolved ``model_name`` to a directory."""
        return LaunchSpec(
            model_uid=self.model_uid,
            model_engine=self.model_engine,
            replica=self.replica,
            xavier=self.xavier,
            engine=self.engine,
            router=self.router,
            model_path=path,
            model_name=self.model_name,
        )


def _xavier_config(
    enable_xavier: bool,
    gpu_cache_bytes: int | str | None,
    transport: str,
    cross_layer_blocks: bool,
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
    if tensor_parallel_size > 1 or pipeline_parallel_size > 1:
        raise LaunchOptionError(
            "Xavier supports one device per replica: tensor_parallel_size and "
            f"pipeline_parallel_size must be 1, got {tensor_parallel_size} and "
            f"{pipeline_parallel_size}"
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
        )
    except ValueError as error:
        raise LaunchOptionError(str(error)) from None


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
