"""A transfer actor's updates to the block tracker: which snapshots it published and
which it dropped, sent in the background, in order, one send at a time.

Replicas stage every engine step. While one update travels, the next ones gather,
and the sender takes them all as one net change (``net_tracker_change``): each key
ends up as its last update left it. No xoscar here: the actor hands over the
tracker's ref and its deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..change_log import Location, pack_keys, pack_locations
from ..hashing import BlockHash
from ..stats import ActorCounters

logger = logging.getLogger(__name__)

# (added, dropped) keys of one update, and where device-tier keys now are
Update = tuple[Sequence[BlockHash], Sequence[BlockHash], Sequence[Location]]


class TrackerUpdates:
    """Updates of replica ``rank`` to the tracker (set ``tracker`` before the first
    one is sent). ``deadline`` bounds each call to the tracker."""

    def __init__(
        self,
        rank: int,
        counters: ActorCounters,
        deadline: Callable[[Awaitable[Any]], Awaitable[Any]],
    ) -> None:
        self.tracker: Any = None
        self._rank = rank
        self._counters = counters
        self._deadline = deadline
        self._lock = asyncio.Lock()
        self._queue: list[Update] = []  # not sent yet, oldest first
        self._sending: set[asyncio.Task[None]] = set()

    def tell(
        self,
        keys_added: list[BlockHash],
        keys_dropped: list[BlockHash],
        located: Sequence[Location] = (),
    ) -> asyncio.Task[None] | None:
        """Queue an update; the task that sends it (None: nothing to send).
        Updates reach the tracker in the order queued, so a key dropped and staged
        again ends up registered. ``located``: device-tier rows and generations
        (generation 0: the key left the device tier), for lease-free reads."""
        if not keys_added and not keys_dropped and not located:
            return None
        self._queue.append((keys_added, keys_dropped, located))
        task = asyncio.create_task(self._send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        return task

    async def wait(self) -> None:
        """Return once the tracker has been told (or failed to be told) of every
        update queued so far."""
        if self._sending:
            await asyncio.wait(list(self._sending))

    async def _send(self) -> None:
        # Whoever holds the lock sends every update queued so far; the senders that
        # find the queue empty have had theirs sent. Each task returns only after
        # the send that carried its update, so ``wait`` keeps its meaning.
        async with self._lock:
            if not self._queue:
                return
            keys_added, keys_dropped = net_tracker_change(self._queue)
            located = net_locations(self._queue)
            self._queue.clear()
            try:
                # One call, packed keys: the tracker's cost is mostly per call,
                # and it logs the bytes as they arrive.
                await self._deadline(
                    self.tracker.update_blocks(
                        self._rank,
                        pack_keys(keys_dropped),
                        pack_keys(keys_added),
                        pack_locations(located),
                    )
                )
            except Exception as exc:  # logged and counted; see below
                # Not fatal: a key the tracker missed is a miss for peers; a stale
                # entry makes a peer's reservation here come back short, which it
                # treats as a miss too.
                self._counters.tracker_failures += 1
                logger.warning(
                    "rank %d could not tell the tracker of %d new and %d dropped "
                    "snapshots: %r",
                    self._rank,
                    len(keys_added),
                    len(keys_dropped),
                    exc,
                )


def net_tracker_change(
    updates: Sequence[Update],
) -> tuple[list[BlockHash], list[BlockHash]]:
    """Successive (added, dropped) updates as one: (keys whose last update added
    them, keys whose last update dropped them). Within one update the drops come
    first (the store dropped them to make room for the additions)."""
    last: dict[BlockHash, bool] = {}  # key -> added by its last update
    for added, dropped, _ in updates:
        for key in dropped:
            last.pop(key, None)
            last[key] = False
        for key in added:
            last.pop(key, None)
            last[key] = True
    return (
        [key for key, was_added in last.items() if was_added],
        [key for key, was_added in last.items() if not was_added],
    )


def net_locations(updates: Sequence[Update]) -> list[Location]:
    """Each located key's last location over ``updates``."""
    last: dict[BlockHash, Location] = {}
    for _, _, located in updates:
        for location in located:
            last[location[0]] = location
    return list(last.values())
