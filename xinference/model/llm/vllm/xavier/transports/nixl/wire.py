"""What NIXL transport endpoints tell each other, and how a READ fails.

A holder publishes ``NixlEndpointInfo`` (its agent, a generation, partial NIXL
metadata covering only its device tier); a grant or the ``source`` holder op says
where leased snapshots sit (``NixlSource``). ``NixlRegion`` describes registered
memory. ``NixlTransferError`` / ``NixlTransferTimeout`` are how a READ fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
    only (``words_metadata``: the generation words'). ``generation`` changes whenever the holder re-registers those rows; with
    ``agent_name`` it is the epoch a ``NixlSource`` refers to.
    """

    agent_name: str
    generation: int
    metadata: bytes
    store: NixlRegion | None  # None: the holder has no device tier
    row_bytes: int
    # the holder's host (``socket.gethostname()``) and the UCX transports its
    # process offers (``UcxReport.transports``), for the loader's path report
    host: str = ""
    transports: tuple[str, ...] = ()
    # the device tier's generation words (int64, one per slot, in host memory
    # even where the rows are on a GPU): a lease-free reader READs them back
    # after the rows; None: the holder offers none (``store/generations.py``).
    # Registered on their own, with partial metadata of their own (``published.py``)
    words: NixlRegion | None = None
    words_metadata: bytes = b""

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


def _mem_type(device: torch.device) -> str:
    if device.type == "cpu":
        return "DRAM"
    if device.type == "cuda":
        return "VRAM"
    raise ValueError(f"NIXL transfers support CPU and CUDA memory, not {device}")


def _device_id(device: torch.device) -> int:
    return (device.index or 0) if device.type == "cuda" else 0
