"""Prometheus rendering from literal counters."""

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from xinference.core.dispatch import ReplicaLatency, RouteCounters
from xinference.core.messages import ReplicaStats, format_counters
from xinference.core.metrics import XAVIER_METRICS, ReplicaSample, lookup, render
from xinference.model.llm.vllm.xavier.stats import (
    ActorCounters,
    LatencySummary,
    StoreStats,
    TransportStats,
    XavierStats,
)

XAVIER_STATS = XavierStats(
    store=StoreStats(
        device_hits=3,
        cpu_hits=1,
        demotions=2,
        skips=1,
        drops=0,
        published=9,
        device_snapshots=4,
        cpu_snapshots=5,
        device_bytes=4096,
        cpu_bytes=5120,
    ),
    transport=TransportStats(
        sent_wire_bytes=1000,
        sent_useful_bytes=600,
        received_wire_bytes=10,
        received_useful_bytes=6,
        registration_changes=2,
    ),
    cpu_tier_transport=TransportStats(
        sent_wire_bytes=200,
        sent_useful_bytes=200,
        received_wire_bytes=3000,
        received_useful_bytes=3000,
    ),
    actor=ActorCounters(
        device_tier_blocks_loaded=7,
        cpu_tier_blocks_loaded=2,
        loads_ok=3,
        loads_failed=1,
        connector_faults=4,
        worker_staged_blocks=40,
        stage_skipped_ring_full=6,
        stage_skipped_unmapped=2,
        ring_slots_retired=3,
        worker_engine_seconds=0.25,
        scheduler_engine_seconds=0.5,
        # the engine's lease-free READs: 5 loads, 1 stale, 11 blocks kept
        direct_reads=5,
        direct_reads_stale=1,
        direct_read_blocks=11,
        direct_read_wire_bytes=50_000,
        direct_read_useful_bytes=44_000,
    ),
    load_latency=LatencySummary(
        count=3, sum_s=0.006, buckets=((0.001, 1), (0.0025, 3))
    ),
)


def stats(rank, xavier=None):
    return ReplicaStats(
        model_uid="m",
        rank=rank,
        block_size=32,
        requests_total=5 + rank,
        requests_in_flight=rank,
        prompt_tokens_total=100,
        cached_prompt_tokens_total=64,
        generated_tokens_total=40,
        xavier=xavier,
    )


def scrape(samples):
    values = {}
    for family in text_string_to_metric_families(render(samples).decode()):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            values[key] = sample.value
    return values


def test_the_totals_a_person_reads_are_the_exported_series():
    """The page and ``terminate`` read ``XavierStats.totals()``; ``/metrics``
    sums its series from the same counters: both give the same figures."""
    totals = XAVIER_STATS.totals()
    assert (totals.device_tier_blocks, totals.cpu_tier_blocks) == (7 + 11, 2)
    assert (totals.loads, totals.actor_loads, totals.lease_free_loads) == (7, 3, 4)
    values = scrape([ReplicaSample(stats(0, XAVIER_STATS))])
    r0 = (("model_uid", "m"), ("rank", "0"))

    def get(name, *extra):
        return values[(name, tuple(sorted(r0 + extra)))]

    assert totals.device_tier_blocks == get(
        "xavier_remote_hits_total", ("tier", "device")
    )
    assert totals.cpu_tier_blocks == get("xavier_remote_hits_total", ("tier", "cpu"))
    assert totals.sent_wire_bytes == get("xavier_wire_bytes_total")
    assert totals.sent_useful_bytes == get("xavier_useful_bytes_total")
    assert totals.received_wire_bytes == get("xavier_received_wire_bytes_total")
    assert totals.received_useful_bytes == get("xavier_received_useful_bytes_total")
    # as_dict carries them for JSON (the REST API, terminate's counters)
    assert XAVIER_STATS.as_dict()["totals"] == dataclasses.asdict(totals)


def test_a_cpu_tier_only_replica_reports_what_it_moved():
    """A CPU run moves bytes through the CPU tier's replies only: its totals
    are not the device-tier transport's zeros."""
    cpu_only = XavierStats(
        actor=ActorCounters(cpu_tier_blocks_loaded=4, loads_ok=1),
        transport=TransportStats(),
        cpu_tier_transport=TransportStats(
            received_wire_bytes=573_440, received_useful_bytes=573_440
        ),
    )
    totals = cpu_only.totals()
    assert (totals.received_wire_bytes, totals.received_useful_bytes) == (573_440,) * 2
    assert (totals.cpu_tier_blocks, totals.loads) == (4, 1)
    # mapped not yet: no transports, nothing moved
    assert XavierStats().totals().received_wire_bytes == 0


def test_per_replica_xavier_series():
    values = scrape(
        [
            ReplicaSample(stats(0, XAVIER_STATS), RouteCounters(routed=4)),
            ReplicaSample(stats(1, None), RouteCounters(routed=2, routed_to_holder=1)),
        ]
    )
    r0 = (("model_uid", "m"), ("rank", "0"))

    def get(name, *extra):
        return values[(name, tuple(sorted(r0 + extra)))]

    # device-tier hits: the actor's loads and the engine's lease-free READs
    assert get("xavier_remote_hits_total", ("tier", "device")) == 7 + 11
    assert get("xavier_remote_hits_total", ("tier", "cpu")) == 2
    assert get("xavier_external_tokens_loaded_total") == (7 + 11 + 2) * 32
    assert get("xavier_served_snapshots_total", ("tier", "device")) == 3
    # bytes add both tiers (the device-tier transport's and the CPU tier's
    # replies) and, received, the lease-free READs
    assert get("xavier_wire_bytes_total") == 1000 + 200
    assert get("xavier_useful_bytes_total") == 600 + 200
    assert get("xavier_received_wire_bytes_total") == 10 + 3000 + 50_000
    assert get("xavier_received_useful_bytes_total") == 6 + 3000 + 44_000
    assert get("xavier_registration_changes_total") == 2
    assert get("xavier_demotions_total") == 2
    assert get("xavier_skips_total") == 1
    assert get("xavier_load_errors_total") == 1
    assert get("xavier_connector_faults_total") == 4
    assert get("xavier_staged_blocks_total") == 40
    skipped = "xavier_stage_skipped_blocks_total"
    assert get(skipped, ("reason", "ring_full")) == 6
    assert get(skipped, ("reason", "no_ring")) == 0
    assert get(skipped, ("reason", "unmapped")) == 2
    assert get("xavier_ring_slots_retired_total") == 3
    assert get("xavier_engine_thread_seconds_total", ("half", "worker")) == 0.25
    assert get("xavier_engine_thread_seconds_total", ("half", "scheduler")) == 0.5
    assert get("xavier_load_seconds_bucket", ("le", "0.001")) == 1
    assert get("xavier_load_seconds_bucket", ("le", "+Inf")) == 3
    assert get("xavier_load_seconds_count") == 3
    assert get("xavier_snapshots", ("tier", "cpu")) == 5
    assert get("xinference_requests_total") == 5
    assert get("xinference_routed_requests_total") == 4
    # replica 1 has Xavier off: serving series only
    r1 = (("model_uid", "m"), ("rank", "1"))
    assert values[("xinference_requests_in_flight", r1)] == 1
    assert values[("xinference_routed_to_prefix_holder_total", r1)] == 1
    assert not any(
        name.startswith("xavier_") and labels == r1 for name, labels in values
    )


def test_a_tensor_parallel_replica_is_broken_down_by_engine_rank():
    healthy = XavierStats(actor=ActorCounters(cpu_tier_blocks_loaded=4, loads_ok=1))
    failing = XavierStats(
        actor=ActorCounters(loads_failed=1, connector_faults=2), store=StoreStats()
    )
    replica = dataclasses.replace(
        stats(0, XAVIER_STATS), xavier_ranks=(healthy, failing)
    )
    values = scrape([ReplicaSample(replica), ReplicaSample(stats(1, XAVIER_STATS))])

    def get(name, tp_rank, rank="0"):
        labels = (("model_uid", "m"), ("rank", rank), ("tp_rank", tp_rank))
        return values.get((name, tuple(sorted(labels))))

    assert get("xavier_rank_remote_hits_total", "0") == 4
    assert get("xavier_rank_remote_hits_total", "1") == 0
    assert get("xavier_rank_load_errors_total", "1") == 1
    assert get("xavier_rank_connector_faults_total", "1") == 2
    # the replica's own series stay its summed stats; one-rank replicas have no
    # breakdown
    assert values[("xavier_loads_total", (("model_uid", "m"), ("rank", "0")))] == 3
    assert get("xavier_rank_remote_hits_total", "0", rank="1") is None


def test_no_replicas_renders_only_metadata():
    assert scrape([]) == {}


def test_lookup_and_format_counters():
    assert lookup(XAVIER_STATS, "transport.sent_wire_bytes") == 1000
    assert lookup(XavierStats(), "transport.sent_wire_bytes") is None  # not mapped
    assert format_counters({"a": {"b": 1}, "c": 2}) == "a.b=1, c=2"


def test_every_metric_names_a_field_of_the_stats():
    """A metric whose path names no field would vanish silently: it raises."""
    for metric in XAVIER_METRICS:
        assert lookup(XAVIER_STATS, metric.stat) is not None, metric.stat
    with pytest.raises(AttributeError):
        lookup(XAVIER_STATS, "transport.missing")


def test_latency_histograms_and_upstream_series():
    latency = ReplicaLatency()
    for seconds in (0.004, 0.2, 0.3):
        latency.end_to_end.record(seconds)
    latency.first_token.record(0.02)
    latency.first_token.record(0.07)
    values = scrape(
        [
            ReplicaSample(stats(0), RouteCounters(), latency, "127.0.0.1:5000"),
            ReplicaSample(stats(1)),  # no requests through this front end yet
        ]
    )
    r0 = (("model_uid", "m"), ("rank", "0"))

    def get(name, *extra):
        return values[(name, tuple(sorted(r0 + extra)))]

    assert get("xinference_time_to_first_token_seconds_bucket", ("le", "0.025")) == 1
    assert get("xinference_time_to_first_token_seconds_bucket", ("le", "0.1")) == 2
    assert get("xinference_time_to_first_token_seconds_count") == 2
    assert get("xinference_request_duration_seconds_bucket", ("le", "0.01")) == 1
    assert get("xinference_request_duration_seconds_bucket", ("le", "0.25")) == 2
    assert get("xinference_request_duration_seconds_bucket", ("le", "+Inf")) == 3
    assert get("xinference_request_duration_seconds_sum") == pytest.approx(0.504)
    upstream = tuple(
        sorted(
            dict(
                type="LLM",
                model="m",
                node="127.0.0.1:5000",
                format="",
                quantization="",
                rank="0",
            ).items()
        )
    )
    assert values[("xinference:input_tokens_total_counter", upstream)] == 100
    assert values[("xinference:output_tokens_total_counter", upstream)] == 40
    assert values[("xinference:model_request_total", upstream)] == 5
    assert values[("xinference:model_serve_count", upstream)] == 0
    # the median of the recent first-token latencies, in ms
    assert values[("xinference:time_to_first_token_ms", upstream)] == pytest.approx(45)
    duration = "xinference:model_request_duration_seconds_count"
    assert values[(duration, upstream)] == 3
    # a replica without front-end measurements has no latency series
    r1 = (("model_uid", "m"), ("rank", "1"))
    assert ("xinference_request_duration_seconds_count", r1) not in values
