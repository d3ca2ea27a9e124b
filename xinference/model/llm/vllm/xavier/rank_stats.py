"""One tensor-parallel replica's stats: its ranks' ``XavierStats`` as one.

Every engine rank of a replica has its own transfer actor, store and transport, so
each counts its own part: a load of a replica of N ranks is N loads of one shard
each, a snapshot N shards. The replica's counters are the sums over its ranks (the
``xavier_*`` series are per replica); its load latency is the slowest rank's, since
a request waits for every rank's part. The per-rank stats stay available for a
``tp_rank`` breakdown. No torch, no xoscar.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from .stats import LatencySummary, XavierStats

T = TypeVar("T")


def merge_rank_stats(ranks: Sequence[XavierStats]) -> XavierStats:
    """The replica's stats from its ranks' (rank 0 first)."""
    if not ranks:
        raise ValueError("a replica has at least one rank")
    if len(ranks) == 1:
        return ranks[0]
    first = ranks[0]
    errors = [s.mapping_error for s in ranks if s.mapping_error is not None]
    return XavierStats(
        actor=_sum([s.actor for s in ranks]),
        load_latency=_slowest([s.load_latency for s in ranks]),
        # mapped only once every rank is: a replica serves no load before that
        store=_sum_or_none([s.store for s in ranks]),
        transport=_sum_or_none([s.transport for s in ranks]),
        cpu_tier_transport=_sum_or_none([s.cpu_tier_transport for s in ranks]),
        engine=first.engine if all(s.engine is not None for s in ranks) else None,
        in_flight_loads=sum(s.in_flight_loads for s in ranks),
        closed=any(s.closed for s in ranks),
        mapping_error=(
            "; ".join(
                f"tp rank {i}: {s.mapping_error}"
                for i, s in enumerate(ranks)
                if s.mapping_error is not None
            )
            if errors
            else None
        ),
    )


def _sum_or_none(parts: Sequence[T | None]) -> T | None:
    present = [p for p in parts if p is not None]
    if len(present) < len(parts):
        return None
    return _sum(present)


def _sum(parts: Sequence[T]) -> T:
    """Field-wise sum of dataclasses of numbers."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(parts[0]):  # type: ignore[arg-type]
        values[field.name] = sum(getattr(p, field.name) for p in parts)
    return type(parts[0])(**values)


def _slowest(parts: Sequence[LatencySummary]) -> LatencySummary:
    """Counts and bucket counts summed; the quantiles the slowest rank's."""
    buckets: dict[float, int] = {}
    for part in parts:
        for bound, count in part.buckets:
            buckets[bound] = buckets.get(bound, 0) + count
    p50 = [p.p50_s for p in parts if p.p50_s is not None]
    p95 = [p.p95_s for p in parts if p.p95_s is not None]
    return LatencySummary(
        count=sum(p.count for p in parts),
        sum_s=sum(p.sum_s for p in parts),
        p50_s=max(p50) if p50 else None,
        p95_s=max(p95) if p95 else None,
        window=max(p.window for p in parts),
        buckets=tuple(sorted(buckets.items())),
    )
