"""The one stats object of a replica's Xavier side, typed, and its parts.

The transfer actor answers ``stats()`` with an ``XavierStats``: the store's counts and
occupancy (``StoreStats``), the transport's (``TransportStats``, the same fields
under every transport, zero where a transport has no such event), the actor's own
load and staging counters (``ActorCounters``), the latency of loads as served
(``LatencySummary``) and the mapped engine cache (``EngineInfo``). ``core/metrics.py``
reads these attributes; the REST API and the console print ``as_dict()``.

The latency of loads is kept two ways by ``LatencyRecorder``: a cumulative histogram
(fixed buckets, Prometheus style) that survives any number of loads, and the window
of the most recent durations for exact p50/p95. Pure Python: no torch, no xoscar.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .wire import ConnectorTotals


@dataclass(frozen=True, slots=True)
class StoreStats:
    """The snapshot store's counters since construction and its occupancy now.

    ``*_snapshots`` and ``*_bytes`` count published snapshots; slots held by
    snapshots still staging are ``staging_snapshots``.
    """

    device_hits: int = 0
    cpu_hits: int = 0
    demotions: int = 0
    drops: int = 0
    skips: int = 0
    published: int = 0
    device_snapshots: int = 0
    cpu_snapshots: int = 0
    device_bytes: int = 0
    cpu_bytes: int = 0
    device_capacity_blocks: int = 0
    cpu_capacity_blocks: int = 0
    staging_snapshots: int = 0
    active_leases: int = 0


@dataclass(slots=True)
class TransportStats:
    """Cumulative counts of one device-tier transport (mutable, owned by it).

    ``sent_*``: what this side wrote into peers (a holder pushing with the xoscar
    transport; a NIXL holder does nothing in a READ). ``received_*``: what loads
    brought here. Wire bytes are what crossed, useful bytes the rows asked for.
    ``registration_changes`` counts memory registrations after start (both ends
    of a copy for xoscar, split in ``local_``/``remote_``); ``registrations`` the
    NIXL registrations held; ``descriptors``, ``peer_metadata_loads`` and
    ``engine_placed_loads`` describe NIXL READs.
    """

    sent_copies: int = 0
    sent_wire_bytes: int = 0
    sent_useful_bytes: int = 0
    received_copies: int = 0
    received_wire_bytes: int = 0
    received_useful_bytes: int = 0
    loads: int = 0
    transfer_failures: int = 0
    transfer_timeouts: int = 0
    registrations: int = 0
    registration_changes: int = 0
    local_registration_changes: int = 0
    remote_registration_changes: int = 0
    retired_receive_slabs: int = 0
    descriptors: int = 0
    peer_metadata_loads: int = 0
    engine_placed_loads: int = 0


# ActorCounters field <- ConnectorTotals field, for record_connector_totals
_FROM_CONNECTOR_TOTALS = (
    ("direct_reads", "direct_reads"),
    ("direct_reads_stale", "direct_reads_stale"),
    ("direct_read_seconds", "direct_read_seconds"),
    ("direct_read_blocks", "direct_read_blocks"),
    ("direct_read_wire_bytes", "direct_read_wire_bytes"),
    ("direct_read_useful_bytes", "direct_read_useful_bytes"),
    ("worker_staged_blocks", "staged_blocks"),
    ("stage_skipped_ring_full", "stage_skipped_ring_full"),
    ("stage_skipped_no_ring", "stage_skipped_no_ring"),
    ("stage_skipped_unmapped", "stage_skipped_unmapped"),
    ("ring_slots_retired", "ring_slots_retired"),
    ("worker_stagings_failed", "stagings_failed"),
    ("worker_engine_seconds", "worker_engine_seconds"),
    ("scheduler_engine_seconds", "scheduler_engine_seconds"),
)


@dataclass(slots=True)
class ActorCounters:
    """The transfer actor's own counters (mutable, owned by the actor)."""

    loads_started: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    loads_cancelled: int = 0
    loads_past_bound: int = 0  # synchronous loads fenced at their bound
    device_tier_blocks_loaded: int = 0
    cpu_tier_blocks_loaded: int = 0
    cpu_rows_served: int = 0
    snapshots_staged: int = 0
    stage_failures: int = 0
    lease_release_failures: int = 0
    leases_expired: int = 0
    tracker_failures: int = 0
    connector_faults: int = 0  # contained inside this replica's vLLM connector
    # What the connector counted in the engine process, as its last report
    # said (``wire.ConnectorTotals`` has the meanings): its lease-free loads ...
    direct_reads: int = 0
    direct_reads_stale: int = 0
    direct_read_seconds: float = 0.0  # those loads' own time, summed
    direct_read_blocks: int = 0  # the blocks they loaded (verified, kept)
    direct_read_wire_bytes: int = 0  # what their READs brought in
    direct_read_useful_bytes: int = 0
    # ... and the blocks it was asked to stage, by what became of them
    worker_staged_blocks: int = 0
    stage_skipped_ring_full: int = 0
    stage_skipped_no_ring: int = 0
    stage_skipped_unmapped: int = 0
    ring_slots_retired: int = 0
    worker_stagings_failed: int = 0
    # ... and the time each connector half took on the engine's thread
    worker_engine_seconds: float = 0.0
    scheduler_engine_seconds: float = 0.0

    def record_connector_totals(self, totals: ConnectorTotals) -> None:
        """The engine process's totals so far: a report lost or overtaken is made
        good by a later one, and a counter never goes back."""
        for mine, reported in _FROM_CONNECTOR_TOTALS:
            setattr(self, mine, max(getattr(self, mine), getattr(totals, reported)))


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Durations recorded so far: ``count`` and ``sum_s`` in all, cumulative
    ``buckets`` ``(upper bound s, count)``, and p50/p95 over the last ``window``
    (None before the first)."""

    count: int = 0
    sum_s: float = 0.0
    p50_s: float | None = None
    p95_s: float | None = None
    window: int = 0
    buckets: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The engine KV cache a transfer actor mapped."""

    layout: str
    layers: int
    device: str
    scatter_path: str  # see engine/blocks.py: stacked, span or per layer
    block_size: int = 0  # tokens per block (0: not given)


@dataclass(frozen=True, slots=True)
class LoadTotals:
    """What a replica moved, over both tiers and both load paths: the figures a
    person reads (the page, ``terminate``'s summary, ``/metrics``' byte series).

    A block reaches a replica two ways: a load its transfer actor runs and times
    (from either tier: ``transport`` or ``cpu_tier_transport``), or a lease-free
    READ the engine process runs itself on the fast path (``actor.direct_read_*``,
    device tier only, never seen by the actor). ``loads`` counts both paths'
    completed loads, ``actor_loads`` and ``lease_free_loads`` each; blocks and
    received bytes sum them. Sent bytes are the holder side's, both tiers (a NIXL
    holder sends nothing itself: the loader READs).
    """

    device_tier_blocks: int = 0
    cpu_tier_blocks: int = 0
    loads: int = 0
    actor_loads: int = 0
    lease_free_loads: int = 0
    received_wire_bytes: int = 0
    received_useful_bytes: int = 0
    sent_wire_bytes: int = 0
    sent_useful_bytes: int = 0


@dataclass(frozen=True, slots=True)
class XavierStats:
    """Everything a replica's transfer actor counts. ``store``, ``transport``,
    ``cpu_tier_transport`` and ``engine`` are None until the engine's caches are
    mapped.

    Bytes moved are counted per tier: ``transport`` is the device-tier transport's
    (nixl or xoscar), ``cpu_tier_transport`` the CPU tier's batched actor replies
    (``transports/cpu_tier.py``) in the same fields (``received_*`` as a loader,
    ``sent_*`` as a holder). ``mapping_error`` is why the last attempt to map the
    engine's caches failed (None: none failed, or one succeeded since).
    """

    actor: ActorCounters = field(default_factory=ActorCounters)
    load_latency: LatencySummary = field(default_factory=LatencySummary)
    store: StoreStats | None = None
    transport: TransportStats | None = None
    cpu_tier_transport: TransportStats | None = None
    engine: EngineInfo | None = None
    in_flight_loads: int = 0
    closed: bool = False
    mapping_error: str | None = None

    @property
    def mapped(self) -> bool:
        return self.store is not None

    def totals(self) -> LoadTotals:
        """Blocks, loads and bytes over both tiers and both load paths."""
        actor = self.actor
        tiers = [t for t in (self.transport, self.cpu_tier_transport) if t]

        def moved(name: str) -> int:
            return sum(getattr(tier, name) for tier in tiers)

        lease_free = actor.direct_reads - actor.direct_reads_stale
        return LoadTotals(
            device_tier_blocks=actor.device_tier_blocks_loaded
            + actor.direct_read_blocks,
            cpu_tier_blocks=actor.cpu_tier_blocks_loaded,
            loads=actor.loads_ok + lease_free,
            actor_loads=actor.loads_ok,
            lease_free_loads=lease_free,
            received_wire_bytes=moved("received_wire_bytes")
            + actor.direct_read_wire_bytes,
            received_useful_bytes=moved("received_useful_bytes")
            + actor.direct_read_useful_bytes,
            sent_wire_bytes=moved("sent_wire_bytes"),
            sent_useful_bytes=moved("sent_useful_bytes"),
        )

    def as_dict(self) -> dict[str, Any]:
        """Nested plain data, for JSON and the console, with ``totals`` (the
        figures of ``totals()``) beside the counters they come from."""
        return asdict(self) | {"totals": asdict(self.totals())}


# Upper bounds in seconds: a direct NIXL load on one GPU takes about 0.1 ms, a load
# over TCP or from the CPU tier milliseconds, a stalled one up to its deadline.
LOAD_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class LatencyRecorder:
    """Durations in seconds: bucket counts, their sum, and the last ``window``."""

    def __init__(
        self, buckets: tuple[float, ...] = LOAD_SECONDS_BUCKETS, window: int = 1024
    ) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"buckets must be strictly increasing, got {buckets}")
        self._bounds = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one: above every bound
        self._sum = 0.0
        self._recent: deque[float] = deque(maxlen=window)

    def record(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a duration cannot be negative: {seconds}")
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds
        self._recent.append(seconds)

    @property
    def count(self) -> int:
        return sum(self._counts)

    def summary(self) -> LatencySummary:
        cumulative, running = [], 0
        for bound, count in zip(self._bounds, self._counts, strict=False):
            running += count
            cumulative.append((bound, running))
        recent = sorted(self._recent)
        return LatencySummary(
            count=self.count,
            sum_s=self._sum,
            p50_s=statistics.median(recent) if recent else None,
            p95_s=_quantile(recent, 0.95) if recent else None,
            window=len(recent),
            buckets=tuple(cumulative),
        )


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values (linear between closest ranks)."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
