"""What one replica's transfer actor is configured with, validated at creation
(``transfer_actor.py`` creates the actor from it; the launch path builds it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import DEFAULT_TRANSPORT, TRANSPORTS
from .rank_registry import ReplicaRanks


@dataclass(frozen=True, slots=True)
class TransferActorConfig:
    """Everything one replica's transfer actor needs, validated once here.

    What depends on the engine (geometry, layout, device) is learnt when its caches
    are mapped. ``gpu_cache_bytes`` is the device tier's budget (None or 0: no device
    tier, new snapshots go to the CPU tier); ``cpu_capacity_blocks`` bounds the CPU
    tier (None: the engine's KV block count). ``rpc_timeout_s`` is the deadline of
    every wait on a peer or the tracker.
    """

    model_uid: str
    rank: int
    tracker_address: str
    tracker_uid: str
    gpu_cache_bytes: int | None = None
    cpu_capacity_blocks: int | None = None
    transport: str = DEFAULT_TRANSPORT
    rpc_timeout_s: float = 30.0
    # A lease older than this is released by the holder itself: the loader that
    # took it died or lost track of it, and its snapshots must not stay pinned.
    lease_ttl_s: float = 300.0
    # this actor's engine rank of a tensor-parallel replica (rank_registry.py)
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        ReplicaRanks(self.rank, self.tp_rank, self.tp_size)  # checks both
        if self.rank < 0:
            raise ValueError(f"rank must be non-negative, got {self.rank}")
        if self.gpu_cache_bytes is not None and self.gpu_cache_bytes < 0:
            raise ValueError(
                f"gpu_cache_bytes must be non-negative, got {self.gpu_cache_bytes}"
            )
        if self.cpu_capacity_blocks is not None and self.cpu_capacity_blocks < 0:
            raise ValueError(
                f"cpu_capacity_blocks must be non-negative, got {self.cpu_capacity_blocks}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"unknown transport {self.transport!r}; choose one of {TRANSPORTS}"
            )
        if not self.rpc_timeout_s > 0:
            raise ValueError(
                f"rpc_timeout_s must be positive, got {self.rpc_timeout_s}"
            )
        if not self.lease_ttl_s > self.rpc_timeout_s:
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s}) must exceed rpc_timeout_s "
                f"({self.rpc_timeout_s}): a lease must outlive one load's waits"
            )
