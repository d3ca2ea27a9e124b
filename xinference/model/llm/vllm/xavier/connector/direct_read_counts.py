"""The engine process's lease-free reads, counted where the metrics are.

``DirectReads`` counts its loads in vLLM's engine process (``loads``; ``stale``:
failed because a snapshot changed on the holder; ``seconds``: their own time,
summed), while the metrics are read from the transfer actor's stats. The worker's
totals go to its own transfer actor fire-and-forget, so the engine thread never
waits on it, and ``REPORT_DELAY_S`` after they first moved: the report's Python
runs on the background loop's thread and takes the GIL from the engine's thread,
which in the step that moved the totals is finishing the hit's answer (on CPU a
fast hit's forward and hand-back took 0.5-0.9 ms longer with the report sent from
that step). Every move within the delay goes in the one report, and a report is
sent only when a total moved and no earlier one is still waiting or on its way.
Since it carries totals, not increments, a report that failed is made good by
the next (``ActorCounters.record_direct_reads``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ..aio import BackgroundLoop, with_deadline
from .direct_reads import DirectReads, DirectReadsFactory

logger = logging.getLogger(__name__)

# Metrics are scraped every 10-60 s; a second keeps the report out of the step
# that moved the totals, and makes it one per second at most under load.
REPORT_DELAY_S = 1.0


class DirectReadCounts:
    """Sends the totals of the worker's ``DirectReads`` to its transfer actor."""

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
        self._reads: DirectReads | None = None
        self._acknowledged: tuple[int, int, float] = (0, 0, 0.0)  # what the actor has
        self._sending: concurrent.futures.Future[None] | None = None

    def watch(self, factory: DirectReadsFactory | None) -> DirectReadsFactory | None:
        """``factory``, noting the ``DirectReads`` it makes for the worker."""
        if factory is None:
            return None

        def make(kv_caches: list[torch.Tensor]) -> DirectReads | None:
            self._reads = factory(kv_caches)
            return self._reads

        return make

    def report(self) -> None:
        """Send the totals, ``delay_s`` from now, if they moved since the actor
        last took them."""
        reads = self._reads
        if reads is None or (self._sending is not None and not self._sending.done()):
            return
        if self._totals(reads) == self._acknowledged:
            return
        try:
            self._sending = self._loop.submit(self._send_later(reads))
        except RuntimeError:  # the loop is closed: shutting down
            pass

    @staticmethod
    def _totals(reads: DirectReads) -> tuple[int, int, float]:
        return reads.loads, reads.stale, reads.seconds

    async def _send_later(self, reads: DirectReads) -> None:
        await asyncio.sleep(self._delay_s)
        totals = self._totals(reads)  # with whatever moved meanwhile
        try:
            actor = await self._actor()
            await with_deadline(actor.record_direct_reads(*totals), self._rpc_timeout_s)
        except Exception as exc:  # the next step's report carries the totals
            logger.debug("Xavier: direct read counts not reported: %r", exc)
            return
        self._acknowledged = totals
