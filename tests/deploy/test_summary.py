"""``xinference terminate`` prints a short summary per replica; ``--json`` all.

Users read about 60 raw counters per replica at terminate, histogram buckets
included, to learn what Xavier did. The summary gives hits by tier, tokens and bytes
loaded, load p50/p95, snapshots served and faults; the full counters stay one flag
away.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from xinference.client.restful_client import Client
from xinference.deploy.cmdline import cli
from xinference.deploy.summary import summarize_xavier
from xinference.model.llm.vllm.xavier.stats import (
    ActorCounters,
    EngineInfo,
    LatencyRecorder,
    StoreStats,
    TransportStats,
    XavierStats,
)

MiB = 1024**2


def loader_stats() -> XavierStats:
    latency = LatencyRecorder()
    for seconds in (0.001, 0.002, 0.003, 0.004, 0.020):
        latency.record(seconds)
    return XavierStats(
        actor=ActorCounters(
            device_tier_blocks_loaded=8,
            cpu_tier_blocks_loaded=4,
            loads_ok=5,
            loads_failed=1,
            connector_faults=2,
        ),
        load_latency=latency.summary(),
        store=StoreStats(device_hits=3, cpu_hits=1),
        transport=TransportStats(received_useful_bytes=MiB, transfer_timeouts=1),
        cpu_tier_transport=TransportStats(received_useful_bytes=MiB // 2),
        engine=EngineInfo("packed_kv", 2, "cpu", "stacked", block_size=32),
    )


def test_the_summary_says_what_was_loaded_how_fast_and_what_failed():
    assert summarize_xavier(loader_stats().as_dict()) == (
        "hits 8 device-tier + 4 CPU-tier blocks (384 tokens); 1.5 MiB loaded; "
        "5 loads: 5 through the transfer actor (p50 3.00 ms, p95 16.80 ms); "
        "served 4 snapshots to peers; "
        "faults: 1 loads failed, 2 connector faults, 1 device-tier transfer timeouts"
    )


def fast_path_stats() -> XavierStats:
    """One load through the actor and eleven lease-free READs by the engine."""
    latency = LatencyRecorder()
    latency.record(0.004)
    return XavierStats(
        actor=ActorCounters(
            device_tier_blocks_loaded=1,
            loads_ok=1,
            direct_reads=12,
            direct_reads_stale=1,
            direct_read_seconds=0.006,
            direct_read_blocks=11,
            direct_read_useful_bytes=11 * 4096,
        ),
        load_latency=latency.summary(),
        transport=TransportStats(received_useful_bytes=4096),
        cpu_tier_transport=TransportStats(),
        engine=EngineInfo("packed_kv", 2, "cpu", "stacked", block_size=32),
    )


def test_lease_free_reads_by_the_engine_count_as_loads_hits_and_bytes():
    """On the fast path most hits are READs the engine runs itself, which the
    transfer actor never times: the summary counts them with the rest (it read
    "1 loads" where 12 had loaded, and the READs' bytes were missing)."""
    assert summarize_xavier(fast_path_stats().as_dict()).startswith(
        "hits 12 device-tier + 0 CPU-tier blocks (384 tokens); 48.0 KiB loaded; "
        "12 loads: 1 through the transfer actor (p50 4.00 ms, p95 4.00 ms), "
        "11 lease-free by the engine (mean 0.50 ms); "
    )


def test_the_user_guide_shows_the_summary_as_terminate_prints_it():
    guide = (Path(__file__).parents[2] / "docs/user-guide.md").read_text()
    line = f"replica 1 Xavier: {summarize_xavier(fast_path_stats().as_dict())}"
    assert f"    {line}\n" in guide


def test_an_idle_replica_reads_as_such():
    assert summarize_xavier(XavierStats().as_dict()) == (
        "hits 0 device-tier + 0 CPU-tier blocks; 0 bytes loaded; no loads; "
        "served 0 snapshots to peers; faults: none"
    )
    failed = XavierStats(mapping_error="RuntimeError: can't allocate memory")
    assert summarize_xavier(failed.as_dict()).endswith(
        "mapping failed: RuntimeError: can't allocate memory"
    )


def test_terminate_prints_the_summary_and_json_prints_every_counter(monkeypatch):
    counters = {"0": XavierStats().as_dict(), "1": loader_stats().as_dict()}
    monkeypatch.setattr(
        Client, "terminate_model", lambda self, uid: {"xavier_counters": counters}
    )
    args = ["--endpoint", "http://127.0.0.1:1", "terminate", "-u", "m"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines == [
        "Terminated m",
        f"  replica 0 Xavier: {summarize_xavier(counters['0'])}",
        f"  replica 1 Xavier: {summarize_xavier(counters['1'])}",
    ]
    assert "buckets" not in result.output and "registration" not in result.output

    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    # JSON has lists where the stats have tuples
    assert json.loads(result.output) == json.loads(
        json.dumps({"xavier_counters": counters})
    )
