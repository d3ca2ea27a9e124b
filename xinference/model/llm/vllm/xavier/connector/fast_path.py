"""Which remote hits load synchronously in a GPU-first deployment, and how long
the engine may wait for one.

A remote hit loaded asynchronously costs the request engine passes (vLLM skips it
until a poll says the load finished) and actor round trips on its path; a local
prefix hit costs neither. A hit whose load is bounded is therefore answered
``(n, False)``: vLLM schedules the request in the pass that looked it up, and the
worker half completes the load in that step's ``start_load_kv``, before attention
reads the blocks. Bounded means: every key is in the holder's device tier (a CPU-tier
snapshot is read through the holder's own process), the holder runs on this host
(no network between the two), and the bytes move within ``max_s`` at a conservative
rate. The wait itself has a hard bound (``bound_s``); a load past it is reported
failed (vLLM recomputes its blocks), its writes are fenced off by the loading actor
before the engine goes on (``LoadRunner.run_bounded``), and its holder is kept off
the synchronous path for ``backoff_s``. Everything else stays asynchronous. With ``lease_free`` (NIXL between the actors)
a synchronous hit whose locations the holder published needs no reservation
either, and the worker READs it from its own agent (``lease_free.py``,
``direct_reads.py``): no actor round trip on its path.

The synchronous path is opt-in: the launch option ``xavier_fast_path`` turns it on
or off (``XavierConfig.fast_path``); left unset, ``XAVIER_FAST_PATH=1`` in the
engine's environment turns it on (benchmarks compare both in one run). It stays
off by default until it has run on a GPU host: on the busy 2-core CPU machine a
load's Python alone can take more than the default bound, and a hit that misses
its bound is recomputed, so on such a host it costs a recomputation instead of
saving passes.
``XAVIER_FAST_PATH_BASE_MS`` sets the fixed part of the bound (default 2 ms; a host
whose Python is slow needs more), within the 10 ms cap.

The bytes' part is priced at a rate that any two devices of one host reach: 1 GB/s
between host processes (vLLM on CPU: shared memory through a Python scatter), and
25 GB/s between CUDA devices (PCIe peer copies; NVLink and copies within one GPU
run 10-60x faster). At 1 GB/s no GPU-sized load ever qualified: on an H100 a 512-token
hit of an 8B model is 64 MiB, 67 ms at that rate, so every hit went asynchronous
(benchmark/results/fast-path.md, 2026-12-05 evening). ``XAVIER_FAST_PATH_GBPS``
overrides the rate, e.g. for a host whose replicas share one GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..config import XavierReplicaSettings
from ..wire import DEVICE_TIER

FAST_PATH_ENV = "XAVIER_FAST_PATH"
FAST_PATH_BASE_ENV = "XAVIER_FAST_PATH_BASE_MS"
FAST_PATH_RATE_ENV = "XAVIER_FAST_PATH_GBPS"
DEFAULT_BASE_S = 0.002  # fixed cost of a bounded load: one call, one fence
MAX_BOUND_S = 0.010  # no synchronous wait is longer than this
HOST_COPY_BYTES_PER_S = 1e9  # between host processes, through Python
CUDA_COPY_BYTES_PER_S = 25e9  # between CUDA devices of one host, PCIe at worst


def fast_path_enabled(explicit: bool | None = None) -> bool:
    """Whether the synchronous path is on: the launch option when it was given
    (``explicit``), else this process's environment."""
    if explicit is not None:
        return explicit
    return os.environ.get(FAST_PATH_ENV, "0").strip().lower() in ("1", "true", "on")


def _env_number(name: str, unit: str) -> float | None:
    """The number in environment variable ``name`` (in ``unit``), None if unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of {unit}, got {raw!r}") from None


def fast_path_base_s() -> float:
    """The bound's fixed part from the environment (milliseconds), capped."""
    base_ms = _env_number(FAST_PATH_BASE_ENV, "milliseconds")
    if base_ms is None:
        return DEFAULT_BASE_S
    if not 0 < base_ms <= MAX_BOUND_S * 1e3:
        raise ValueError(
            f"{FAST_PATH_BASE_ENV} must be in (0, {MAX_BOUND_S * 1e3:g}] ms, "
            f"got {base_ms:g}"
        )
    return base_ms / 1e3


def fast_path_bytes_per_s(engine_on_cuda: bool) -> float:
    """The rate a bounded load's bytes are priced at: the environment's
    (``XAVIER_FAST_PATH_GBPS``, decimal gigabytes per second) when set, else the
    conservative one for where the engine's KV lives."""
    rate = _env_number(FAST_PATH_RATE_ENV, "GB/s")
    if rate is None:
        return CUDA_COPY_BYTES_PER_S if engine_on_cuda else HOST_COPY_BYTES_PER_S
    if not 0 < rate < float("inf"):
        raise ValueError(f"{FAST_PATH_RATE_ENV} must be positive GB/s, got {rate:g}")
    return rate * 1e9


def address_host(address: str) -> str:
    """The host of an xoscar address (``nixl://127.0.0.1:1234`` -> ``127.0.0.1``)."""
    parsed = urlsplit(address if "://" in address else f"//{address}")
    return parsed.hostname or ""


@dataclass(slots=True)
class SyncLoadPolicy:
    """Decides the synchronous path per hit; remembers holders that missed it."""

    enabled: bool
    host: str  # this replica's transfer actor's host
    base_s: float = DEFAULT_BASE_S
    bytes_per_s: float = HOST_COPY_BYTES_PER_S  # a conservative rate on one host
    max_s: float = MAX_BOUND_S
    backoff_s: float = 30.0
    # the worker READs lease-free grants itself (NIXL between the actors): a hit
    # whose locations were published needs no reservation (``lease_free.py``)
    lease_free: bool = False
    # holder address -> monotonic time until which its hits load asynchronously
    _backed_off: dict[str, float] = field(default_factory=dict)
    # holders a load already succeeded from: the first load from a peer also
    # meets it (endpoint, connection), far slower than any bound, so it is async
    _met: set[str] = field(default_factory=set)

    def bound_s(
        self, holder_address: str, tiers: Sequence[str], nbytes: int
    ) -> float | None:
        """The hard bound of a synchronous load of ``nbytes`` in ``tiers`` from
        ``holder_address``, or None: load it asynchronously."""
        if not self.enabled or not tiers:
            return None
        if any(tier != DEVICE_TIER for tier in tiers):
            return None
        if address_host(holder_address) != self.host:
            return None
        if holder_address not in self._met:
            return None
        until = self._backed_off.get(holder_address)
        if until is not None:
            if time.monotonic() < until:
                return None
            del self._backed_off[holder_address]
        bound = self.base_s + nbytes / self.bytes_per_s
        return bound if bound <= self.max_s else None

    def met(self, holder_address: str) -> None:
        """A load from ``holder_address`` succeeded: its peer is set up."""
        self._met.add(holder_address)

    def missed(self, holder_address: str) -> None:
        """A synchronous load from ``holder_address`` failed or ran past its bound."""
        self._backed_off[holder_address] = time.monotonic() + self.backoff_s


def sync_load_policy(
    options: XavierReplicaSettings, engine_on_cuda: bool
) -> SyncLoadPolicy:
    """The scheduler half's policy for a replica launched with ``options`` whose
    engine keeps its KV on a CUDA device (``engine_on_cuda``) or in host memory."""
    return SyncLoadPolicy(
        # the bound is per load; a tensor-parallel one is N loads
        enabled=fast_path_enabled(options.config.fast_path)
        and options.tensor_parallel_size == 1,
        host=address_host(options.transfer_address),
        base_s=fast_path_base_s(),
        bytes_per_s=fast_path_bytes_per_s(engine_on_cuda),
        lease_free=options.config.transport == "nixl",
    )


def direct_reads_wanted(options: XavierReplicaSettings) -> bool:
    """Whether the worker half READs lease-free hits itself: the fast path on,
    GPU-first (a device tier to read from) and NIXL between the actors."""
    return (
        options.config.gpu_first
        and fast_path_enabled(options.config.fast_path)
        and options.config.transport == "nixl"
    )
