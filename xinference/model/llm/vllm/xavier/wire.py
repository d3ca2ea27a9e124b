"""Typed messages that cross actor and process boundaries.

Frozen, slotted dataclasses only: they pickle through xoscar, nothing mutates them in
flight, and a field added or renamed breaks loudly at the sender instead of silently
at the receiver.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from .hashing import BlockHash

# Bump when the wire protocol between transfer actors changes.
PROTOCOL_VERSION = 2  # 2: grants carry one opaque transport hint

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
    # Ranks per replica; the geometry is one rank's shard (its KV heads). KV moves
    # rank r to rank r only, so both sides must split the heads alike.
    tensor_parallel_size: int = 1

    def incompatibility(self, other: ReplicaIdentity) -> str | None:
        """None when KV can move between the two replicas, else the reason."""
        names = ("model", "tensor_parallel_size", "geometry", "protocol_version")
        for name in names:
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
    # What the holder's transport tells the loader's (see TransportHint); None
    # when the transport needs nothing from the grant.
    transport_hint: TransportHint | None = None
    # Lease-free (nothing pinned on the holder; made by the loader from the
    # published locations): the generation each key's slot must still have when
    # read back after the data (``store/generations.py``). None: a leased grant.
    generations: tuple[int, ...] | None = None
    # Tensor-parallel holders: the grants of ranks 1.. (this one is rank 0's), each
    # with the same keys; empty for one rank per replica (``connector/ranks.py``).
    rank_shards: tuple[LeaseGrant, ...] = ()

    def __post_init__(self) -> None:
        if not (len(self.keys) == len(self.tiers) == len(self.logical_dtypes)):
            raise ValueError("keys, tiers and logical_dtypes must have equal lengths")
        if self.generations is not None and len(self.generations) != len(self.keys):
            raise ValueError("a lease-free grant needs one generation per key")
        hint = self.transport_hint
        if hint is not None and len(hint.per_key) != len(self.keys):
            raise ValueError("a transport hint must have one entry per granted key")
        if any(shard.keys != self.keys for shard in self.rank_shards):
            raise ValueError("every rank's shard of a grant must have the same keys")

    def truncated(self, num_keys: int) -> LeaseGrant:
        """The grant of its first ``num_keys`` keys (the loader may take fewer)."""
        if num_keys == len(self.keys):
            return self
        hint = self.transport_hint
        return replace(
            self,
            keys=self.keys[:num_keys],
            tiers=self.tiers[:num_keys],
            logical_dtypes=self.logical_dtypes[:num_keys],
            transport_hint=None if hint is None else hint.narrowed(range(num_keys)),
            generations=(
                None if self.generations is None else self.generations[:num_keys]
            ),
            rank_shards=tuple(s.truncated(num_keys) for s in self.rank_shards),
        )

    @property
    def lease_free(self) -> bool:
        return self.generations is not None


@dataclass(frozen=True, slots=True)
class TransportHint:
    """What a holder's device-tier transport puts in a grant for the loader's
    transport, so the load needs no further round trip: one value for the whole
    grant (``shared``) and one per granted key (``per_key``, None for a key the
    transport does not move). Opaque to everything but the two transports."""

    shared: Any
    per_key: tuple[Any, ...]

    def narrowed(self, positions: Iterable[int]) -> TransportHint:
        """The hint for the granted keys at ``positions``, in that order."""
        return TransportHint(self.shared, tuple(self.per_key[i] for i in positions))


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
    # calls the loading actor made on the holder before recording this result:
    # round trips on the load's critical path (benchmarks count them)
    round_trips: int = 0


@dataclass(frozen=True, slots=True)
class StageItem:
    """A computed engine block to snapshot under ``key``."""

    key: BlockHash
    block_id: int


@dataclass(frozen=True, slots=True)
class ConnectorTotals:
    """What a replica's connector halves counted so far in vLLM's engine process,
    for its transfer actor's metrics (``connector/totals_report.py``): totals,
    never increments, so a lost report is made good by the next. Each half
    fills its own fields and leaves the others 0.

    Worker half: ``direct_*``, the lease-free loads it READ itself (all, those
    failed as stale, their own time summed, the blocks they loaded and kept, the
    bytes their READs brought in); ``staged_blocks``, blocks copied
    into its staging ring and handed to the actor; ``stage_skipped_*``, blocks
    it was asked to stage but did not (no free ring slot, no ring, caches not
    mapped yet); ``ring_slots_retired``, slots of stagings the actor never
    answered; ``stagings_failed``, stagings the actor answered with an error.
    ``*_engine_seconds``: time each half spent inside the methods vLLM calls on
    its thread (``connector/engine_time.py``).
    """

    direct_reads: int = 0
    direct_reads_stale: int = 0
    direct_read_seconds: float = 0.0
    staged_blocks: int = 0
    stage_skipped_ring_full: int = 0
    stage_skipped_no_ring: int = 0
    stage_skipped_unmapped: int = 0
    ring_slots_retired: int = 0
    stagings_failed: int = 0
    worker_engine_seconds: float = 0.0
    scheduler_engine_seconds: float = 0.0
    direct_read_blocks: int = 0
    direct_read_wire_bytes: int = 0
    direct_read_useful_bytes: int = 0


@dataclass(frozen=True, slots=True)
class IndexChange:
    """One change of the tracker's index: ``rank`` published (``ADD``) or dropped
    (``REMOVE``) ``keys``, or went away with everything it held (``FORGET``)."""

    ADD = "add"
    REMOVE = "remove"
    FORGET = "forget"
    # where ``rank`` keeps published device-tier keys (the change log's records
    # carry the rows and generations); changes no holder
    LOCATE = "locate"

    op: str
    rank: int
    keys: tuple[BlockHash, ...] = ()


@dataclass(frozen=True, slots=True)
class TrackerChanges:
    """What a mirror of the tracker's index must apply to reach ``version``.

    With ``reset`` the changes rebuild the index from empty (the mirror asked from
    scratch, or fell further behind than the tracker's change log reaches).
    ``addresses`` is every registered replica's transfer actor address. The tracker
    sends its changes in ``packed``, records of ``change_log.py``, applied after
    ``changes``; ``change_log.all_changes`` reads both as ``IndexChange``.
    """

    version: int
    reset: bool
    changes: tuple[IndexChange, ...]
    addresses: tuple[tuple[int, str], ...]
    packed: bytes = b""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The tracker's answer: ``num_blocks`` leading keys are held by ``rank``."""

    rank: int
    address: str
    num_blocks: int
