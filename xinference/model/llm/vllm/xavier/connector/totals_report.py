"""The worker's totals (lease-free reads, staging), counted where the metrics are.

Two things are counted in vLLM's engine process while the metrics are read from
the transfer actor's stats: ``DirectReads``'s lease-free loads (``loads``;
``stale``: failed because a snapshot changed on the holder; ``seconds``: their
own time, summed) and what became of the blocks the worker was asked to stage
(``write_behind.StagingCounts``). Their totals go to the worker's own transfer
actor from a task of the background loop that looks at them every
``REPORT_DELAY_S``, so no step of the engine does anything for the report: the
engine thread never waits on it, nor wakes the loop for it. Earlier the step
that moved the totals scheduled the report; on CPU that hand-over alone took
0.06 ms of a fast hit's step, and the loop thread's Python that it woke took the
GIL from the engine thread while the hit's answer was handed back.

A report goes once the totals have stood still for one look (so never in the step
right after a hit: at least ``REPORT_DELAY_S`` after the last move), or, under
steady hits, once ``MAX_LOOKS_DEFERRED`` looks have passed since they first moved.
It carries totals, not increments, so a report that failed is made good by the
next (``ActorCounters.record_connector_totals``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..aio import BackgroundLoop, with_deadline
from ..wire import ConnectorTotals

logger = logging.getLogger(__name__)

# Metrics are scraped every 10-60 s: a look a second, a report within a few.
REPORT_DELAY_S = 1.0
# Under hits in every second, the totals never stand still: report anyway.
MAX_LOOKS_DEFERRED = 4
# Once the hits stop, their totals are with the actor within this (two looks).
REPORTED_WITHIN_S = 2 * REPORT_DELAY_S


class TotalsReport:
    """Sends a worker's totals (``ConnectorTotals``) to its transfer actor."""

    def __init__(
        self,
        loop: BackgroundLoop,
        actor: Callable[[], Awaitable[Any]],  # this worker's own transfer actor
        rpc_timeout_s: float,
        delay_s: float = REPORT_DELAY_S,
    ) -> None:
        self._loop = loop
        self._actor = actor
        self._rpc_timeout_s = rpc_timeout_s
        self._delay_s = delay_s
        self._reporting: concurrent.futures.Future[None] | None = None
        self.acknowledged = ConnectorTotals()  # what the actor has

    def start(self, totals: Callable[[], ConnectorTotals]) -> None:
        """Report what ``totals`` returns from now on, until the loop closes
        (once: a second call changes nothing)."""
        if self._reporting is not None:
            return
        try:
            self._reporting = self._loop.submit(self._report(totals))
        except RuntimeError:  # the loop is closed: shutting down
            pass

    async def _report(self, source: Callable[[], ConnectorTotals]) -> None:
        """One look at the totals every ``delay_s``."""
        last_look = self.acknowledged
        looks_deferred = 0
        while True:
            await asyncio.sleep(self._delay_s)
            totals = source()
            if totals == self.acknowledged:
                last_look, looks_deferred = totals, 0
                continue
            moving, last_look = totals != last_look, totals
            looks_deferred += 1
            if moving and looks_deferred < MAX_LOOKS_DEFERRED:
                continue
            try:
                actor = await self._actor()
                await with_deadline(
                    actor.record_connector_totals(totals), self._rpc_timeout_s
                )
            except Exception as exc:  # the next look sends the totals again
                logger.debug("Xavier: worker totals not reported: %r", exc)
                continue
            self.acknowledged, looks_deferred = totals, 0
