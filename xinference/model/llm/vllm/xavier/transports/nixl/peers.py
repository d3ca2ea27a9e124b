"""Meeting a peer: the one-row READ a loader makes before its first load from it,
and what that READ showed (``PeerPath``).

``NixlAgentEndpoint.add_peer`` loads the peer's metadata and posts the READ; this
module plans it, explains a failure, and records the outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import ReadPlan, _merged_plan, _u64
from .wire import NixlEndpointInfo, NixlRegion, NixlTransferError


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
    # where the peer runs, and the UCX transports both sides offer that can join
    # them (one-host ones such as cma or cuda_ipc only when the host is the same)
    peer_host: str = ""
    same_host: bool = True
    transports: tuple[str, ...] = ()

    def describe(self) -> str:
        path = "zero-copy" if self.zero_copy_only else "UCX's choice"
        where = "on this host" if self.same_host else f"on host {self.peer_host}"
        return (
            f"{self.remote_mem_type}->{self.local_mem_type} READ of {self.nbytes} "
            f"bytes from {self.peer} ({where}) in {self.seconds * 1e6:.0f} us "
            f"({path}; UCX transports for this peer: "
            f"{', '.join(self.transports) or 'unknown'})"
        )


def check_plan(probe: NixlRegion, store: NixlRegion) -> tuple[ReadPlan, int]:
    """The check READ: the start of the peer's device tier into our scratch row
    (one row, or less when the peer's tier is smaller); with its byte count."""
    nbytes = min(probe.nbytes, store.nbytes)
    plan = _merged_plan(
        _u64([probe.address]),
        _u64([store.address]),
        _u64([nbytes]),
        probe.device_id,
        store.device_id,
    )
    return plan, nbytes


def check_failed(
    info: NixlEndpointInfo,
    probe: NixlRegion,
    error: NixlTransferError,
    zero_copy_only: bool,
) -> NixlTransferError:
    """The error a failed check READ raises: what failed and, with UCX's emulation
    off, the usual reason and how to accept a slow fallback instead."""
    assert info.store is not None
    hint = ""
    if zero_copy_only:
        hint = (
            "; UCX's software emulation is off for this agent, so this "
            "usually means UCX has no zero-copy path between these memories "
            "(for VRAM: cuda_ipc missing from UCX_TLS, or its get zero-copy "
            "off, see UCX_CUDA_IPC_ENABLE_GET_ZCOPY); set "
            "UCX_PROTO_EMULATION_ENABLE=y to accept a slow fallback"
        )
    return NixlTransferError(
        f"the first READ from peer {info.agent_name} "
        f"({info.store.mem_type}->{probe.mem_type}) failed: {error}{hint}"
    )
