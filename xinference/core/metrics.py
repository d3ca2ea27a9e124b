"""Prometheus text exposition of per-replica serving and Xavier counters.

Built fresh on every scrape from plain numbers (``ReplicaStats`` from the replicas,
routing counters from the dispatcher): nothing here talks to an actor, so the
rendering is tested with literal values.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ..model.llm.vllm.xavier.stats import LatencySummary, XavierStats
from .dispatch import ReplicaLatency, RouteCounters
from .messages import ReplicaStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABELS = ("model_uid", "rank")


@dataclass(frozen=True, slots=True)
class XavierMetric:
    """One exported Xavier series.

    ``stat`` is a dotted attribute path into the transfer actor's ``XavierStats``
    (for example ``"transport.sent_wire_bytes"``); ``tier`` adds a tier label when
    the stat is per tier, ``label`` another ``(name, value)`` label (one cause
    among several, one connector half); ``per_block_tokens`` multiplies a block
    count by the block size. Every transport fills every ``TransportStats`` field, so a series is never
    missing under one transport.
    """

    stat: str
    name: str
    help: str
    kind: str = "counter"  # or "gauge"
    tier: str | None = None
    label: tuple[str, str] | None = None
    per_block_tokens: bool = False

    def _extra(self) -> list[tuple[str, str]]:
        tier = [] if self.tier is None else [("tier", self.tier)]
        return tier + ([] if self.label is None else [self.label])

    def labels(self) -> list[str]:
        """The values of the labels this series adds to the replica's."""
        return [value for _, value in self._extra()]

    def label_names(self) -> list[str]:
        return [name for name, _ in self._extra()]


_HITS = "Blocks this replica loaded from a peer instead of computing, by holder tier"
_SERVED = "Snapshots this replica leased to peers, by tier"
_HELD = "Snapshots held now, by tier"
_SKIPPED = (
    "Computed blocks the engine did not stage, so that peers cannot load them: "
    "ring_full (no free staging ring slot: the transfer actor is behind; the "
    "engine never waits for it), no_ring, unmapped (before the caches were mapped)"
)
_HELD_BYTES = "Bytes of snapshots held now, by tier"


def _tiers(stat: str) -> tuple[str, ...]:
    """``stat`` of both tiers' transfers."""
    return (f"transport.{stat}", f"cpu_tier_transport.{stat}")


# Exported series. A path absent from a replica's stats is left out of the scrape.
XAVIER_METRICS: tuple[XavierMetric, ...] = (
    XavierMetric(
        "actor.device_tier_blocks_loaded", "xavier_remote_hits", _HITS, tier="device"
    ),
    # the engine's lease-free READs (fast path) are device-tier hits too
    XavierMetric(
        "actor.direct_read_blocks", "xavier_remote_hits", _HITS, tier="device"
    ),
    XavierMetric(
        "actor.cpu_tier_blocks_loaded", "xavier_remote_hits", _HITS, tier="cpu"
    ),
    *(
        XavierMetric(
            f"actor.{blocks}",
            "xavier_external_tokens_loaded",
            "Prompt tokens whose KV this replica loaded from a peer",
            per_block_tokens=True,
        )
        for blocks in (
            "device_tier_blocks_loaded",
            "direct_read_blocks",
            "cpu_tier_blocks_loaded",
        )
    ),
    XavierMetric(
        "store.device_hits", "xavier_served_snapshots", _SERVED, tier="device"
    ),
    XavierMetric("store.cpu_hits", "xavier_served_snapshots", _SERVED, tier="cpu"),
    # Bytes sum both tiers' transfers and both load paths: the device-tier
    # transport's, the CPU tier's replies (``XavierStats.cpu_tier_transport``) and
    # the engine's lease-free READs (received only: the loader READs, the holder
    # sends nothing); /stats has each apart and their sums in ``totals``.
    *(
        XavierMetric(stat, name, help_text)
        for name, help_text, stats in (
            (
                "xavier_wire_bytes",
                "Bytes this replica sent to peers' loads (both tiers)",
                _tiers("sent_wire_bytes"),
            ),
            (
                "xavier_useful_bytes",
                "KV payload bytes this replica sent to peers' loads (both tiers)",
                _tiers("sent_useful_bytes"),
            ),
            (
                "xavier_received_wire_bytes",
                "Bytes this replica's loads received from peers (both tiers, "
                "lease-free READs included)",
                (*_tiers("received_wire_bytes"), "actor.direct_read_wire_bytes"),
            ),
            (
                "xavier_received_useful_bytes",
                "KV payload bytes this replica's loads received (both tiers, "
                "lease-free READs included)",
                (*_tiers("received_useful_bytes"), "actor.direct_read_useful_bytes"),
            ),
        )
        for stat in stats
    ),
    XavierMetric(
        "transport.registration_changes",
        "xavier_registration_changes",
        "Copies that re-registered a buffer with NIXL (both endpoints counted)",
    ),
    XavierMetric(
        "store.demotions",
        "xavier_demotions",
        "Snapshots demoted from the device tier to the CPU tier",
    ),
    XavierMetric(
        "store.skips", "xavier_skips", "Snapshots not stored: no room in any tier"
    ),
    XavierMetric("store.drops", "xavier_drops", "Snapshots dropped from the store"),
    XavierMetric("store.published", "xavier_published", "Snapshots published"),
    XavierMetric(
        "actor.loads_failed",
        "xavier_load_errors",
        "Loads from a peer that failed (the engine recomputed those blocks)",
    ),
    XavierMetric("actor.loads_ok", "xavier_loads", "Loads from a peer that completed"),
    XavierMetric(
        "actor.connector_faults",
        "xavier_connector_faults",
        "Faults inside the vLLM connector that Xavier contained (the engine went "
        "on; the affected requests recomputed)",
    ),
    XavierMetric(
        "actor.direct_reads",
        "xavier_direct_reads",
        "Lease-free loads the engine process READ from a peer itself and checked "
        "(fast path), stale ones included",
    ),
    XavierMetric(
        "actor.direct_read_seconds",
        "xavier_direct_read_seconds",
        "Seconds the engine process spent on its lease-free loads (READs, scatters "
        "and generation checks), summed; with xavier_direct_reads, their mean",
    ),
    XavierMetric(
        "actor.direct_reads_stale",
        "xavier_direct_reads_stale",
        "Lease-free loads that failed because a snapshot changed on the holder "
        "(the engine recomputed those blocks)",
    ),
    XavierMetric(
        "actor.worker_staged_blocks",
        "xavier_staged_blocks",
        "Computed blocks the engine copied into its staging ring for the store",
    ),
    *(
        XavierMetric(
            f"actor.stage_skipped_{reason}",
            "xavier_stage_skipped_blocks",
            _SKIPPED,
            label=("reason", reason),
        )
        for reason in ("ring_full", "no_ring", "unmapped")
    ),
    *(
        XavierMetric(
            f"actor.{half}_engine_seconds",
            "xavier_engine_thread_seconds",
            "Seconds Xavier's connector spent inside the methods vLLM calls on its "
            "engine's threads, by connector half (summed over engine ranks); "
            "against wall time, what Xavier costs the engine",
            label=("half", half),
        )
        for half in ("scheduler", "worker")
    ),
    XavierMetric(
        "actor.ring_slots_retired",
        "xavier_ring_slots_retired",
        "Staging ring slots never reused: the transfer actor did not answer their "
        "staging in time, and may still read them",
    ),
    XavierMetric(
        "store.device_snapshots", "xavier_snapshots", _HELD, kind="gauge", tier="device"
    ),
    XavierMetric(
        "store.cpu_snapshots", "xavier_snapshots", _HELD, kind="gauge", tier="cpu"
    ),
    XavierMetric(
        "store.device_bytes",
        "xavier_snapshot_bytes",
        _HELD_BYTES,
        kind="gauge",
        tier="device",
    ),
    XavierMetric(
        "store.cpu_bytes",
        "xavier_snapshot_bytes",
        _HELD_BYTES,
        kind="gauge",
        tier="cpu",
    ),
)


# The breakdown of a tensor-parallel replica by engine rank (label ``tp_rank``):
# what one rank failing or lagging shows as (the series above sum the ranks).
XAVIER_RANK_METRICS: tuple[XavierMetric, ...] = (
    XavierMetric(
        "actor.device_tier_blocks_loaded",
        "xavier_rank_remote_hits",
        "Block shards this engine rank loaded from the same rank of a peer",
    ),
    XavierMetric(
        "actor.cpu_tier_blocks_loaded",
        "xavier_rank_remote_hits",
        "Block shards this engine rank loaded from the same rank of a peer",
    ),
    XavierMetric(
        "actor.loads_failed",
        "xavier_rank_load_errors",
        "Loads of this engine rank's shards that failed (every rank recomputed)",
    ),
    XavierMetric(
        "actor.connector_faults",
        "xavier_rank_connector_faults",
        "Faults this engine rank's connector half contained",
    ),
)


def lookup(stats: XavierStats, path: str) -> float | None:
    """The number at dotted attribute ``path`` of ``stats``; None while its section
    is absent (the engine's caches are not mapped yet). A path that names no field
    raises: the metric table and the stats types must agree."""
    value: Any = stats
    for part in path.split("."):
        if value is None:
            return None
        value = getattr(value, part)
    return None if value is None else float(value)


@dataclass(frozen=True, slots=True)
class ReplicaSample:
    """Everything scraped about one replica."""

    stats: ReplicaStats
    routing: RouteCounters | None = None
    latency: ReplicaLatency | None = None  # measured by the front end's dispatcher
    address: str = ""  # the replica's sub-pool (upstream's ``node`` label)


def render(samples: Sequence[ReplicaSample]) -> bytes:
    """The Prometheus text exposition of ``samples``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(samples))
    return generate_latest(registry)


class _Snapshot:
    """A one-shot collector over already gathered samples."""

    def __init__(self, samples: Sequence[ReplicaSample]) -> None:
        self._samples = samples

    def collect(self) -> Iterator[Metric]:
        yield from _serving_metrics(self._samples)
        yield from _latency_metrics(self._samples)
        yield from _upstream_metrics(self._samples)
        yield from _xavier_metrics(self._samples)


def _labels(stats: ReplicaStats) -> list[str]:
    return [stats.model_uid, str(stats.rank)]


def _serving_metrics(samples: Sequence[ReplicaSample]) -> Iterable[Metric]:
    serving: list[tuple[str, str, str]] = [
        ("requests_total", "xinference_requests", "Requests served by the replica"),
        ("prompt_tokens_total", "xinference_prompt_tokens", "Prompt tokens received"),
        (
            "cached_prompt_tokens_total",
            "xinference_cached_prompt_tokens",
            "Prompt tokens not computed (local prefix cache or Xavier load)",
        ),
        ("generated_tokens_total", "xinference_generated_tokens", "Tokens generated"),
    ]
    for field_name, name, help_text in serving:
        family = CounterMetricFamily(name, help_text, labels=_LABELS)
        for sample in samples:
            family.add_metric(_labels(sample.stats), getattr(sample.stats, field_name))
        yield family
    in_flight = GaugeMetricFamily(
        "xinference_requests_in_flight", "Requests running now", labels=_LABELS
    )
    for sample in samples:
        in_flight.add_metric(_labels(sample.stats), sample.stats.requests_in_flight)
    yield in_flight
    routing: list[tuple[str, str, str]] = [
        ("routed", "xinference_routed_requests", "Requests the router sent here"),
        (
            "routed_to_holder",
            "xinference_routed_to_prefix_holder",
            "Requests sent here because this replica held their longest prefix",
        ),
        (
            "holder_too_busy",
            "xinference_prefix_holder_too_busy",
            "Requests whose prefix was here but went elsewhere: this replica was busy",
        ),
    ]
    for field_name, name, help_text in routing:
        family = CounterMetricFamily(name, help_text, labels=_LABELS)
        for sample in samples:
            if sample.routing is not None:
                family.add_metric(
                    _labels(sample.stats), getattr(sample.routing, field_name)
                )
        yield family


def _latency_metrics(samples: Sequence[ReplicaSample]) -> Iterable[Metric]:
    measured = [(s.stats, s.latency) for s in samples if s.latency is not None]
    yield _histogram(
        "xinference_time_to_first_token_seconds",
        "Time from a streamed request's arrival to its first token",
        [(stats, latency.first_token.summary()) for stats, latency in measured],
    )
    yield _histogram(
        "xinference_request_duration_seconds",
        "Time from a request's arrival to its last token (successful requests)",
        [(stats, latency.end_to_end.summary()) for stats, latency in measured],
    )


def _histogram(
    name: str, help_text: str, rows: Sequence[tuple[ReplicaStats, LatencySummary]]
) -> Metric:
    """A per-replica histogram family from recorded latency summaries."""
    family = HistogramMetricFamily(name, help_text, labels=_LABELS)
    for stats, summary in rows:
        family.add_metric(
            _labels(stats),
            _buckets(summary.buckets, summary.count),
            sum_value=summary.sum_s,
        )
    return family


# Upstream Xinference's series, under its names and labels, for its dashboards.
_UPSTREAM_LABELS = ("type", "model", "node", "format", "quantization", "rank")


def _upstream_labels(sample: ReplicaSample) -> dict[str, str]:
    return {
        "type": "LLM",
        "model": sample.stats.model_uid,
        "node": sample.address,
        "format": "",
        "quantization": "",
        "rank": str(sample.stats.rank),
    }


def _upstream_metrics(samples: Sequence[ReplicaSample]) -> Iterable[Metric]:
    # Metric, not CounterMetricFamily: the names must stay exactly upstream's
    # (CounterMetricFamily would append "_total").
    counters = [
        ("prompt_tokens_total", "input_tokens_total_counter", "Input tokens"),
        ("generated_tokens_total", "output_tokens_total_counter", "Output tokens"),
        ("requests_total", "model_request_total", "Model requests"),
    ]
    for field_name, suffix, help_text in counters:
        metric = Metric(f"xinference:{suffix}", help_text, "counter")
        for sample in samples:
            metric.add_sample(
                metric.name,
                _upstream_labels(sample),
                float(getattr(sample.stats, field_name)),
            )
        yield metric
    serving = Metric(
        "xinference:model_serve_count", "Requests being served now", "gauge"
    )
    first_token = Metric(
        "xinference:time_to_first_token_ms",
        "Median first-token latency in ms of the recent streamed requests",
        "gauge",
    )
    duration = HistogramMetricFamily(
        "xinference:model_request_duration_seconds",
        "Model request duration in seconds",
        labels=_UPSTREAM_LABELS,
    )
    for sample in samples:
        labels = _upstream_labels(sample)
        serving.add_sample(serving.name, labels, float(sample.stats.requests_in_flight))
        if sample.latency is None:
            continue
        median = sample.latency.first_token.summary().p50_s
        if median is not None:
            first_token.add_sample(first_token.name, labels, median * 1000)
        end_to_end = sample.latency.end_to_end.summary()
        duration.add_metric(
            [labels[name] for name in _UPSTREAM_LABELS],
            _buckets(end_to_end.buckets, end_to_end.count),
            sum_value=end_to_end.sum_s,
        )
    yield serving
    yield first_token
    yield duration


def _buckets(
    cumulative: Sequence[tuple[float, int]], count: int
) -> list[tuple[str, float]]:
    buckets = [(repr(float(bound)), float(total)) for bound, total in cumulative]
    buckets.append(("+Inf", float(count)))
    return buckets


def _xavier_metrics(samples: Sequence[ReplicaSample]) -> Iterable[Metric]:
    # name -> family; label tuple -> value, summed (a series may add several stats)
    families: dict[str, Any] = {}
    values: dict[str, dict[tuple[str, ...], float]] = {}
    for metric in XAVIER_METRICS:
        if metric.name not in families:
            names = list(_LABELS) + metric.label_names()
            cls = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
            families[metric.name] = cls(metric.name, metric.help, labels=names)
            values[metric.name] = {}
        for sample in samples:
            stats = sample.stats.xavier
            value = None if stats is None else lookup(stats, metric.stat)
            if value is None:
                continue
            if metric.per_block_tokens:
                value *= sample.stats.block_size
            key = tuple(_labels(sample.stats) + metric.labels())
            series = values[metric.name]
            series[key] = series.get(key, 0.0) + value
    yield from _filled(families, values)
    yield _load_latency_histogram(samples)
    yield from _rank_metrics(samples)


def _rank_metrics(samples: Sequence[ReplicaSample]) -> Iterable[Metric]:
    """``XAVIER_RANK_METRICS`` of the replicas with several engine ranks."""
    families: dict[str, Any] = {}
    values: dict[str, dict[tuple[str, ...], float]] = {}
    for metric in XAVIER_RANK_METRICS:
        if metric.name not in families:
            labels = [*_LABELS, "tp_rank"]
            families[metric.name] = CounterMetricFamily(
                metric.name, metric.help, labels=labels
            )
            values[metric.name] = {}
        for sample in samples:
            for tp_rank, stats in enumerate(sample.stats.xavier_ranks):
                value = lookup(stats, metric.stat)
                if value is None:
                    continue
                key = (*_labels(sample.stats), str(tp_rank))
                series = values[metric.name]
                series[key] = series.get(key, 0.0) + value
    yield from _filled(families, values)


def _filled(
    families: dict[str, Any], values: dict[str, dict[tuple[str, ...], float]]
) -> Iterable[Metric]:
    """Each family with its summed values (label tuple -> value) added."""
    for name, family in families.items():
        for key, value in values[name].items():
            family.add_metric(list(key), value)
        yield family


def _load_latency_histogram(samples: Sequence[ReplicaSample]) -> Metric:
    """``xavier_load_seconds`` from each replica's ``load_latency`` summary."""
    return _histogram(
        "xavier_load_seconds",
        "Time from the start of a load from a peer to its result (successful loads)",
        [
            (sample.stats, sample.stats.xavier.load_latency)
            for sample in samples
            if sample.stats.xavier is not None
        ],
    )
