"""Latency of loads as served: a cumulative histogram plus exact recent quantiles.

The histogram (fixed buckets, Prometheus style) is what the metrics export and what
survives any number of loads; the window of the most recent durations gives exact
p50/p95 for benchmarks and logs. Pure Python: no torch, no xoscar.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from typing import Any

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

    def summary(self) -> dict[str, Any]:
        """{"count", "sum_s", "p50_s", "p95_s" (over the recent window; None when
        empty), "window", "buckets": [[upper bound, cumulative count], ...]}."""
        cumulative, running = [], 0
        for bound, count in zip(self._bounds, self._counts, strict=False):
            running += count
            cumulative.append([bound, running])
        recent = sorted(self._recent)
        return {
            "count": self.count,
            "sum_s": self._sum,
            "p50_s": statistics.median(recent) if recent else None,
            "p95_s": _quantile(recent, 0.95) if recent else None,
            "window": len(recent),
            "buckets": cumulative,
        }


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values (linear between closest ranks)."""
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
