"""A tensor-parallel replica's stats are its ranks' summed (``rank_stats.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from xinference.model.llm.vllm.xavier.rank_stats import merge_rank_stats
from xinference.model.llm.vllm.xavier.stats import (
    ActorCounters,
    EngineInfo,
    LatencySummary,
    StoreStats,
    TransportStats,
    XavierStats,
)

ENGINE = EngineInfo("packed_kv", 2, "cpu", "stacked", 16)


def rank(loads_ok: int, p95: float | None, mapped: bool = True, **kw) -> XavierStats:
    return XavierStats(
        actor=ActorCounters(loads_ok=loads_ok, snapshots_staged=2 * loads_ok),
        load_latency=LatencySummary(
            count=loads_ok,
            sum_s=0.01 * loads_ok,
            p50_s=p95,
            p95_s=p95,
            window=loads_ok,
            buckets=((0.01, loads_ok), (0.1, loads_ok)),
        ),
        store=StoreStats(device_hits=loads_ok, cpu_bytes=100) if mapped else None,
        transport=(
            TransportStats(received_useful_bytes=10 * loads_ok) if mapped else None
        ),
        cpu_tier_transport=TransportStats() if mapped else None,
        engine=ENGINE if mapped else None,
        **kw,
    )


def test_counters_and_bytes_are_summed_and_latency_is_the_slowest_rank_s():
    merged = merge_rank_stats([rank(3, 0.002), rank(3, 0.005), rank(3, None)])
    assert merged.actor.loads_ok == 9 and merged.actor.snapshots_staged == 18
    assert merged.store.cpu_bytes == 300 and merged.store.device_hits == 9
    assert merged.transport.received_useful_bytes == 90
    assert merged.load_latency.count == 9
    assert merged.load_latency.p95_s == 0.005
    assert merged.load_latency.buckets == ((0.01, 9), (0.1, 9))
    assert merged.engine == ENGINE and merged.mapped


def test_a_replica_is_mapped_only_once_every_rank_is():
    error = "ValueError: layout"
    merged = merge_rank_stats(
        [rank(1, None), rank(0, None, False, mapping_error=error)]
    )
    assert not merged.mapped and merged.transport is None and merged.engine is None
    assert merged.mapping_error == f"tp rank 1: {error}"


def test_one_rank_is_its_own_stats():
    alone = rank(1, 0.1)
    assert merge_rank_stats([alone]) is alone
    with pytest.raises(ValueError):
        merge_rank_stats([])
    closed = dataclasses.replace(alone, closed=True)
    assert merge_rank_stats([alone, closed]).closed
