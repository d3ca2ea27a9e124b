"""The engine process's direct-read totals reach the transfer actor's counters
(``connector/direct_read_counts.py``) without the engine thread waiting, a delay
after they moved, and a report that failed is made good by the next one. The
real reads that move these totals are in ``test_direct_reads.py``."""

from __future__ import annotations

import asyncio
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector.direct_read_counts import (
    DirectReadCounts,
)
from xinference.model.llm.vllm.xavier.stats import ActorCounters


class Actor:
    """Counts what reaches it; ``failures`` reports fail first, ``gate`` holds
    every report until set."""

    def __init__(self, failures: int = 0) -> None:
        self.counters = ActorCounters()
        self.calls = 0
        self.failures = failures
        self.gate = asyncio.Event()
        self.gate.set()

    async def record_direct_reads(self, reads: int, stale: int, seconds: float) -> None:
        self.calls += 1
        await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the actor is away")
        self.counters.record_direct_reads(reads, stale, seconds)


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-direct-read-counts")
    yield background
    background.close()


def counting(
    loop: BackgroundLoop, actor: Actor, delay_s: float = 0.02
) -> tuple[DirectReadCounts, Any]:
    async def own_actor() -> Actor:
        return actor

    counts = DirectReadCounts(loop, own_actor, rpc_timeout_s=5.0, delay_s=delay_s)
    reads = types.SimpleNamespace(loads=0, stale=0, seconds=0.0)
    make = counts.watch(lambda kv_caches: reads)  # type: ignore[arg-type,return-value]
    assert make is not None
    make([])
    return counts, reads


def settled(counts: DirectReadCounts) -> None:
    deadline = time.monotonic() + 5
    while counts._sending is not None and not counts._sending.done():
        assert time.monotonic() < deadline, "a report never ended"
        time.sleep(0.005)


def test_totals_are_sent_once_each_time_they_move(loop):
    actor = Actor()
    counts, reads = counting(loop, actor)
    counts.report()
    settled(counts)
    assert actor.calls == 0  # nothing read yet: nothing to send
    reads.loads, reads.stale, reads.seconds = 3, 1, 0.004
    counts.report()
    settled(counts)
    counts.report()  # unchanged since the actor took them
    settled(counts)
    assert actor.calls == 1
    counters = actor.counters
    assert (counters.direct_reads, counters.direct_reads_stale) == (3, 1)
    assert counters.direct_read_seconds == 0.004


def test_a_report_waits_its_delay_and_carries_every_move_within_it(loop):
    """Not sent from the step that moved the totals (its answer is still being
    handed back), and the steps within the delay add no report of their own."""
    actor = Actor()
    delay_s = 1.0  # far past the 0.2 s below, so a stalled test thread still sees 0
    counts, reads = counting(loop, actor, delay_s=delay_s)
    reads.loads, reads.seconds = 1, 0.002
    began = time.monotonic()
    counts.report()
    time.sleep(0.2)
    assert actor.calls == 0
    reads.loads, reads.seconds = 2, 0.005  # the next step's hit
    counts.report()
    settled(counts)
    assert time.monotonic() - began >= delay_s
    assert actor.calls == 1
    assert actor.counters.direct_reads == 2
    assert actor.counters.direct_read_seconds == 0.005


def test_a_failed_report_is_made_good_by_the_next(loop):
    actor = Actor(failures=1)
    counts, reads = counting(loop, actor)
    reads.loads = 2
    counts.report()
    settled(counts)
    assert actor.counters.direct_reads == 0
    counts.report()  # the next step: the same totals again
    settled(counts)
    assert actor.counters.direct_reads == 2 and actor.calls == 2


def test_the_engine_thread_never_waits_and_reports_do_not_pile_up(loop):
    actor = Actor()
    actor.gate.clear()  # the actor does not answer
    counts, reads = counting(loop, actor, delay_s=0.2)
    for step in range(1, 6):
        reads.loads = step
        began = time.perf_counter()
        counts.report()
        assert time.perf_counter() - began < 0.1
    deadline = time.monotonic() + 5
    while actor.calls == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    for step in range(6, 9):  # steps while the report waits for the actor
        reads.loads = step
        counts.report()
    time.sleep(0.3)
    assert actor.calls == 1  # one on its way; the later steps sent nothing
    loop.run(_set(actor.gate), 5)
    settled(counts)
    assert actor.counters.direct_reads == 5  # the totals when its delay ended
    counts.report()  # the newest totals go once the first report ended
    settled(counts)
    assert actor.calls == 2 and actor.counters.direct_reads == 8


def test_an_older_total_never_takes_a_counter_back():
    counters = ActorCounters()
    counters.record_direct_reads(5, 2, 0.010)
    counters.record_direct_reads(4, 1, 0.008)  # overtaken by the newer report
    assert (counters.direct_reads, counters.direct_reads_stale) == (5, 2)
    assert counters.direct_read_seconds == 0.010


async def _set(event: asyncio.Event) -> None:
    event.set()
