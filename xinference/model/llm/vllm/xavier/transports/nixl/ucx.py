"""UCX as NIXL's agents see it: the settings an agent is created with, what UCX
offers in this process, and the progress thread's idle wait.

``ucx_settings`` applies settings (only where the environment does not set them)
while an agent is created; ``probe_ucx`` reports the UCX transports and settings an
agent ended up with, so a silent TCP fallback shows in the log; and the progress
thread of NIXL's Python agent, which its binding creates with a zero wait (a busy
poll), is given ``PROGRESS_THREAD_DELAY_US`` instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

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
# READ needs) on only on platforms it knows to be fast ("auto"); where it stays off,
# every VRAM READ falls back to "software emulation" over tcp/lo while WRITEs use
# cuda_ipc. With emulation off as well, a VRAM READ without a
# zero-copy path fails (at the peer check, below) instead of crawling through a
# socket. UCX reads both when the agent's context and worker are created.
VRAM_UCX_SETTINGS = (
    ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on"),
    ("UCX_PROTO_EMULATION_ENABLE", "n"),
)
# What the engine process's reader (``connector/direct_reads.py``) creates its agent
# with on VRAM: get zero-copy as above, emulation left on. It READs peers'
# generation words, which live in host memory, and the launch path's UCX_TLS on a
# CUDA host (tcp,cuda_copy,cuda_ipc) leaves only tcp between the host buffers of
# two processes, which READs only through emulation: with emulation off every words
# READ failed ("No zero-copy protocol found for get into host from host", an H100,
# 2026-12-05). Its row READs need no such guard: each one is inside the fast path's
# hard bound, past which its blocks are recomputed.
WORDS_READER_UCX_SETTINGS = (("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on"),)
# How long the agent's progress thread waits for UCX events when it has nothing to
# do, in microseconds. NIXL 1.5's Python ``nixl_agent`` creates every agent with 0,
# which makes the thread busy-poll: each idle agent keeps one core busy, one agent
# per transfer actor.
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


# UCX transports that only join processes of one host (shared memory, kernel copies,
# CUDA/ROCm IPC); between hosts only the network ones remain (rc, dc, ud, tcp, ...).
ONE_HOST_TRANSPORTS = frozenset(
    {"self", "cma", "posix", "sysv", "xpmem", "knem", "cuda_ipc", "rocm_ipc"}
)


def pair_transports(
    local: Sequence[str], remote: Sequence[str], same_host: bool
) -> tuple[str, ...]:
    """The UCX transports both sides offer that can join them: what UCX chooses
    from for this pair (it picks per memory type and size; ``UCX_PROTO_INFO=y``
    shows the choice)."""
    both = set(local) & set(remote)
    if not same_host:
        both -= ONE_HOST_TRANSPORTS
    return tuple(sorted(both - {"self"}))


def log_endpoint_start(
    agent_name: str, report: UcxReport, *, holds_vram: bool, memory: str
) -> None:
    """Log an endpoint's start (``memory``: what it registered) with its UCX
    report, and warn where UCX will carry its bytes slowly."""
    logger.info("NIXL endpoint %s %s; %s", agent_name, memory, report.describe())
    if report.tcp_only:
        logger.warning(
            "NIXL endpoint %s: UCX offers only %s; every transfer goes through "
            "TCP sockets (check UCX_TLS and the UCX transports installed)",
            agent_name,
            ", ".join(report.resources),
        )
    if holds_vram and report.probe_error is None:
        if not {"cuda_copy", "cuda_ipc"} & set(report.transports):
            logger.warning(
                "NIXL endpoint %s holds VRAM but UCX offers no CUDA transport "
                "(%s): GPU memory will be staged through host memory",
                agent_name,
                ", ".join(report.transports),
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
