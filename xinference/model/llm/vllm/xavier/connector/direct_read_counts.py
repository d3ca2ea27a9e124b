"""The engine process's lease-free reads, counted where the metrics are.

``DirectReads`` counts its loads in vLLM's engine process (``loads``; ``stale``:
failed because a snapshot changed on the holder; ``seconds``: their own time,
summed), while the metrics are read from the transfer actor's stats. After each
step's loads the worker's totals are sent to its own transfer actor,
fire-and-forget, so the engine thread never waits on it: a report is sent only
when a total moved and no earlier one is still on its way, and since it carries
totals, not increments, a report that failed is made good by the next
(``ActorCounters.record_direct_reads``).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ..aio import BackgroundLoop, with_deadline
from .direct_reads import DirectReads, DirectReadsFactory

logger = logging.getLogger(__name__)


class DirectReadCounts:
    """Sends the totals of the worker's ``DirectReads`` to its transfer actor."""

    def __init__(
        self,
        loop: BackgroundLoop,
        actor: Callable[[], Awaitable[Any]],  # this worker's own transfer actor
        rpc_timeout_s: float,
    ) -> None:
        self._loop = loop
        self._actor = actor
        self._rpc_timeout_s = rpc_timeout_s
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
        """Send the totals if they moved since the actor last took them."""
        reads = self._reads
        if reads is None or (self._sending is not None and not self._sending.done()):
            return
        totals = (reads.loads, reads.stale, reads.seconds)
        if totals == self._acknowledged:
            return
        try:
            self._sending = self._loop.submit(self._send(totals))
        except RuntimeError:  # the loop is closed: shutting down
            pass

    async def _send(self, totals: tuple[int, int, float]) -> None:
        try:
            actor = await self._actor()
            await with_deadline(actor.record_direct_reads(*totals), self._rpc_timeout_s)
        except Exception as exc:  # the next step's report carries the totals
            logger.debug("Xavier: direct read counts not reported: %r", exc)
            return
        self._acknowledged = totals
