"""The Xavier options a user sets at launch, parsed and validated once at the edge.

``XavierConfig`` is frozen and travels unchanged from the launch call to the
connector inside each replica process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_BINARY_UNITS = ("KiB", "MiB", "GiB", "TiB")
_SIZE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")

TRANSPORTS = ("xoscar", "nixl")
# The direct NIXL transport: a load READs exactly its payload, with no control round
# trip per copy (benchmark/results/h200.md measures both transports side by side).
DEFAULT_TRANSPORT = "nixl"
# The log level of the process that started a replica, for the processes vLLM
# spawns under it (its engine core configures only vLLM's own loggers).
LOG_LEVEL_ENV = "XINFERENCE_LOG_LEVEL"
# The log line every process of a cluster writes, the engine core's Xavier lines too.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def parse_size(value: int | str) -> int:
    """Bytes from a non-negative integer or a size such as ``256MiB`` or ``1GB``."""
    if isinstance(value, bool):
        raise ValueError(f"size must be an integer or a string, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be non-negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"size must be an integer or a string, got {value!r}")
    match = _SIZE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"malformed size {value!r}: use non-negative bytes or a number with "
            f"one of the units {', '.join(u for u in _UNITS if u)} (e.g. 256MiB)"
        )
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def format_size(nbytes: int) -> str:
    """``nbytes`` for a person: bytes below 1 KiB, else binary units (``1.5 GiB``)."""
    if nbytes < 1024:
        return f"{nbytes} bytes"
    value = float(nbytes)
    for unit in _BINARY_UNITS:
        value /= 1024
        if value < 1024 or unit == _BINARY_UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class XavierConfig:
    """Per-model Xavier settings.

    ``gpu_cache_bytes``: None keeps snapshots in CPU memory only; 0 selects the
    GPU-first path with no device budget; a positive value is the device tier's
    byte budget (rounded down to whole blocks by the store).
    ``cross_layer_blocks``: ask vLLM for one KV allocation in which a block of
    every layer is contiguous (where its model runner offers it).
    ``remote_loads``: False keeps everything but the loads: replicas still stage
    and publish their blocks, so the tracker (and the cache-aware router) knows who
    holds what, but no replica loads from a peer ("routing only", the baseline
    that tells what moving KV adds to routing each request to its prefix).
    ``fast_path``: the synchronous, lease-free path for bounded remote hits
    (``connector/fast_path.py``); None leaves it to the engine's environment
    (``XAVIER_FAST_PATH``, off when unset), True or False decides regardless of it.
    """

    enabled: bool = False
    gpu_cache_bytes: int | None = None
    transport: str = DEFAULT_TRANSPORT
    cross_layer_blocks: bool = False
    remote_loads: bool = True
    fast_path: bool | None = None

    def __post_init__(self) -> None:
        if self.gpu_cache_bytes is not None and self.gpu_cache_bytes < 0:
            raise ValueError(
                f"xavier_gpu_cache_bytes must be non-negative, got {self.gpu_cache_bytes}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"unknown xavier transport {self.transport!r}; choose one of {TRANSPORTS}"
            )
        if self.fast_path is not None and not isinstance(self.fast_path, bool):
            raise ValueError(
                f"xavier_fast_path must be a boolean or unset, got {self.fast_path!r}"
            )

    @classmethod
    def from_options(
        cls,
        enable_xavier: bool = False,
        xavier_gpu_cache_bytes: int | str | None = None,
        xavier_transport: str = DEFAULT_TRANSPORT,
        xavier_cross_layer_blocks: bool = False,
        xavier_remote_loads: bool = True,
        xavier_fast_path: bool | None = None,
    ) -> XavierConfig:
        size = (
            None
            if xavier_gpu_cache_bytes is None
            else parse_size(xavier_gpu_cache_bytes)
        )
        return cls(
            enabled=bool(enable_xavier),
            gpu_cache_bytes=size,
            transport=xavier_transport,
            cross_layer_blocks=bool(xavier_cross_layer_blocks),
            remote_loads=bool(xavier_remote_loads),
            fast_path=xavier_fast_path,
        )

    @property
    def gpu_first(self) -> bool:
        return self.gpu_cache_bytes is not None

    def describe(self) -> str:
        """The one line the launcher logs."""
        if not self.enabled:
            return "Xavier: off"
        if self.gpu_cache_bytes is None:
            tier = "CPU snapshots only"
        else:
            tier = f"GPU-first, device budget {self.gpu_cache_bytes} bytes"
        layout = ", cross-layer KV blocks" if self.cross_layer_blocks else ""
        loads = "" if self.remote_loads else ", remote loads off (routing only)"
        fast = (
            ""
            if self.fast_path is None
            else f", fast path {'on' if self.fast_path else 'off'}"
        )
        return f"Xavier: on, {tier}, transport {self.transport}{layout}{loads}{fast}"


@dataclass(frozen=True, slots=True)
class XavierReplicaSettings:
    """Everything the connector inside one replica needs, fixed at launch.

    It travels to vLLM's engine-core and worker processes inside
    ``KVTransferConfig.kv_connector_extra_config["xavier"]`` as a plain dict (vLLM
    hashes and copies its config), and is rebuilt with ``from_dict`` on arrival.
    The transfer actor may not exist yet when the engine starts (the launcher creates
    it once every replica has loaded): the connector maps its caches lazily.
    """

    config: XavierConfig
    model_uid: str
    rank: int
    tracker_address: str
    tracker_uid: str
    transfer_address: str  # the replica's nixl:// pool address
    transfer_uid: str  # tensor-parallel rank 0's; see transfer_actor_uid
    rpc_timeout_s: float = 10.0
    # engine ranks of this replica, each with its own transfer actor
    tensor_parallel_size: int = 1

    def to_dict(self) -> dict:
        return {
            "enabled": self.config.enabled,
            "gpu_cache_bytes": self.config.gpu_cache_bytes,
            "transport": self.config.transport,
            "cross_layer_blocks": self.config.cross_layer_blocks,
            "remote_loads": self.config.remote_loads,
            "fast_path": self.config.fast_path,
            "model_uid": self.model_uid,
            "rank": self.rank,
            "tracker_address": self.tracker_address,
            "tracker_uid": self.tracker_uid,
            "transfer_address": self.transfer_address,
            "transfer_uid": self.transfer_uid,
            "rpc_timeout_s": self.rpc_timeout_s,
            "tensor_parallel_size": self.tensor_parallel_size,
        }

    @classmethod
    def from_dict(cls, data: dict) -> XavierReplicaSettings:
        try:
            config = XavierConfig(
                enabled=bool(data["enabled"]),
                gpu_cache_bytes=data["gpu_cache_bytes"],
                transport=data.get("transport", DEFAULT_TRANSPORT),
                cross_layer_blocks=bool(data.get("cross_layer_blocks", False)),
                remote_loads=bool(data.get("remote_loads", True)),
                fast_path=data.get("fast_path"),
            )
            return cls(
                config=config,
                model_uid=str(data["model_uid"]),
                rank=int(data["rank"]),
                tracker_address=str(data["tracker_address"]),
                tracker_uid=str(data["tracker_uid"]),
                transfer_address=str(data["transfer_address"]),
                transfer_uid=str(data["transfer_uid"]),
                rpc_timeout_s=float(data.get("rpc_timeout_s", 10.0)),
                tensor_parallel_size=int(data.get("tensor_parallel_size", 1)),
            )
        except KeyError as missing:
            raise ValueError(f"Xavier replica settings lack {missing}") from None


def transfer_actor_uid(model_uid: str, rank: int, tp_rank: int = 0) -> str:
    """The transfer actor of replica ``rank``'s tensor-parallel rank ``tp_rank``
    (every rank of a replica has its own, in the replica's pool; rank 0's uid is the
    one a single-rank replica has)."""
    base = f"xavier-transfer-{model_uid}-{rank}"
    return base if tp_rank == 0 else f"{base}-tp{tp_rank}"
