"""The worker's write path: computed blocks go to the staging ring and on to the
transfer actor, and the engine's thread never waits for either.

``wait_for_save`` runs on the engine's thread between one forward and the next.
Whatever it waits for, every request of the replica waits for too: on an H100
serving an 8B model under concurrent long prompts, waiting there for the ring
to empty cost the engine about a tenth of its time and made cold prefills 2.3-
2.8x slower (issue 44). So here staging is best effort:

- the blocks are copied into free ring slots, queued on the engine's stream
  (``staging_ring.py`` says why there); blocks for which no slot is free are not
  staged at all, and counted (``StagingCounts``): a block not published costs a
  peer a recomputation later, never the engine time now;
- a staging is handed to the actor once its copies have completed on the device,
  checked without blocking at each step;
- its slots come back once the actor has answered, also checked without
  blocking. A staging whose answer did not come within its deadline may still
  be read by the actor: its slots are retired, never reused.

Nothing here waits, except ``drain`` (for shutdown and tests).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..aio import BackgroundLoop, with_deadline
from ..engine import device
from ..wire import StageItem
from .staging_ring import RingStaging, StagingRing

logger = logging.getLogger(__name__)

# A skipped block is logged at most this often (it is counted every time).
SKIP_LOG_EVERY_S = 60.0


@dataclass(slots=True)
class StagingCounts:
    """Totals of the blocks the scheduler half asked this worker to stage, by what
    became of them (reported as ``wire.ConnectorTotals``)."""

    copied: int = 0  # into the ring, and handed to the actor
    skipped_ring_full: int = 0  # no free ring slot at the step (actor behind)
    skipped_no_ring: int = 0  # no ring at all (disabled, or its allocation failed)
    skipped_unmapped: int = 0  # the engine caches were not mapped yet
    ring_slots_retired: int = 0  # an answer never came: the actor may still read them
    stagings_failed: int = 0  # handed over, and the actor reported a failure


class WriteBehind:
    """Per worker: the stagings in the ring, oldest first, until the actor answered.

    Used from the engine's thread only; the loop only runs the calls to the actor.
    """

    def __init__(
        self,
        ring: StagingRing | None,
        loop: BackgroundLoop,
        rpc_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ring = ring
        self._loop = loop
        self._rpc_timeout_s = rpc_timeout_s
        self._clock = clock
        self._stagings: collections.deque[RingStaging] = collections.deque()
        self.counts = StagingCounts()
        self._last_skip_log = float("-inf")

    @property
    def ring(self) -> StagingRing | None:
        return self._ring

    def stage(self, items: Sequence[StageItem], actor: Any) -> None:
        """Copy as many of ``items`` as there are free ring slots and send them on
        when their copies complete; skip the rest. ``actor`` None: the caches are
        not mapped yet, so nothing can be staged. Never waits."""
        if not items:
            return
        if actor is None:
            self.counts.skipped_unmapped += len(items)
            return
        ring = self._ring
        if ring is None:
            self.counts.skipped_no_ring += len(items)
            self._log_skip(len(items), "this worker has no staging ring")
            return
        self.settle(actor)
        taken = items[: ring.free_slots]
        if taken:
            slots = ring.copy_in([item.block_id for item in taken])
            copied = device.DeviceWorkMark(ring.rows.device)
            copied.mark()
            self._stagings.append(
                RingStaging(slots, [item.key for item in taken], copied)
            )
            self.counts.copied += len(taken)
            self._hand_over(actor)
        skipped = len(items) - len(taken)
        if skipped:
            self.counts.skipped_ring_full += skipped
            self._log_skip(skipped, "the staging ring is full (the actor is behind)")

    def settle(self, actor: Any) -> None:
        """Hand over the stagings whose copies completed, and take back the slots
        of those the actor answered. Never waits."""
        if self._stagings:
            self._hand_over(actor)
            self._take_back(wait=False)

    def drain(self, actor: Any) -> None:
        """Wait until the actor has answered every staging so far (shutdown and
        tests): the copies first, then the answers, each within its deadline."""
        while self._stagings:
            self._hand_over(actor, wait_for_copies=True)
            self._take_back(wait=True)

    # ---- internals ----------------------------------------------------------------

    def _hand_over(self, actor: Any, wait_for_copies: bool = False) -> None:
        """Send the actor, oldest first, the stagings whose copies into the ring
        have completed (it reads the ring from another process)."""
        for staging in self._stagings:
            if staging.future is not None:
                continue
            if not staging.copied.done():
                if not wait_for_copies:
                    return
                staging.copied.wait()
            staging.future = self._loop.submit(
                with_deadline(
                    actor.stage_ring(staging.keys, staging.slots), self._rpc_timeout_s
                )
            )

    def _take_back(self, wait: bool) -> None:
        """Give back the slots of answered stagings; with ``wait``, of the oldest
        one at least, waiting for its answer (its deadline runs on the loop)."""
        ring = self._ring
        assert ring is not None
        kept: collections.deque[RingStaging] = collections.deque()
        for index, staging in enumerate(self._stagings):
            future = staging.future
            if future is None or not (future.done() or (wait and index == 0)):
                kept.append(staging)
                continue
            try:
                # The deadline is enforced on the loop; the extra second only
                # guards against a loop that is itself stuck.
                future.result(self._rpc_timeout_s + 1.0)
            except (TimeoutError, concurrent.futures.TimeoutError) as exc:
                ring.retire(staging.slots)
                self.counts.ring_slots_retired += len(staging.slots)
                logger.error(
                    "Xavier: staging %d blocks timed out (%r); retiring their ring "
                    "slots (%d retired)",
                    len(staging.slots),
                    exc,
                    ring.retired,
                )
                continue
            except Exception as exc:  # costs future hits only
                self.counts.stagings_failed += 1
                logger.error("Xavier: staging failed: %r", exc)
            ring.give_back(staging.slots)
        self._stagings = kept

    def _log_skip(self, blocks: int, why: str) -> None:
        now = self._clock()
        if now - self._last_skip_log < SKIP_LOG_EVERY_S:
            return
        self._last_skip_log = now
        counts = self.counts
        logger.warning(
            "Xavier: %d blocks not staged: %s (skipped so far: %d for a full ring, "
            "%d without a ring); peers will recompute them",
            blocks,
            why,
            counts.skipped_ring_full,
            counts.skipped_no_ring,
        )
