"""Typed messages that cross actor and process boundaries.

Frozen, slotted dataclasses only: they pickle through xoscar, nothing mutates them in
flight, and a field added or renamed breaks loudly at the sender instead of silently
at the receiver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .hashing import BlockHash

# Bump when the wire protocol between transfer actors changes.
PROTOCOL_VERSION = 1

DEVICE_TIER = "device"
CPU_TIER = "cpu"


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What one KV block looks like, identical on every replica of a model.

    A block of one layer is ``layer_block_nbytes`` contiguous bytes once the engine's
    cache is viewed block-major (see ``layout.py``); a snapshot is ``num_layers``
    such rows. ``logical_dtype`` is the engine cache's dtype name ("bfloat16", ...):
    bytes travel raw, the dtype is checked on arrival.
    """

    num_layers: int
    layer_block_nbytes: int
    logical_dtype: str
    block_size: int = 0  # tokens per block; 0 where it does not matter (tests)

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        if self.layer_block_nbytes <= 0:
            raise ValueError(
                f"layer_block_nbytes must be positive, got {self.layer_block_nbytes}"
            )

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * self.layer_block_nbytes


@dataclass(frozen=True, slots=True)
class ReplicaIdentity:
    """What two replicas compare before they exchange KV (see ``check_compatible``)."""

    model: str
    geometry: KVGeometry
    layout: str  # the engine layout name, e.g. "block_first", "kv_first", "cpu"
    protocol_version: int = PROTOCOL_VERSION

    def incompatibility(self, other: ReplicaIdentity) -> str | None:
        """None when KV can move between the two replicas, else the reason."""
        for name in ("model", "geometry", "protocol_version"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs: {mine!r} here, {theirs!r} on the peer"
        return None


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """A holder's answer to a reservation: the leading ``keys`` it pinned.

    ``tiers[i]`` is where ``keys[i]`` lives (``DEVICE_TIER`` or ``CPU_TIER``); a leased
    snapshot does not move until the lease is released. An empty grant is a miss.
    """

    lease_id: str
    holder_rank: int
    keys: tuple[BlockHash, ...]
    tiers: tuple[str, ...]
    logical_dtypes: tuple[str, ...]
    # Where each key's layer 0 sits in the holder's tier (``first_row``), and the
    # epoch (agent name, generation) of the holder's NIXL registration of its device
    # tier; set by holders whose transport reads rows directly ("nixl"), so that a
    # loader needs no further round trip to find them. Empty / None otherwise.
    first_rows: tuple[int, ...] = ()
    holder_epoch: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if not (len(self.keys) == len(self.tiers) == len(self.logical_dtypes)):
            raise ValueError("keys, tiers and logical_dtypes must have equal lengths")
        if self.first_rows and len(self.first_rows) != len(self.keys):
            raise ValueError("first_rows must be empty or one per key")


@dataclass(frozen=True, slots=True)
class PushRequest:
    """Ask a holder to write rows of leased device-tier snapshots into our slab.

    Rows enumerate (key, layer) pairs over ``keys`` in order: global row ``r`` is
    layer ``r % num_layers`` of ``keys[r // num_layers]``; the request covers rows
    ``first_row .. first_row + num_rows - 1``. The holder writes exactly
    ``wire_bytes`` (>= the payload) into ``dest``, a buffer ref of that size.
    """

    lease_id: str
    keys: tuple[BlockHash, ...]
    first_row: int
    num_rows: int
    wire_bytes: int
    dest: Any  # xoscar BufferRef of the receiver's slab view of exactly wire_bytes


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """Load leased snapshots from a holder into this replica's engine blocks."""

    load_id: str
    grant: LeaseGrant
    holder_address: str
    dst_block_ids: tuple[int, ...]  # one engine block id per key of the grant

    def __post_init__(self) -> None:
        if len(self.dst_block_ids) != len(self.grant.keys):
            raise ValueError(
                f"{len(self.dst_block_ids)} destination blocks for "
                f"{len(self.grant.keys)} leased keys"
            )


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of one load; ``error`` is None on success."""

    load_id: str
    ok: bool
    num_blocks: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class StageItem:
    """A computed engine block to snapshot under ``key``."""

    key: BlockHash
    block_id: int


@dataclass(slots=True)
class TransferCounters:
    """Cumulative transfer statistics of one replica (mutable, owned by one actor)."""

    wire_bytes: int = 0
    useful_bytes: int = 0
    registration_changes: int = 0
    copies: int = 0
    device_tier_hits: int = 0
    cpu_tier_hits: int = 0
    load_errors: int = 0
    per_peer_wire: dict[int, int] = field(default_factory=dict)  # rank -> bytes


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The tracker's answer: ``num_blocks`` leading keys are held by ``rank``."""

    rank: int
    address: str
    num_blocks: int
