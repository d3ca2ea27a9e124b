"""A transfer actor's updates to the block tracker: which snapshots it published and
which it dropped, sent in the background, in order, one send at a time.

Replicas stage every engine step (tens of ms), and at fleet scale the tracker's cost
is mostly per call, not per key (benchmark/results/index-scale.md): so a replica
sends at most one call per ``SEND_INTERVAL_S``. Updates wait in a buffer that keeps
each key's net change since the last send (``PendingChanges``): a key staged and
dropped again within one interval never reaches the tracker. The first update after
a quiet interval goes at once; a buffer of ``MAX_BUFFERED_KEYS`` keys, or ``wait``
(``wait_tracker_updates``, tests), sends without waiting out the interval; a closing
actor awaits the tasks ``tell`` returned, so its buffer is sent (at most one interval
later) before it leaves the tracker. No xoscar here: the actor hands over the
tracker's ref and its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ..change_log import Location, pack_keys, pack_locations
from ..hashing import BlockHash
from ..stats import ActorCounters

logger = logging.getLogger(__name__)

# At most one call to the tracker per this interval per replica: 25 calls/s, where
# one per 20 ms engine step was 50. A registration reaches the tracker at most this
# late; a mirror sees it at most one mirror window (tracker.MIRROR_BATCH_S) later.
# Equal to the window: for a given lag bound (their sum) that sends the fewest
# messages; 40 + 40 ms keeps the p99 of both waits near 74 ms, under the 100 ms
# budget with room for the messages and a mirror's apply (benchmark/results/
# index-scale.md; 50 ms left only about 16 ms of it).
SEND_INTERVAL_S = 0.04
# A buffer this large is sent at once: it bounds one call's size and the buffer's
# memory while the tracker is slow (at 1,000 registrations and as many removals a
# second, a 40 ms interval gathers about 80 keys).
MAX_BUFFERED_KEYS = 8192

# (added, dropped) keys of one update, and where device-tier keys now are
Update = tuple[Sequence[BlockHash], Sequence[BlockHash], Sequence[Location]]


class PendingChanges:
    """Keys changed since the last send, each with its net change.

    A key's first update since the last send says what the tracker holds for it:
    staging skips keys the store already holds, so a first add finds the tracker
    without the key, a first drop finds it registered (earlier sends are applied
    before this one, in order). A key whose last update returns it to that state
    cancels out; one that does not is sent as its last update left it.

    Locations (device-tier row and generation, for lease-free reads) travel as
    each key's last one; a drop discards the key's location, so the tracker is
    never told where a key is that the replica no longer holds."""

    def __init__(self) -> None:
        # key -> (the tracker held it before, the replica holds it now)
        self._keys: dict[BlockHash, tuple[bool, bool]] = {}
        self._located: dict[BlockHash, Location] = {}

    def __len__(self) -> int:
        return len(self._keys) + len(self._located)

    def add(
        self,
        keys_added: Sequence[BlockHash],
        keys_dropped: Sequence[BlockHash],
        located: Sequence[Location] = (),
    ) -> None:
        """One update; its drops come first (the store dropped them to make room
        for the additions), its locations last (they describe the store after it)."""
        for held_now, keys in ((False, keys_dropped), (True, keys_added)):
            for key in keys:
                if not held_now:
                    self._located.pop(key, None)
                before = self._keys.get(key)
                tracker_held = (not held_now) if before is None else before[0]
                if tracker_held == held_now:
                    self._keys.pop(key, None)  # back where the tracker has it
                else:
                    self._keys[key] = (tracker_held, held_now)

        for location in located:
            self._located[location[0]] = location

    def take(self) -> tuple[list[BlockHash], list[BlockHash], list[Location]]:
        """(keys to register, keys to unregister, each located key's last
        location), keys in the order first changed; the buffer is empty
        afterwards."""
        pending, self._keys = self._keys, {}
        located, self._located = self._located, {}
        added = [key for key, (_, held) in pending.items() if held]
        dropped = [key for key, (_, held) in pending.items() if not held]
        return added, dropped, list(located.values())


def net_tracker_change(
    updates: Sequence[Update],
) -> tuple[list[BlockHash], list[BlockHash], list[Location]]:
    """Successive (added, dropped, located) updates as one net change: (keys to
    register, keys to unregister, last locations of keys still held); a key that
    ends as the tracker had it is in neither of the first two."""
    pending = PendingChanges()
    for added, dropped, located in updates:
        pending.add(added, dropped, located)
    return pending.take()


class TrackerUpdates:
    """Updates of replica ``rank`` to the tracker (set ``tracker`` before the first
    one is sent). ``deadline`` bounds each call to the tracker."""

    def __init__(
        self,
        rank: int,
        counters: ActorCounters,
        deadline: Callable[[Awaitable[Any]], Awaitable[Any]],
        *,
        interval_s: float = SEND_INTERVAL_S,
        max_buffered_keys: int = MAX_BUFFERED_KEYS,
    ) -> None:
        self.tracker: Any = None
        self._rank = rank
        self._counters = counters
        self._deadline = deadline
        self._interval_s = interval_s
        self._max_buffered_keys = max_buffered_keys
        self._lock = asyncio.Lock()
        self._pending = PendingChanges()  # not sent yet
        self._last_send = -float("inf")  # monotonic start of the last send
        self._send_now = asyncio.Event()  # skip what is left of the interval
        self._sending: set[asyncio.Task[None]] = set()
        self.calls = 0  # calls made to the tracker

    def tell(
        self,
        keys_added: list[BlockHash],
        keys_dropped: list[BlockHash],
        located: Sequence[Location] = (),
    ) -> asyncio.Task[None] | None:
        """Buffer an update; the task that returns once it was sent (None: nothing
        to send). Updates reach the tracker in the order told, so a key dropped
        and staged again ends up registered. ``located``: device-tier rows and
        generations (generation 0: the key left the device tier), for lease-free
        reads."""
        if not keys_added and not keys_dropped and not located:
            return None
        self._pending.add(keys_added, keys_dropped, located)
        if len(self._pending) >= self._max_buffered_keys:
            self._send_now.set()
        task = asyncio.create_task(self._send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        return task

    async def wait(self) -> None:
        """Send what is buffered now, and return once the tracker has been told (or
        failed to be told) of every update told so far."""
        if self._sending:
            self._send_now.set()
            await asyncio.wait(list(self._sending))
        if not len(self._pending):
            self._send_now.clear()  # the next update waits out its interval again

    async def _send(self) -> None:
        # Whoever holds the lock sends everything buffered when its interval is
        # up; the senders that then find the buffer empty have had theirs sent.
        # Each task returns only after the send that carried its update, so
        # ``wait`` keeps its meaning.
        async with self._lock:
            if not len(self._pending):
                return
            rest = self._last_send + self._interval_s - time.monotonic()
            if rest > 0 and not self._send_now.is_set():
                try:
                    await asyncio.wait_for(self._send_now.wait(), rest)
                except TimeoutError:
                    pass
            self._send_now.clear()
            keys_added, keys_dropped, located = self._pending.take()
            if not keys_added and not keys_dropped and not located:
                return  # everything cancelled out meanwhile
            self._last_send = time.monotonic()
            self.calls += 1
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
