"""A worker's totals (lease-free reads, staging) reach the transfer actor's
counters (``connector/totals_report.py``) from a task of the background loop:
once they stood still for a look, or after a few looks under steady moves, and a
report that failed is made good by the next one. The real reads that move these
totals are in ``test_direct_reads.py``, real stagings in ``test_worker.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector.totals_report import (
    MAX_LOOKS_DEFERRED,
    TotalsReport,
)
from xinference.model.llm.vllm.xavier.stats import ActorCounters
from xinference.model.llm.vllm.xavier.wire import ConnectorTotals


class Actor:
    """Counts what reaches it; ``failures`` reports fail first, ``gate`` holds
    every report until set."""

    def __init__(self, failures: int = 0) -> None:
        self.counters = ActorCounters()
        self.calls = 0
        self.called_at: list[float] = []  # monotonic time of each call
        self.failures = failures
        self.gate = asyncio.Event()
        self.gate.set()

    async def record_connector_totals(self, totals: ConnectorTotals) -> None:
        self.calls += 1
        self.called_at.append(time.monotonic())
        await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the actor is away")
        self.counters.record_connector_totals(totals)


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-direct-read-counts")
    yield background
    background.close()


def counting(
    loop: BackgroundLoop, actor: Actor, delay_s: float = 0.02
) -> tuple[TotalsReport, Any]:
    """A report of totals the test moves: ``reads.loads`` and so on are the
    direct reads, ``reads.staged`` and ``reads.skipped`` the staging counts."""

    async def own_actor() -> Actor:
        return actor

    report = TotalsReport(loop, own_actor, rpc_timeout_s=5.0, delay_s=delay_s)
    reads = types.SimpleNamespace(loads=0, stale=0, seconds=0.0, staged=0, skipped=0)
    report.start(
        lambda: ConnectorTotals(
            direct_reads=reads.loads,
            direct_reads_stale=reads.stale,
            direct_read_seconds=reads.seconds,
            staged_blocks=reads.staged,
            stage_skipped_ring_full=reads.skipped,
        )
    )
    return report, reads


def wait_for(condition: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_totals_are_sent_once_each_time_they_move(loop):
    actor = Actor()
    counts, reads = counting(loop, actor)
    time.sleep(0.2)  # ten looks
    assert actor.calls == 0  # nothing read yet: nothing to send
    reads.loads, reads.stale, reads.seconds = 3, 1, 0.004
    wait_for(lambda: actor.calls == 1, "the moved totals were never sent")
    time.sleep(0.2)  # ten more looks at unchanged totals
    assert actor.calls == 1
    counters = actor.counters
    assert (counters.direct_reads, counters.direct_reads_stale) == (3, 1)
    assert counters.direct_read_seconds == 0.004
    assert counts.acknowledged == ConnectorTotals(3, 1, 0.004)
    reads.loads = 4
    wait_for(lambda: actor.calls == 2, "the next move was never sent")
    assert counters.direct_reads == 4


def test_staging_counts_are_reported_like_the_reads(loop):
    actor = Actor()
    counts, reads = counting(loop, actor)
    reads.staged, reads.skipped = 30, 7
    wait_for(lambda: actor.calls == 1, "the staging counts were never sent")
    counters = actor.counters
    assert (counters.worker_staged_blocks, counters.stage_skipped_ring_full) == (30, 7)
    assert counters.direct_reads == 0


def test_a_report_waits_until_the_totals_stood_still_for_a_look(loop):
    """Never sent in the steps right after a hit (its answer is still being
    handed back): the totals of hits within one look go in one report, a look
    after the last of them."""
    actor = Actor()
    delay_s = 0.5  # a test thread would have to stall this long between moves
    counts, reads = counting(loop, actor, delay_s=delay_s)
    for hit in range(1, 21):  # a hit every 50 ms for a second: two looks
        reads.loads, reads.seconds = hit, hit * 0.001
        last_move = time.monotonic()
        time.sleep(0.05)
    assert actor.calls == 0
    wait_for(lambda: actor.calls == 1, "no report after the hits stopped")
    assert actor.called_at[0] - last_move >= delay_s
    assert actor.counters.direct_reads == 20
    assert actor.counters.direct_read_seconds == 0.02


def test_under_steady_hits_a_report_goes_all_the_same(loop):
    """Totals that move at every look are still sent, after a few looks."""
    actor = Actor()
    delay_s = 0.02
    counts, reads = counting(loop, actor, delay_s=delay_s)
    began = time.monotonic()
    while actor.calls == 0:
        assert time.monotonic() - began < 5, "moving totals were never reported"
        reads.loads += 1  # a hit every 2 ms, ten per look
        time.sleep(0.002)
    # the first look after the first hit defers it, and so do the next ones
    # until the last allowed: the report goes at the cap's look, not before
    assert actor.called_at[0] - began >= (MAX_LOOKS_DEFERRED - 1) * delay_s
    wait_for(lambda: actor.counters.direct_reads > 0, "the report never landed")


def test_a_failed_report_is_made_good_by_the_next(loop):
    actor = Actor(failures=1)
    counts, reads = counting(loop, actor)
    reads.loads = 2
    wait_for(lambda: actor.calls == 2, "a failed report was not sent again")
    wait_for(lambda: actor.counters.direct_reads == 2, "the second report failed")
    assert counts.acknowledged == ConnectorTotals(direct_reads=2)


def test_reports_do_not_pile_up_while_the_actor_is_slow(loop):
    actor = Actor()
    actor.gate.clear()  # the actor does not answer
    counts, reads = counting(loop, actor, delay_s=0.02)
    reads.loads = 5
    wait_for(lambda: actor.calls == 1, "the totals were never sent")
    for step in range(6, 9):  # hits while the report waits for the actor
        reads.loads = step
        time.sleep(0.05)
    assert actor.calls == 1  # one on its way; nothing more was sent
    loop.run(_set(actor.gate), 5)
    wait_for(lambda: actor.counters.direct_reads == 8, "the newest totals never went")
    assert actor.calls == 2  # the totals when it was sent, then the newest


def test_an_older_total_never_takes_a_counter_back():
    counters = ActorCounters()
    newer = ConnectorTotals(5, 2, 0.010, staged_blocks=9, stage_skipped_ring_full=3)
    counters.record_connector_totals(newer)
    # overtaken by the newer report
    counters.record_connector_totals(
        dataclasses.replace(newer, direct_reads=4, staged_blocks=8)
    )
    assert (counters.direct_reads, counters.direct_reads_stale) == (5, 2)
    assert counters.direct_read_seconds == 0.010
    assert (counters.worker_staged_blocks, counters.stage_skipped_ring_full) == (9, 3)


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_every_reported_total_reaches_a_counter():
    """A field added to ConnectorTotals and not to the counters would be sent
    and dropped: each one lands in the counter it names."""
    totals = ConnectorTotals(
        **{
            field.name: index + 1
            for index, field in enumerate(dataclasses.fields(ConnectorTotals))
        }
    )
    counters = ActorCounters()
    counters.record_connector_totals(totals)
    got = sorted(
        getattr(counters, name)
        for name in (f.name for f in dataclasses.fields(ActorCounters))
    )
    wanted = list(range(1, len(dataclasses.fields(ConnectorTotals)) + 1))
    assert [value for value in got if value] == wanted
