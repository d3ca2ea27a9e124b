"""Device-tier loads through a NIXL agent of our own: one registration, one READ.

Why not ``xo.copy_to``: every copy through xoscar's NIXL channel costs two control
round trips (prepare, finish), a device synchronisation on both ends and, whenever the
buffer objects change, a re-registration (see ``platform-notes.md``: 0.6 to 0.95 ms per
copy on an H200, against about 25 us for a NIXL transfer between memory registered
once). Used directly, one registration covers every sub-range of an allocation, so a
transfer can move exactly the payload's bytes.

How a load works here:

- Every transfer actor owns one ``NixlAgentEndpoint``: one NIXL agent (UCX backend)
  with, registered once at start, the store's device tier rows, a receive slab and,
  optionally, the engine's KV cache as mapped in the actor.
- A holder publishes ``NixlEndpointInfo``: its agent name, a generation number and
  *partial* NIXL metadata covering only its device tier rows (peers cannot address
  anything else of ours). A loader loads it once per peer and again only when the
  generation (or the agent) changes.
- The loader learns where the leased snapshots sit in the holder's rows
  (``NixlSource``, from the lease) and pulls them with one NIXL READ per chunk. The
  holder's CPU does nothing: no packing, no handshake, no completion message; the
  loader sees completion by polling the transfer state.
- Placement ``engine`` (default) reads straight into the destination engine blocks,
  one descriptor per contiguous (block, layer) piece: one per row in block-major
  layouts, two (K and V) in the K/V-first layout; nothing is copied afterwards.
  Placement ``slab`` reads into the receive slab, one descriptor per contiguous run
  of holder rows, and hands the rows to the caller's ``scatter``. Wire bytes equal
  useful bytes in both.

The two placements trade differently. ``engine`` saves the scatter (on the CPU machine
it was the faster one at 1, 16 and 64 blocks: see ``benchmark/transport_benchmark.py``)
but posts L or 2L descriptors per block, each a UCX operation (about 2 us with
``cma``, a copy launch with ``cuda_ipc``); ``slab`` posts one per run of blocks. And a
READ that misses its deadline may still land later on transports that need the peer's
progress (``tcp``): with ``slab`` the slab is retired and no engine block is written
late, with ``engine`` the destination blocks stay at risk (the timeout error says so,
``destination_at_risk``). A load falls back to the slab when the engine cache could not
be registered (on a GPU it is a CUDA IPC mapping, which a backend may refuse) or when
the caller gives no destination blocks.

Deadlines: every READ has one (``transfer_timeout_s``); a lost peer fails the load
with ``NixlTransferError`` (UCX reports the disconnect) and a stalled one with
``NixlTransferTimeout``. A timed-out READ is kept as an orphan until it ends; loads
from that peer are refused meanwhile, so a stalled peer costs one deadline, not one
per load.

UCX on VRAM: an endpoint holding VRAM turns on cuda_ipc's get zero-copy and turns
off UCX's software emulation for its agent (``VRAM_UCX_SETTINGS``), and every loader
READs one row from each peer it meets (``add_peer``), so a READ that would crawl over
TCP fails when the peer is met, saying why, rather than on every load.

Device-generic: CPU tensors are NIXL DRAM, CUDA tensors VRAM; nothing else differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import xoscar as xo

from .aio import finish_even_if_cancelled
from .device import DeviceWorkMark
from .gpu_transfer import ScatterFn, full_slab_bytes
from .hashing import BlockHash
from .layout import BlockPieces
from .messages import DEVICE_TIER, KVGeometry, PushRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")

PLACEMENT_SLAB = "slab"
PLACEMENT_ENGINE = "engine"
PLACEMENTS = (PLACEMENT_SLAB, PLACEMENT_ENGINE)

# Posting a READ performs the whole copy inside the call on some UCX transports (cma
# calls process_vm_readv there: 12 MiB took 2-14 ms on the CPU machine), so a post
# runs on the event loop only when it is surely short; larger ones go to a thread.
# On VRAM a post only queues copies, so there the descriptor count is what matters.
INLINE_POST_MAX_BYTES = 256 * 1024
INLINE_POST_MAX_DESCRIPTORS = 64
# Completion polling: spin on the transfer state right after the post for this long
# (the actor's event loop waits meanwhile; a VRAM READ over cuda_ipc is done within
# it), then yield to the event loop (asyncio.sleep(0)) for YIELD_POLL_S, then
# sleep with exponential backoff. Sub-millisecond sleeps are not worth asking for:
# the selector rounds its timeout up to whole milliseconds.
SPIN_POLL_S = 100e-6
YIELD_POLL_S = 200e-6
FIRST_POLL_SLEEP_S = 1e-4
MAX_POLL_SLEEP_S = 1e-3
# An engine layout whose block splits into more pieces than this is not worth
# addressing piece by piece; such an engine uses slab placement.
MAX_ENGINE_SEGMENTS = 8
# UCX settings that decide which transports carry our bytes (logged at start).
UCX_ENV_VARS = (
    "UCX_TLS",
    "UCX_NET_DEVICES",
    "UCX_MEMTYPE_CACHE",
    "UCX_RNDV_THRESH",
    "UCX_PROTO_ENABLE",
    "UCX_PROTO_EMULATION_ENABLE",
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY",
)
# What an endpoint holding VRAM creates its agent with, unless this process's
# environment says otherwise. UCX 1.23 turns cuda_ipc's get zero-copy (the copy a
# READ needs) on only on platforms it knows to be fast ("auto"); on the lent H200 it
# stayed off, and every VRAM READ fell back to "software emulation" over tcp/lo
# while WRITEs used cuda_ipc. With emulation off as well, a VRAM READ without a
# zero-copy path fails (at the peer check, below) instead of crawling through a
# socket. UCX reads both when the agent's context and worker are created.
VRAM_UCX_SETTINGS = (
    ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on"),
    ("UCX_PROTO_EMULATION_ENABLE", "n"),
)
# How long the agent's progress thread waits for UCX events when it has nothing to
# do, in microseconds. NIXL 1.5's Python ``nixl_agent`` creates every agent with 0,
# which makes the thread busy-poll: each idle agent kept one core at 100%, and with
# one agent per transfer actor a 2-core machine lost its cores to idle spinning.
# The wait ends early on a UCX event, so this bounds idle wakeups, not latency.
# XAVIER_NIXL_PROGRESS_DELAY_US overrides it (0 restores NIXL's busy polling).
PROGRESS_THREAD_DELAY_US = 1_000
PROGRESS_THREAD_DELAY_ENV = "XAVIER_NIXL_PROGRESS_DELAY_US"
# os.environ and the binding patch below are process-wide: one agent creation at a
# time changes them.
_UCX_ENV_LOCK = threading.Lock()
# UCP feature bits (ucp.h): RMA for READ, AM for NIXL's notifications.
_UCP_FEATURE_RMA = 1 << 1
_UCP_FEATURE_AM = 1 << 6
_UCP_PARAM_FIELD_FEATURES = 1 << 0

# Memory that a READ which never reached a terminal state may still write, with the
# agent that owns the request: kept alive for the life of the process, because freeing
# it would let a late write land in memory reused for something else.
_QUARANTINE: list[Any] = []


class NixlTransferError(RuntimeError):
    """A NIXL READ failed (peer lost, memory not registered, bad request)."""


class NixlTransferTimeout(NixlTransferError, TimeoutError):
    """A NIXL READ did not complete within its deadline.

    ``destination_at_risk``: the READ targeted engine blocks (engine placement) and
    may still write them; the caller must not hand those blocks to anyone else. A
    READ into the receive slab never puts engine memory at risk (the slab is
    retired instead).
    """

    def __init__(self, message: str, destination_at_risk: bool) -> None:
        super().__init__(message)
        self.destination_at_risk = destination_at_risk

    def __reduce__(self) -> tuple[Any, ...]:
        # keeps the flag when the error crosses processes (actor calls pickle it)
        return (type(self), (str(self), self.destination_at_risk))


def _nixl_errors() -> tuple[type[BaseException], ...]:
    """The exception classes of NIXL's bindings (each derives from Exception)."""
    try:
        import nixl._bindings as bindings  # type: ignore[import-not-found]
    except ImportError:
        return ()
    return tuple(
        value
        for name, value in vars(bindings).items()
        if name.startswith("nixl")
        and name.endswith("Error")
        and isinstance(value, type)
        and issubclass(value, Exception)
    )


# ---- what crosses processes ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NixlRegion:
    """A registered memory region: NIXL memory type, address, length, device id."""

    mem_type: str  # "DRAM" or "VRAM"
    address: int
    nbytes: int
    device_id: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> NixlRegion:
        if not tensor.is_contiguous():
            raise ValueError("NIXL regions must be contiguous tensors")
        return cls(
            mem_type=_mem_type(tensor.device),
            address=tensor.data_ptr(),
            nbytes=tensor.numel() * tensor.element_size(),
            device_id=_device_id(tensor.device),
        )


@dataclass(frozen=True, slots=True)
class NixlEndpointInfo:
    """What a loader needs to read a holder's device tier, fetched once per peer.

    ``metadata`` is NIXL partial metadata: connection info plus the device tier rows
    only. ``generation`` changes whenever the holder re-registers those rows; with
    ``agent_name`` it is the epoch a ``NixlSource`` refers to.
    """

    agent_name: str
    generation: int
    metadata: bytes
    store: NixlRegion | None  # None: the holder has no device tier
    row_bytes: int

    @property
    def epoch(self) -> tuple[str, int]:
        return self.agent_name, self.generation

    @property
    def num_store_rows(self) -> int:
        return 0 if self.store is None else self.store.nbytes // self.row_bytes


@dataclass(frozen=True, slots=True)
class NixlSource:
    """Where leased snapshots sit in a holder's device tier: ``first_rows[i]`` is the
    row of layer 0 of the i-th key (its layers follow), in the epoch named."""

    agent_name: str
    generation: int
    first_rows: tuple[int, ...]

    @property
    def epoch(self) -> tuple[str, int]:
        return self.agent_name, self.generation


def locate_device_rows(
    store: Any, lease_id: str, keys: Sequence[BlockHash]
) -> tuple[int, ...]:
    """Holder side: the device tier row of layer 0 of each leased key.

    ``store`` is a ``TieredKVSnapshotStore`` (anything with its ``locate``). A key in
    another tier is an error: the caller asked the wrong path for it.
    """
    rows = []
    for key in keys:
        tier, first_row = store.locate(lease_id, key)
        if tier != DEVICE_TIER:
            raise ValueError(
                f"snapshot {key.hex()} under lease {lease_id!r} is in the {tier} "
                "tier; only device tier snapshots are read over NIXL"
            )
        rows.append(first_row)
    return tuple(rows)


# ---- the UCX transports in use ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UcxReport:
    """The UCX settings and resources this process's agent works with.

    ``resources`` lists UCX's transport/device pairs (``"cma/memory"``,
    ``"tcp/lo"``, ``"cuda_ipc/cuda"``, ...) as a UCP context with this process's
    UCX configuration sees them; a list with nothing but ``tcp`` and ``self`` means
    every byte goes through TCP sockets.
    """

    ucx_version: str
    env: tuple[tuple[str, str], ...]
    resources: tuple[str, ...]
    backend_params: tuple[tuple[str, str], ...]
    backend_mem_types: tuple[str, ...]
    probe_error: str | None = None
    # the part of ``env`` set for this agent only (``VRAM_UCX_SETTINGS``)
    applied: tuple[tuple[str, str], ...] = ()

    @property
    def transports(self) -> tuple[str, ...]:
        return tuple(sorted({r.split("/", 1)[0] for r in self.resources}))

    @property
    def tcp_only(self) -> bool:
        return bool(self.resources) and set(self.transports) <= {"tcp", "self"}

    def describe(self) -> str:
        env = (
            ", ".join(
                f"{k}={v}" + (" (set for this agent)" if (k, v) in self.applied else "")
                for k, v in self.env
            )
            or "no UCX_* overrides"
        )
        if self.probe_error is not None:
            found = f"resources unknown ({self.probe_error})"
        else:
            found = "resources " + (", ".join(self.resources) or "none")
        params = ", ".join(f"{k}={v}" for k, v in self.backend_params) or "defaults"
        return (
            f"UCX {self.ucx_version}; {env}; {found}; NIXL UCX backend params "
            f"{params}, memory types {', '.join(self.backend_mem_types) or 'none'}"
        )


def probe_ucx(agent: Any, applied: tuple[tuple[str, str], ...] = ()) -> UcxReport:
    """Report the UCX transports available to ``agent``'s process.

    Reads the UCX_* environment and the NIXL backend's parameters, then opens a
    throwaway UCP context through the very ``libucp`` NIXL loaded (found in
    ``/proc/self/maps``) and lists its resources, which is what ``ucx_info -d`` would
    print for this configuration. Call it with the environment the agent was created
    with (``applied``: the settings made for this agent only). Never raises: a
    failed probe is in the report.
    """
    env = tuple((name, os.environ[name]) for name in UCX_ENV_VARS if name in os.environ)
    params: tuple[tuple[str, str], ...] = ()
    mem_types: tuple[str, ...] = ()
    try:
        params = tuple(sorted(agent.get_backend_params("UCX").items()))
        mem_types = tuple(agent.get_backend_mem_types("UCX"))
    except Exception as exc:  # reported, not raised: a report must not stop a start
        logger.warning("could not read the NIXL UCX backend parameters: %r", exc)
    try:
        version, resources = _ucp_resources()
        error = None
    except Exception as exc:  # reported in the result (probe_error)
        version, resources, error = "unknown", (), f"{type(exc).__name__}: {exc}"
    return UcxReport(version, env, resources, params, mem_types, error, applied)


@contextlib.contextmanager
def ucx_settings(
    settings: Sequence[tuple[str, str]],
) -> Iterator[tuple[tuple[str, str], ...]]:
    """Set each of ``settings`` that the environment does not already set, for the
    duration of the block; yields the ones it set."""
    with _UCX_ENV_LOCK:
        applied = tuple((k, v) for k, v in settings if k not in os.environ)
        os.environ.update(applied)
        try:
            yield applied
        finally:
            for name, _ in applied:
                os.environ.pop(name, None)


@contextlib.contextmanager
def _progress_thread_delay(api: Any, delay_us: int) -> Iterator[None]:
    """Make agents created by ``api.nixl_agent`` within the block use ``delay_us``
    as their progress thread delay.

    ``nixl_agent.__init__`` builds its ``nixlAgentConfig`` itself and assigns
    ``pthrDelay = 0`` with no way to pass another value, so for the duration of the
    block the binding module seen by ``api`` hands out a config whose ``pthrDelay``
    ignores that assignment. Call it holding ``_UCX_ENV_LOCK``.
    """
    bindings: Any = getattr(api, "nixlBind", None)
    base: Any = getattr(bindings, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        # Another NIXL than the one this was written for (1.5): keep its default.
        logger.warning(
            "cannot set the NIXL progress thread delay in this NIXL version; its "
            "progress thread may poll without pause"
        )
        yield
        return

    class DelayedConfig(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            base.pthrDelay.__set__(self, delay_us)

        def __setattr__(self, name: str, value: Any) -> None:
            if name != "pthrDelay":
                super().__setattr__(name, value)

    bindings.nixlAgentConfig = DelayedConfig
    try:
        yield
    finally:
        bindings.nixlAgentConfig = base


def progress_thread_delay_us() -> int:
    """The progress thread delay for new agents: the environment's, else ours."""
    text = os.environ.get(PROGRESS_THREAD_DELAY_ENV)
    if text is None:
        return PROGRESS_THREAD_DELAY_US
    try:
        delay = int(text)
    except ValueError:
        delay = -1
    if delay < 0:
        raise ValueError(
            f"{PROGRESS_THREAD_DELAY_ENV} must be a whole number of microseconds "
            f">= 0, got {text!r}"
        )
    return delay


def _loaded_library(fragment: str) -> str:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            path = line.split()[-1]
            if fragment in os.path.basename(path):
                return path
    raise FileNotFoundError(f"no {fragment} loaded in this process")


def _ucp_resources() -> tuple[str, tuple[str, ...]]:
    ucp = ctypes.CDLL(_loaded_library("libucp"))
    libc = ctypes.CDLL(None)
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    ucp.ucp_get_version.argtypes = [ctypes.POINTER(ctypes.c_uint)] * 3
    ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    version = f"{major.value}.{minor.value}.{release.value}"

    ucp.ucp_config_read.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    ucp.ucp_init_version.argtypes = [
        ctypes.c_uint,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    ucp.ucp_context_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    ucp.ucp_cleanup.argtypes = [ctypes.c_void_p]
    ucp.ucp_config_release.argtypes = [ctypes.c_void_p]
    libc.tmpfile.restype = ctypes.c_void_p
    libc.fflush.argtypes = [ctypes.c_void_p]
    libc.rewind.argtypes = [ctypes.c_void_p]
    libc.fileno.argtypes = [ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]

    config = ctypes.c_void_p()
    status = ucp.ucp_config_read(None, None, ctypes.byref(config))
    if status != 0:
        raise RuntimeError(f"ucp_config_read failed with status {status}")
    try:
        # ucp_params_t starts with field_mask and features; UCX reads only the fields
        # the mask names. The buffer is larger than the struct and zeroed.
        params = (ctypes.c_uint64 * 64)()
        params[0] = _UCP_PARAM_FIELD_FEATURES
        params[1] = _UCP_FEATURE_RMA | _UCP_FEATURE_AM
        context = ctypes.c_void_p()
        status = ucp.ucp_init_version(
            major.value, minor.value, params, config, ctypes.byref(context)
        )
        if status != 0:
            raise RuntimeError(f"ucp_init failed with status {status}")
        try:
            stream = libc.tmpfile()
            if not stream:
                raise OSError("tmpfile() failed")
            try:
                ucp.ucp_context_print_info(context, stream)
                libc.fflush(stream)
                libc.rewind(stream)
                text = _read_all(libc.fileno(stream))
            finally:
                libc.fclose(stream)
        finally:
            ucp.ucp_cleanup(context)
    finally:
        ucp.ucp_config_release(config)
    # Lines look like "#      resource 5  :  md 4  dev 0  flags -- cma/memory".
    resources = tuple(
        line.split()[-1] for line in text.splitlines() if " resource " in line
    )
    return version, resources


def _read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


# ---- where a block's bytes live in the engine's cache -------------------------------


@dataclass(frozen=True, slots=True)
class EngineBlockMap:
    """Addresses of every (block, layer) piece of the engine's KV cache (the fields
    of ``layout.BlockPieces``), with the allocations NIXL registers for them."""

    mem_type: str
    device_id: int
    regions: tuple[NixlRegion, ...]  # the distinct allocations the layers live in
    layer_bases: tuple[int, ...]
    block_stride: int
    segment_offsets: tuple[int, ...]
    segment_nbytes: int
    num_blocks: int

    @classmethod
    def from_layers(
        cls, layers: Sequence[torch.Tensor], block_axis: int, row_bytes: int
    ) -> EngineBlockMap:
        """Describe per-layer KV tensors whose block axis is ``block_axis``."""
        pieces = BlockPieces.of(layers, block_axis)
        nbytes = pieces.segment_nbytes * len(pieces.segment_offsets)
        if nbytes != row_bytes:
            raise ValueError(
                f"an engine block of one layer has {nbytes} bytes, the geometry says "
                f"{row_bytes}"
            )
        regions: dict[int, NixlRegion] = {}
        for tensor in layers:
            storage = tensor.untyped_storage()
            regions.setdefault(
                storage.data_ptr(),
                NixlRegion(
                    _mem_type(tensor.device),
                    storage.data_ptr(),
                    storage.nbytes(),
                    _device_id(tensor.device),
                ),
            )
        device = layers[0].device
        return cls(
            mem_type=_mem_type(device),
            device_id=_device_id(device),
            regions=tuple(regions.values()),
            layer_bases=pieces.layer_bases,
            block_stride=pieces.block_stride,
            segment_offsets=pieces.segment_offsets,
            segment_nbytes=pieces.segment_nbytes,
            num_blocks=pieces.num_blocks,
        )


# ---- read plans: descriptor lists for one READ ---------------------------------------


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Matching local and remote descriptors ``(address, length, device id)`` as
    ``(n, 3)`` uint64 arrays; ``nbytes`` is their total length."""

    local: np.ndarray
    remote: np.ndarray
    nbytes: int

    @property
    def descriptors(self) -> int:
        return int(self.local.shape[0])


def _u64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def _merged_plan(
    local: np.ndarray,
    remote: np.ndarray,
    length: np.ndarray,
    local_device: int,
    remote_device: int,
) -> ReadPlan:
    """Join neighbouring descriptors that continue each other on both sides."""
    local, remote, length = local.ravel(), remote.ravel(), length.ravel()
    if local.size:
        continues = (local[:-1] + length[:-1] == local[1:]) & (
            remote[:-1] + length[:-1] == remote[1:]
        )
        starts = np.flatnonzero(np.concatenate(([True], ~continues)))
        length = np.add.reduceat(length, starts)
        local, remote = local[starts], remote[starts]
    n = local.size
    return ReadPlan(
        local=np.stack([local, length, np.full(n, local_device, np.uint64)], axis=1),
        remote=np.stack([remote, length, np.full(n, remote_device, np.uint64)], axis=1),
        nbytes=int(length.sum()),
    )


def plan_slab_read(
    first_rows: Sequence[int],
    num_layers: int,
    row_bytes: int,
    store: NixlRegion,
    slab: NixlRegion,
    first_row: int,
    num_rows: int,
) -> ReadPlan:
    """Global rows ``first_row .. first_row + num_rows - 1`` of the keys whose layer 0
    sits at ``first_rows`` in the holder's ``store``, into the slab's first bytes.

    A key's layers are consecutive holder rows, so the plan is built per key (a
    load's time is counted in microseconds; this is on its path): one descriptor
    per run of keys whose rows continue each other in the holder.
    """
    if num_rows * row_bytes > slab.nbytes:
        raise ValueError(f"{num_rows} rows do not fit a {slab.nbytes}-byte slab")
    local: list[int] = []
    remote: list[int] = []
    length: list[int] = []
    offset = 0

    def add(holder_row: int, count: int) -> None:
        nonlocal offset
        address = store.address + holder_row * row_bytes
        nbytes = count * row_bytes
        if length and remote[-1] + length[-1] == address:
            length[-1] += nbytes  # the slab side always continues
        else:
            local.append(slab.address + offset)
            remote.append(address)
            length.append(nbytes)
        offset += nbytes

    end = first_row + num_rows
    key, layer = divmod(first_row, num_layers)
    if layer:  # a chunk may start inside a key
        count = min(num_layers - layer, num_rows)
        add(first_rows[key] + layer, count)
        key += 1
    whole_end = end // num_layers
    if key < whole_end:
        # whole keys: one descriptor per run of keys stored back to back
        run_start = run_end = first_rows[key]
        for row in first_rows[key + 1 : whole_end]:
            if row != run_end + num_layers:
                add(run_start, run_end - run_start + num_layers)
                run_start = row
            run_end = row
        add(run_start, run_end - run_start + num_layers)
        key = whole_end
    if key * num_layers < end and key * num_layers >= first_row:
        add(first_rows[key], end - key * num_layers)  # a chunk may end inside one
    n = len(length)
    return ReadPlan(
        local=_u64([local, length, [slab.device_id] * n]).T.copy(),
        remote=_u64([remote, length, [store.device_id] * n]).T.copy(),
        nbytes=offset,
    )


def plan_engine_read(
    first_rows: Sequence[int],
    dst_blocks: Sequence[int],
    num_layers: int,
    row_bytes: int,
    store: NixlRegion,
    engine: EngineBlockMap,
) -> ReadPlan:
    """Every layer of each key straight into its engine block, piece by piece."""
    first = _u64(first_rows)[:, None, None]
    blocks = _u64(dst_blocks)[:, None, None]
    layers = np.arange(num_layers, dtype=np.uint64)[None, :, None]
    pieces = np.arange(len(engine.segment_offsets), dtype=np.uint64)[None, None, :]
    seg = np.uint64(engine.segment_nbytes)
    remote = (
        np.uint64(store.address)
        + (first + layers) * np.uint64(row_bytes)
        + pieces * seg
    )
    local = (
        _u64(engine.layer_bases)[None, :, None]
        + blocks * np.uint64(engine.block_stride)
        + _u64(engine.segment_offsets)[None, None, :]
    )
    remote, local = np.broadcast_arrays(remote, local)
    length = np.full(local.shape, seg, dtype=np.uint64)
    return _merged_plan(local, remote, length, engine.device_id, store.device_id)


# ---- the endpoint: one agent, memory registered once ----------------------------------


# Where a READ lands, which decides what a READ that misses its deadline puts at risk.
DEST_SLAB = "slab"  # the receive slab: retired, a fresh one takes its place
DEST_ENGINE = "engine"  # engine blocks: the caller must not reuse them
DEST_PROBE = "probe"  # the peer check's scratch row: nothing reads it


@dataclass(frozen=True, slots=True)
class PeerPath:
    """The outcome of the READ a loader makes when it meets a peer: which memory
    types it joined, how many bytes, how long (connection setup included).

    ``zero_copy_only``: UCX's software emulation was off in this agent, so the READ
    succeeded over a zero-copy protocol (for VRAM: cuda_ipc, not TCP).
    """

    peer: str
    local_mem_type: str
    remote_mem_type: str
    nbytes: int
    seconds: float
    zero_copy_only: bool

    def describe(self) -> str:
        path = "zero-copy" if self.zero_copy_only else "UCX's choice"
        return (
            f"{self.remote_mem_type}->{self.local_mem_type} READ of {self.nbytes} "
            f"bytes from {self.peer} in {self.seconds * 1e6:.0f} us ({path})"
        )


@dataclass(slots=True)
class _Orphan:
    """A READ that missed its deadline and has not ended yet."""

    handle: Any
    peer: str
    since: float
    # memory it may still write, kept alive until it ends: (tensor, registration)
    hold: tuple[torch.Tensor, Any] | None


class NixlAgentEndpoint:
    """One NIXL agent with the transfer actor's memory registered once.

    Build it with ``await NixlAgentEndpoint.create(...)`` (agent creation and
    registration are blocking, so they run in a thread). Registered at start: the
    device tier rows (what peers read), the receive slab (``slab`` placement), one
    scratch row for the peer check and, when given, the engine's KV layers
    (``engine`` placement). After that nothing is registered again, except a fresh
    receive slab when a READ into the old one missed its deadline
    (``registrations`` counts every registration).

    An endpoint on VRAM creates its agent with ``VRAM_UCX_SETTINGS`` (unless the
    environment sets them), and ``add_peer`` READs one row from each new peer: with
    UCX's emulation off, that READ fails when UCX has no zero-copy path, so a TCP
    fallback shows up when a peer is met, not as slow loads.
    """

    def __init__(
        self,
        name: str,
        *,
        row_bytes: int,
        store_rows: torch.Tensor,
        slab_bytes: int,
        engine_layers: Sequence[torch.Tensor] | None = None,
        engine_block_axis: int | None = None,
    ) -> None:
        """Checks and allocations only; ``create`` also starts the agent.

        ``store_rows``: the device tier, ``(rows, row_bytes)`` uint8 (may have 0
        rows); the receive slab is allocated on its device. ``engine_layers``: the
        engine's per-layer KV tensors as mapped here, with their block axis.
        """
        if row_bytes <= 0 or slab_bytes < row_bytes:
            raise ValueError(
                f"need row_bytes > 0 and a slab of at least one row, got "
                f"row_bytes={row_bytes}, slab_bytes={slab_bytes}"
            )
        if store_rows.dtype != torch.uint8 or store_rows.dim() != 2:
            raise ValueError("store_rows must be a 2-D uint8 tensor")
        if store_rows.shape[1] != row_bytes or not store_rows.is_contiguous():
            raise ValueError(
                f"store_rows must be contiguous ({store_rows.shape[0]}, {row_bytes})"
            )
        engine_map = None
        if engine_layers is not None:
            if engine_block_axis is None:
                raise ValueError("engine_layers need engine_block_axis")
            engine_map = EngineBlockMap.from_layers(
                engine_layers, engine_block_axis, row_bytes
            )
            if len(engine_map.segment_offsets) > MAX_ENGINE_SEGMENTS:
                logger.warning(
                    "engine KV blocks split into %d pieces each; engine placement "
                    "is off, loads go through the receive slab",
                    len(engine_map.segment_offsets),
                )
                engine_map = None
        self.agent_name = f"xavier-{name}-{uuid.uuid4().hex[:12]}"
        self.row_bytes = row_bytes
        self.device = store_rows.device
        self.generation = 1
        self.registrations = 0
        self.ucx_report: UcxReport | None = None
        self.progress_delay_us = PROGRESS_THREAD_DELAY_US
        self.zero_copy_only = False
        self._agent: Any = None
        self._nixl_errors = _nixl_errors()
        self._store_rows = store_rows
        self._store_reg: Any = None
        # Zeroed once, so a slab never exposes stale memory.
        self._slab = torch.zeros(slab_bytes, dtype=torch.uint8, device=self.device)
        self._slab_region = NixlRegion.of(self._slab)
        self._slab_reg: Any = None
        self._probe = torch.zeros(row_bytes, dtype=torch.uint8, device=self.device)
        self._probe_reg: Any = None
        self.peer_paths: dict[str, PeerPath] = {}
        # Kept so that the mapped engine memory outlives its registration.
        self._engine_layers = (
            list(engine_layers) if engine_layers is not None and engine_map else []
        )
        self._engine_map = engine_map
        self._engine_regs: Any = None
        self._info: NixlEndpointInfo | None = None
        # remote agent name -> generation loaded
        self._peers: dict[str, int] = {}
        # remote agent name -> READs from it that missed their deadline, not ended
        self._orphans: dict[str, list[_Orphan]] = {}
        self._closed = False

    @classmethod
    async def create(
        cls,
        name: str,
        *,
        row_bytes: int,
        store_rows: torch.Tensor,
        slab_bytes: int,
        engine_layers: Sequence[torch.Tensor] | None = None,
        engine_block_axis: int | None = None,
    ) -> NixlAgentEndpoint:
        """A started endpoint: agent created, memory registered, UCX reported.

        Blocking NIXL work (agent creation, registration) runs in a thread."""
        self = cls(
            name,
            row_bytes=row_bytes,
            store_rows=store_rows,
            slab_bytes=slab_bytes,
            engine_layers=engine_layers,
            engine_block_axis=engine_block_axis,
        )
        await asyncio.to_thread(self._start)
        return self

    # ---- start --------------------------------------------------------------------

    def _start(self) -> None:
        import nixl._api as api  # type: ignore[import-not-found]

        settings = VRAM_UCX_SETTINGS if self.device.type == "cuda" else ()
        self.progress_delay_us = progress_thread_delay_us()
        with (
            ucx_settings(settings) as applied,
            _progress_thread_delay(api, self.progress_delay_us),
        ):
            # RW sync: posts may run in worker threads while the event loop polls.
            self._agent = api.nixl_agent(
                self.agent_name,
                api.nixl_agent_config(
                    enable_prog_thread=True,
                    enable_listen_thread=False,
                    backends=["UCX"],
                    sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
                ),
            )
            self.ucx_report = probe_ucx(self._agent, applied)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend in this process")
        self.zero_copy_only = dict(self.ucx_report.env).get(
            "UCX_PROTO_EMULATION_ENABLE", "y"
        ).lower() in ("n", "no", "off", "0", "false")
        try:
            if self._store_rows.numel():
                self._store_reg = self._register([NixlRegion.of(self._store_rows)])
            self._slab_reg = self._register([self._slab_region])
            self._probe_reg = self._register([NixlRegion.of(self._probe)])
            if self._engine_map is not None:
                self._register_engine(self._engine_map)
            self._info = self._make_info()
        except BaseException:
            self._deregister_all()
            raise
        self._log_start()

    def _register_engine(self, engine_map: EngineBlockMap) -> None:
        try:
            self._engine_regs = self._register(list(engine_map.regions))
        except self._nixl_errors as exc:
            # The engine cache here is a mapping of the worker's memory (CUDA IPC on
            # a GPU), which a backend may refuse to register. Loads still work,
            # through the slab; say so once.
            logger.warning(
                "NIXL endpoint %s could not register the engine KV cache (%r); "
                "engine placement is off, loads go through the receive slab",
                self.agent_name,
                exc,
            )
            self._engine_map = None
            self._engine_layers = []

    def _register(self, regions: Sequence[NixlRegion]) -> Any:
        (mem_type,) = {r.mem_type for r in regions}
        reg = self._agent.register_memory(
            [(r.address, r.nbytes, r.device_id, "") for r in regions],
            mem_type=mem_type,
        )
        self.registrations += 1
        return reg

    def _make_info(self) -> NixlEndpointInfo:
        store = None
        metadata = b""
        if self._store_reg is not None:
            store = NixlRegion.of(self._store_rows)
            metadata = self._agent.get_partial_agent_metadata(
                self._store_reg, inc_conn_info=True
            )
        return NixlEndpointInfo(
            self.agent_name, self.generation, metadata, store, self.row_bytes
        )

    def _log_start(self) -> None:
        report = self.ucx_report
        assert report is not None
        logger.info(
            "NIXL endpoint %s on %s: device tier %d bytes, receive slab %d bytes, "
            "engine cache %s, progress thread delay %d us; %s",
            self.agent_name,
            self.device,
            self._store_rows.numel(),
            self._slab.numel(),
            "registered" if self._engine_map is not None else "not registered",
            self.progress_delay_us,
            report.describe(),
        )
        if report.tcp_only:
            logger.warning(
                "NIXL endpoint %s: UCX offers only %s; every transfer goes through "
                "TCP sockets (check UCX_TLS and the UCX transports installed)",
                self.agent_name,
                ", ".join(report.resources),
            )
        if self.device.type == "cuda" and report.probe_error is None:
            if not {"cuda_copy", "cuda_ipc"} & set(report.transports):
                logger.warning(
                    "NIXL endpoint %s holds VRAM but UCX offers no CUDA transport "
                    "(%s): GPU memory will be staged through host memory",
                    self.agent_name,
                    ", ".join(report.transports),
                )

    # ---- what peers see -------------------------------------------------------------

    @property
    def info(self) -> NixlEndpointInfo:
        self._check_open()
        assert self._info is not None
        return self._info

    def source(self, first_rows: Sequence[int]) -> NixlSource:
        """The ``NixlSource`` of leased snapshots at ``first_rows`` (this epoch)."""
        return NixlSource(self.agent_name, self.generation, tuple(first_rows))

    @property
    def store_rows(self) -> torch.Tensor:
        return self._store_rows

    @property
    def slab_region(self) -> NixlRegion:
        """The receive slab's region (looked up once per slab: a load's path)."""
        return self._slab_region

    @property
    def slab(self) -> torch.Tensor:
        return self._slab

    @property
    def engine_map(self) -> EngineBlockMap | None:
        return self._engine_map

    async def replace_store_rows(self, store_rows: torch.Tensor) -> None:
        """Register a new device tier in place of the old one (a new generation).

        The caller guarantees that no peer still reads the old rows (no leases).
        """
        self._check_open()
        if store_rows.dtype != torch.uint8 or store_rows.shape[1:] != (self.row_bytes,):
            raise ValueError(f"store rows must be (rows, {self.row_bytes}) uint8")
        if store_rows.device != self.device or not store_rows.is_contiguous():
            raise ValueError(f"store rows must be contiguous on {self.device}")

        def swap() -> None:
            if self._store_reg is not None:
                self._agent.deregister_memory(self._store_reg)
                self._store_reg = None
            self._store_rows = store_rows
            if store_rows.numel():
                self._store_reg = self._register([NixlRegion.of(store_rows)])
            self.generation += 1
            self._info = self._make_info()

        await asyncio.to_thread(swap)
        logger.info(
            "NIXL endpoint %s re-registered its device tier (generation %d)",
            self.agent_name,
            self.generation,
        )

    # ---- peers ----------------------------------------------------------------------

    async def add_peer(self, info: NixlEndpointInfo, *, check_timeout_s: float) -> None:
        """Load a peer's metadata (again only if its generation changed), connect,
        and READ one row from it (``peer_paths`` keeps the outcome).

        Raises ``NixlTransferError`` if the peer cannot be loaded or that READ
        fails (then the peer is forgotten), ``NixlTransferTimeout`` if the READ
        misses ``check_timeout_s``.
        """
        self._check_open()
        name = info.agent_name
        if self._peers.get(name) == info.generation and name in self.peer_paths:
            return
        if not info.metadata or info.store is None:
            raise NixlTransferError(
                f"peer {name} publishes no memory (it has no device tier)"
            )
        if self._peers.get(name) != info.generation:
            await self._load_peer(info)
        try:
            await self._check_path(info, check_timeout_s)
        except NixlTransferTimeout:
            raise  # the peer stays loaded: its pending READ must stay trackable
        except NixlTransferError:
            await self.forget_peer(name)
            raise

    async def _load_peer(self, info: NixlEndpointInfo) -> None:
        def load() -> None:
            name = self._agent.add_remote_agent(info.metadata)
            if isinstance(name, bytes):
                name = name.decode()
            if name != info.agent_name:
                raise NixlTransferError(
                    f"peer metadata names agent {name!r}, expected {info.agent_name!r}"
                )
            # Connect now rather than on the first READ, whose deadline it would eat.
            self._agent.make_connection(info.agent_name)

        try:
            await finish_even_if_cancelled(asyncio.to_thread(load))
        except self._nixl_errors as exc:
            raise NixlTransferError(
                f"could not load the NIXL metadata of peer {info.agent_name}: {exc!r}"
            ) from exc
        self._peers[info.agent_name] = info.generation
        self.peer_paths.pop(info.agent_name, None)

    async def _check_path(self, info: NixlEndpointInfo, timeout_s: float) -> None:
        """READ the peer's first row into the scratch row; log how it went."""
        assert info.store is not None
        probe = NixlRegion.of(self._probe)
        nbytes = min(probe.nbytes, info.store.nbytes)
        plan = _merged_plan(
            _u64([probe.address]),
            _u64([info.store.address]),
            _u64([nbytes]),
            probe.device_id,
            info.store.device_id,
        )
        started = time.monotonic()
        try:
            await self.read(
                info.agent_name,
                plan,
                local_mem_type=probe.mem_type,
                remote_mem_type=info.store.mem_type,
                timeout_s=timeout_s,
                destination=DEST_PROBE,
            )
        except NixlTransferTimeout:
            raise
        except NixlTransferError as exc:
            hint = ""
            if self.zero_copy_only:
                hint = (
                    "; UCX's software emulation is off for this agent, so this "
                    "usually means UCX has no zero-copy path between these memories "
                    "(for VRAM: cuda_ipc missing from UCX_TLS, or its get zero-copy "
                    "off, see UCX_CUDA_IPC_ENABLE_GET_ZCOPY); set "
                    "UCX_PROTO_EMULATION_ENABLE=y to accept a slow fallback"
                )
            raise NixlTransferError(
                f"the first READ from peer {info.agent_name} "
                f"({info.store.mem_type}->{probe.mem_type}) failed: {exc}{hint}"
            ) from exc
        path = PeerPath(
            info.agent_name,
            probe.mem_type,
            info.store.mem_type,
            nbytes,
            time.monotonic() - started,
            self.zero_copy_only,
        )
        self.peer_paths[info.agent_name] = path
        logger.info("NIXL endpoint %s: %s", self.agent_name, path.describe())

    async def forget_peer(self, agent_name: str) -> None:
        """Drop a peer's metadata (and its connection), unless a READ from it that
        missed its deadline is still pending: that one must stay trackable."""
        if agent_name not in self._peers or self._orphans.get(agent_name):
            return
        del self._peers[agent_name]
        self.peer_paths.pop(agent_name, None)
        try:
            await asyncio.to_thread(self._agent.remove_remote_agent, agent_name)
        except self._nixl_errors as exc:  # already gone, e.g. after a disconnect
            logger.info("NIXL peer %s was already removed: %r", agent_name, exc)

    # ---- READ -----------------------------------------------------------------------

    async def read(
        self,
        peer: str,
        plan: ReadPlan,
        *,
        local_mem_type: str,
        remote_mem_type: str,
        timeout_s: float,
        destination: str,
    ) -> None:
        """One NIXL READ of ``plan`` from ``peer`` into ``destination`` (``DEST_*``);
        returns once it is DONE.

        Raises ``NixlTransferError`` if it fails, ``NixlTransferTimeout`` if it is not
        done within ``timeout_s``. A timed-out READ into the slab retires the slab
        (a fresh one is registered); loads from that peer are refused until the
        READ ends. A caller's cancellation waits for the READ to end (or time out).
        """
        self._check_open()
        if self._orphans:
            await self._reap_orphans()
        pending = self._orphans.get(peer)
        if pending:
            stalled = time.monotonic() - pending[0].since
            raise NixlTransferError(
                f"a READ from NIXL peer {peer} has not ended for {stalled:.1f} s; "
                "refusing further loads from it until it does"
            )
        if plan.descriptors == 0:
            return
        agent = self._agent
        handle = self._prepare(peer, plan, local_mem_type, remote_mem_type)
        started = time.monotonic()
        if not _post_inline(plan, local_mem_type):
            # A long post (a DRAM copy inside the call) in a thread; then wait.
            await finish_even_if_cancelled(
                self._wait(handle, None, peer, plan, started, timeout_s, destination)
            )
            return
        # The common case finishes here without yielding to the event loop: post,
        # then spin briefly (a VRAM READ over cuda_ipc takes about 20 us).
        try:
            state = self._spin(handle, agent.transfer(handle))
        except self._nixl_errors as exc:
            self._release(handle)
            raise self._failure(peer, plan, started, exc) from exc
        if state == "PROC":
            # Still in flight: it must end (or be parked) even if we are cancelled.
            await finish_even_if_cancelled(
                self._wait(handle, state, peer, plan, started, timeout_s, destination)
            )
            return
        self._end(handle, state, peer, plan)

    def _end(self, handle: Any, state: str, peer: str, plan: ReadPlan) -> None:
        """Release a READ that has ended; raise unless it succeeded."""
        self._release(handle)
        if state != "DONE":
            raise NixlTransferError(
                f"NIXL READ of {plan.nbytes} bytes from {peer} ended in state {state}"
            )

    def _prepare(
        self, peer: str, plan: ReadPlan, local_mem_type: str, remote_mem_type: str
    ) -> Any:
        agent = self._agent
        try:
            return agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(plan.local, mem_type=local_mem_type),
                agent.get_xfer_descs(plan.remote, mem_type=remote_mem_type),
                peer,
            )
        except self._nixl_errors as exc:
            raise NixlTransferError(
                f"NIXL refused a READ of {plan.nbytes} bytes in {plan.descriptors} "
                f"descriptors from {peer}: {exc!r}"
            ) from exc

    def _failure(
        self, peer: str, plan: ReadPlan, started: float, exc: BaseException
    ) -> NixlTransferError:
        return NixlTransferError(
            f"NIXL READ of {plan.nbytes} bytes from {peer} failed after "
            f"{time.monotonic() - started:.3f} s: {exc!r}"
        )

    async def _wait(
        self,
        handle: Any,
        state: str | None,
        peer: str,
        plan: ReadPlan,
        started: float,
        timeout_s: float,
        destination: str,
    ) -> None:
        """Poll a READ to its end or its deadline; release or park it. ``state``
        None: post it first, in a thread (the post may do the whole copy)."""
        try:
            posted: str = (
                state
                if state is not None
                else await asyncio.to_thread(self._agent.transfer, handle)
            )
            state = await self._poll(handle, posted, started + timeout_s)
        except self._nixl_errors as exc:
            self._release(handle)
            raise self._failure(peer, plan, started, exc) from exc
        if state == "PROC":
            await self._park(handle, peer, started, destination)
            at_risk = destination == DEST_ENGINE
            raise NixlTransferTimeout(
                f"NIXL READ of {plan.nbytes} bytes from {peer} did not complete "
                f"within {timeout_s} s"
                + ("; its destination blocks may still be written" if at_risk else ""),
                destination_at_risk=at_risk,
            )
        self._end(handle, state, peer, plan)

    def _spin(self, handle: Any, state: str) -> str:
        """Check a just-posted READ without yielding, for up to ``SPIN_POLL_S``."""
        until = time.perf_counter() + SPIN_POLL_S
        while state == "PROC" and time.perf_counter() < until:
            state = self._agent.check_xfer_state(handle)
        return state

    async def _poll(self, handle: Any, state: str, deadline: float) -> str:
        """Poll until the transfer leaves PROC or the deadline passes."""
        agent = self._agent
        started = time.monotonic()
        delay = FIRST_POLL_SLEEP_S
        while state == "PROC":
            now = time.monotonic()
            if now >= deadline:
                return state
            if now - started < YIELD_POLL_S:
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(min(delay, max(deadline - now, 0.0)))
                delay = min(delay * 2, MAX_POLL_SLEEP_S)
            state = agent.check_xfer_state(handle)
        return state

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except self._nixl_errors as exc:  # NIXL keeps it and frees it with the agent
            logger.warning("could not release a NIXL transfer handle: %r", exc)

    async def _park(
        self, handle: Any, peer: str, started: float, destination: str
    ) -> None:
        hold = None
        if destination == DEST_SLAB:
            hold = (self._slab, self._slab_reg)
            slab = torch.zeros_like(self._slab)
            region = NixlRegion.of(slab)
            self._slab_reg = await asyncio.to_thread(self._register, [region])
            self._slab, self._slab_region = slab, region
        self._orphans.setdefault(peer, []).append(_Orphan(handle, peer, started, hold))
        consequence = {
            DEST_SLAB: "the receive slab was retired until it ends",
            DEST_ENGINE: "its destination engine blocks may still be written",
            DEST_PROBE: "loads from it are refused until it ends",
        }[destination]
        logger.warning("NIXL READ from %s missed its deadline; %s", peer, consequence)

    async def _reap_orphans(self) -> None:
        """Release READs that missed their deadline and have ended since."""
        ended: list[_Orphan] = []
        # No await until the bookkeeping is done, so concurrent callers never see
        # (and release) the same orphan twice.
        for peer, orphans in list(self._orphans.items()):
            alive = []
            for orphan in orphans:
                try:
                    state = self._agent.check_xfer_state(orphan.handle)
                except self._nixl_errors:
                    state = "ERR"
                if state == "PROC":
                    alive.append(orphan)
                    continue
                self._release(orphan.handle)
                ended.append(orphan)
                logger.info(
                    "NIXL READ from %s ended (%s) %.1f s after it started",
                    peer,
                    state,
                    time.monotonic() - orphan.since,
                )
            if alive:
                self._orphans[peer] = alive
            else:
                del self._orphans[peer]
        for orphan in ended:
            if orphan.hold is not None:
                # the retired slab: nothing can write it any more
                await asyncio.to_thread(self._agent.deregister_memory, orphan.hold[1])

    async def pending_reads(self) -> int:
        """READs that missed their deadline and have not ended (after reaping)."""
        if self._agent is not None:
            await self._reap_orphans()
        return self._pending_count()

    def _pending_count(self) -> int:
        return sum(len(o) for o in self._orphans.values())

    # ---- shutdown -------------------------------------------------------------------

    async def close(self, orphan_timeout_s: float = 0.0) -> None:
        """Wait up to ``orphan_timeout_s`` for READs that missed their deadline, then
        drop peers and deregister everything (idempotent). Memory that a READ which
        never ended may still write is quarantined for the life of the process."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + orphan_timeout_s
        await self._reap_orphans()
        while self._orphans and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            await self._reap_orphans()
        for peer in list(self._peers):
            await self.forget_peer(peer)
        if self._orphans:
            held = [o.hold for orphans in self._orphans.values() for o in orphans]
            _QUARANTINE.append(
                (self._agent, held, self._engine_layers, self._slab, self._probe)
            )
            logger.error(
                "NIXL endpoint %s closes with %d READs that never ended; their "
                "memory and the agent stay allocated for the life of this process",
                self.agent_name,
                self._pending_count(),
            )
            return
        await asyncio.to_thread(self._deregister_all)
        self._agent = None
        logger.info(
            "NIXL endpoint %s closed (%d registrations)",
            self.agent_name,
            self.registrations,
        )

    def _deregister_all(self) -> None:
        for attr in ("_engine_regs", "_probe_reg", "_slab_reg", "_store_reg"):
            reg = getattr(self, attr)
            if reg is not None and self._agent is not None:
                self._agent.deregister_memory(reg)
            setattr(self, attr, None)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL endpoint {self.agent_name} is closed")
        if self._agent is None:
            raise RuntimeError(
                f"NIXL endpoint {self.agent_name} has not started (use create())"
            )


def _post_inline(plan: ReadPlan, local_mem_type: str) -> bool:
    if plan.descriptors > INLINE_POST_MAX_DESCRIPTORS:
        return False
    return local_mem_type == "VRAM" or plan.nbytes <= INLINE_POST_MAX_BYTES


# ---- the transport ------------------------------------------------------------------


@dataclass(slots=True)
class NixlTransportCounters:
    """Cumulative counts of one ``NixlDirectTransport`` (loader side: a holder does
    nothing in a READ, so there is no sending side to count).

    ``received_wire_bytes`` is what the READs moved, ``received_useful_bytes`` the
    rows asked for; ``registration_changes`` counts registrations after start (a
    retired slab), ``peer_metadata_loads`` how often a peer's metadata was loaded.
    """

    received_copies: int = 0
    received_wire_bytes: int = 0
    received_useful_bytes: int = 0
    descriptors: int = 0
    loads: int = 0
    engine_placed_loads: int = 0
    peer_metadata_loads: int = 0
    transfer_failures: int = 0
    transfer_timeouts: int = 0
    registrations: int = 0
    registration_changes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class NixlDirectTransport:
    """``DeviceTierTransport`` through this actor's own NIXL agent (see the module
    docstring). Holders answer two actor calls, made through ``holder_ref``:

    - ``nixl_endpoint_info() -> NixlEndpointInfo`` (once per peer and generation);
    - ``nixl_source(lease_id, keys) -> NixlSource`` (once per load, unless the
      caller passes ``source``, e.g. taken from the lease grant).
    """

    def __init__(
        self,
        endpoint: NixlAgentEndpoint,
        geometry: KVGeometry,
        *,
        rpc_timeout_s: float,
        transfer_timeout_s: float | None = None,
        placement: str = PLACEMENT_ENGINE,
    ) -> None:
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be positive, got {rpc_timeout_s}")
        if placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement {placement!r}; choose from {PLACEMENTS}"
            )
        if endpoint.row_bytes != geometry.layer_block_nbytes:
            raise ValueError(
                f"the endpoint's rows are {endpoint.row_bytes} bytes, the geometry's "
                f"{geometry.layer_block_nbytes}"
            )
        self._endpoint = endpoint
        self._geometry = geometry
        self._rpc_timeout_s = rpc_timeout_s
        self._transfer_timeout_s = transfer_timeout_s or rpc_timeout_s
        self._placement = placement
        self.rows_per_read = endpoint.slab.numel() // geometry.layer_block_nbytes
        self._counters = NixlTransportCounters()
        self._registrations_at_start = endpoint.registrations
        # holder rank -> the holder's endpoint info in use
        self._peers: dict[int, NixlEndpointInfo] = {}
        self._peer_locks: dict[int, asyncio.Lock] = {}
        # One load at a time uses the receive slab, from READ to the end of scatter.
        self._slab_lock = asyncio.Lock()
        self._slab_readers = DeviceWorkMark(endpoint.slab.device)
        self._active: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None

    @classmethod
    async def create(
        cls,
        name: str,
        geometry: KVGeometry,
        store_rows: torch.Tensor,
        *,
        rpc_timeout_s: float,
        transfer_timeout_s: float | None = None,
        placement: str = PLACEMENT_ENGINE,
        engine_layers: Sequence[torch.Tensor] | None = None,
        engine_block_axis: int | None = None,
        slab_bytes: int | None = None,
    ) -> NixlDirectTransport:
        """An endpoint for this actor's memory and a transport over it.

        ``engine_layers`` are registered only for ``engine`` placement."""
        use_engine = placement == PLACEMENT_ENGINE and engine_layers is not None
        endpoint = await NixlAgentEndpoint.create(
            name,
            row_bytes=geometry.layer_block_nbytes,
            store_rows=store_rows,
            slab_bytes=slab_bytes or full_slab_bytes(geometry),
            engine_layers=engine_layers if use_engine else None,
            engine_block_axis=engine_block_axis if use_engine else None,
        )
        return cls(
            endpoint,
            geometry,
            rpc_timeout_s=rpc_timeout_s,
            transfer_timeout_s=transfer_timeout_s,
            placement=placement,
        )

    @property
    def endpoint(self) -> NixlAgentEndpoint:
        return self._endpoint

    @property
    def placement(self) -> str:
        return self._placement

    # ---- loader side ----------------------------------------------------------------

    async def load(
        self,
        holder_ref: Any,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[BlockHash],
        scatter: ScatterFn,
        *,
        source: NixlSource | None = None,
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        """Bring every layer of ``keys`` from the holder's device tier.

        With ``engine`` placement and ``dst_block_ids`` (one engine block per key),
        the READ lands in the engine blocks and ``scatter`` is not called; otherwise
        each chunk is read into the receive slab and handed to ``scatter``. Returns
        or raises once no READ is writing into this side's memory any more; device
        work that ``scatter`` queued may still run (the caller fences before the
        engine reads the blocks; the next READ into the slab waits for it).
        """
        self._check_open()
        keys = tuple(keys)
        if not keys:
            return
        task = asyncio.current_task()
        if task is not None:
            self._active.add(task)
        try:
            if source is None:
                located: NixlSource = await self._rpc(
                    holder_ref.nixl_source(lease_id, list(keys))
                )
                source = located
            peer = await self._peer(holder_ref, holder_rank, source)
            self._check_source(peer, source, keys)
            engine_map = self._endpoint.engine_map
            if (
                self._placement == PLACEMENT_ENGINE
                and dst_block_ids is not None
                and engine_map is not None
            ):
                await self._load_into_engine(
                    holder_rank, peer, source, dst_block_ids, engine_map
                )
            else:
                await self._load_through_slab(holder_rank, peer, source, scatter)
            self._counters.loads += 1
        finally:
            if task is not None:
                self._active.discard(task)

    async def _load_through_slab(
        self,
        holder_rank: int,
        peer: NixlEndpointInfo,
        source: NixlSource,
        scatter: ScatterFn,
    ) -> None:
        num_layers, row_bytes = (
            self._geometry.num_layers,
            self._geometry.layer_block_nbytes,
        )
        total = len(source.first_rows) * num_layers
        assert peer.store is not None
        for first_row in range(0, total, self.rows_per_read):
            num_rows = min(self.rows_per_read, total - first_row)
            async with self._slab_lock:
                slab = self._endpoint.slab  # a timed-out READ may have replaced it
                # The last scatter may still be reading the slab on the device: the
                # READ must not overwrite it before that work is done.
                self._slab_readers.wait()
                slab_region = self._endpoint.slab_region
                plan = plan_slab_read(
                    source.first_rows,
                    num_layers,
                    row_bytes,
                    peer.store,
                    slab_region,
                    first_row,
                    num_rows,
                )
                await self._read(
                    holder_rank, peer, plan, slab_region.mem_type, DEST_SLAB
                )
                try:
                    scatter(
                        first_row,
                        slab[: num_rows * row_bytes].view(num_rows, row_bytes),
                    )
                finally:
                    # scatter may only have queued device work that reads the slab;
                    # it is waited for before the next READ into the slab, not here
                    # (the caller fences before the engine uses its blocks).
                    self._slab_readers.mark()
            self._count(plan, num_rows * row_bytes)

    async def _load_into_engine(
        self,
        holder_rank: int,
        peer: NixlEndpointInfo,
        source: NixlSource,
        dst_block_ids: Sequence[int],
        engine_map: EngineBlockMap,
    ) -> None:
        blocks = [int(b) for b in dst_block_ids]
        if len(blocks) != len(source.first_rows):
            raise ValueError(
                f"{len(blocks)} destination blocks for {len(source.first_rows)} keys"
            )
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"duplicate destination blocks in {blocks}")
        bad = [b for b in blocks if not 0 <= b < engine_map.num_blocks]
        if bad:
            raise ValueError(
                f"destination blocks {bad} are out of range for "
                f"{engine_map.num_blocks} engine blocks"
            )
        assert peer.store is not None
        plan = plan_engine_read(
            source.first_rows,
            blocks,
            self._geometry.num_layers,
            self._geometry.layer_block_nbytes,
            peer.store,
            engine_map,
        )
        await self._read(holder_rank, peer, plan, engine_map.mem_type, DEST_ENGINE)
        self._count(plan, len(blocks) * self._geometry.block_nbytes)
        self._counters.engine_placed_loads += 1

    async def _read(
        self,
        holder_rank: int,
        peer: NixlEndpointInfo,
        plan: ReadPlan,
        local_mem_type: str,
        destination: str,
    ) -> None:
        assert peer.store is not None
        with self._counted_failures(f"load from rank {holder_rank}"):
            try:
                await self._endpoint.read(
                    peer.agent_name,
                    plan,
                    local_mem_type=local_mem_type,
                    remote_mem_type=peer.store.mem_type,
                    timeout_s=self._transfer_timeout_s,
                    destination=destination,
                )
            except NixlTransferTimeout:
                raise
            except NixlTransferError:
                # The peer may be gone or have changed: fetch its metadata afresh.
                if self._peers.get(holder_rank) is peer:
                    del self._peers[holder_rank]
                    await self._endpoint.forget_peer(peer.agent_name)
                raise

    @contextlib.contextmanager
    def _counted_failures(self, context: str) -> Iterator[None]:
        """Count a failed or timed-out READ and re-raise it with ``context``."""
        try:
            yield
        except NixlTransferTimeout as exc:
            self._counters.transfer_timeouts += 1
            raise NixlTransferTimeout(
                f"{context}: {exc}", exc.destination_at_risk
            ) from exc
        except NixlTransferError as exc:
            self._counters.transfer_failures += 1
            raise NixlTransferError(f"{context}: {exc}") from exc

    def _count(self, plan: ReadPlan, useful_bytes: int) -> None:
        counters = self._counters
        counters.received_copies += 1
        counters.received_wire_bytes += plan.nbytes
        counters.received_useful_bytes += useful_bytes
        counters.descriptors += plan.descriptors

    async def _peer(
        self, holder_ref: Any, holder_rank: int, source: NixlSource
    ) -> NixlEndpointInfo:
        """The holder's endpoint info for ``source``'s epoch, loaded into our agent."""
        lock = self._peer_locks.setdefault(holder_rank, asyncio.Lock())
        async with lock:
            known = self._peers.get(holder_rank)
            if known is not None and known.epoch == source.epoch:
                return known
            info: NixlEndpointInfo = await self._rpc(holder_ref.nixl_endpoint_info())
            if info.epoch != source.epoch:
                raise NixlTransferError(
                    f"rank {holder_rank} re-registered its device tier during this "
                    f"load (epoch {info.epoch}, the lease names {source.epoch})"
                )
            if info.row_bytes != self._geometry.layer_block_nbytes:
                raise ValueError(
                    f"rank {holder_rank} stores {info.row_bytes}-byte rows, this "
                    f"replica {self._geometry.layer_block_nbytes}-byte rows"
                )
            if info.store is None:
                raise NixlTransferError(f"rank {holder_rank} has no device tier")
            if known is not None and known.agent_name != info.agent_name:
                await self._endpoint.forget_peer(known.agent_name)
            with self._counted_failures(f"rank {holder_rank}"):
                await self._endpoint.add_peer(
                    info, check_timeout_s=self._transfer_timeout_s
                )
            self._peers[holder_rank] = info
            self._counters.peer_metadata_loads += 1
            return info

    def _check_source(
        self, peer: NixlEndpointInfo, source: NixlSource, keys: Sequence[BlockHash]
    ) -> None:
        if len(source.first_rows) != len(keys):
            raise ValueError(
                f"the holder located {len(source.first_rows)} of {len(keys)} keys"
            )
        num_layers = self._geometry.num_layers
        limit = peer.num_store_rows
        bad = [r for r in source.first_rows if r < 0 or r + num_layers > limit]
        if bad:
            raise ValueError(
                f"snapshot rows {bad[:8]} lie outside the holder's {limit} device "
                "tier rows"
            )

    # ---- holder side ----------------------------------------------------------------

    async def serve(
        self, req: PushRequest, source_rows: torch.Tensor, row_index: torch.Tensor
    ) -> None:
        """Not used: loaders read this side's device tier directly."""
        raise RuntimeError(
            "the nixl transport has no push path: loaders READ the holder's device "
            "tier directly (nixl_endpoint_info / nixl_source)"
        )

    # ---- reporting and shutdown -----------------------------------------------------

    def counters(self) -> dict[str, int]:
        counters = self._counters
        counters.registrations = self._endpoint.registrations
        counters.registration_changes = (
            self._endpoint.registrations - self._registrations_at_start
        )
        return counters.as_dict()

    async def close(self) -> None:
        """Wait for loads in progress, then close the endpoint (idempotent)."""
        if self._close_task is None:
            self._close_task = asyncio.create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closed = True
        current = asyncio.current_task()
        pending = [t for t in self._active if t is not current]
        if pending:
            # Each READ has a deadline, so these end.
            await asyncio.wait(pending)
        await self._endpoint.close(orphan_timeout_s=self._transfer_timeout_s)
        logger.info("NIXL transport closed: %s", self.counters())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the NIXL transport is closed")

    async def _rpc(self, call: Awaitable[T]) -> T:
        # xo.wait_for: it times out even when cancelling an actor call cannot reach
        # an unresponsive peer.
        return await xo.wait_for(call, self._rpc_timeout_s)


# ---- small helpers ------------------------------------------------------------------


def _mem_type(device: torch.device) -> str:
    if device.type == "cpu":
        return "DRAM"
    if device.type == "cuda":
        return "VRAM"
    raise ValueError(f"NIXL transfers support CPU and CUDA memory, not {device}")


def _device_id(device: torch.device) -> int:
    return (device.index or 0) if device.type == "cuda" else 0
