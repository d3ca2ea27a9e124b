"""A replica's local copy of the block tracker's index.

vLLM asks the connector about every new request on its scheduler thread; asking the
tracker actor each time costs a round trip even when no peer holds anything of the
prompt, which is most requests in a workload without shared prefixes. The mirror
follows the tracker's changes in the background (``BlockTrackerActor.mirror_changes``,
a long poll) and answers lookups from memory.

It may lag the tracker by one poll: a prefix published a moment ago may look absent
(a miss: the engine computes it), a snapshot dropped a moment ago may look present
(the holder's reservation then grants less, or nothing). Neither loads wrong KV.
Until its first answer arrives, and after a failed poll until the next one succeeds,
the mirror is not ``ready`` and the caller asks the tracker instead.

It also keeps where each holder's device-tier keys are (row and generation, from
``LOCATE`` records, snapshots included), for lease-free reads: a location may be
stale too, which the reader finds out from the generation word it reads back after
the data (``store/generations.py``), never from the data itself; a location a
reader found stale is dropped here (``forget_locations``), so that the next hit on
it takes a lease instead of failing again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence

from .aio import with_deadline
from .change_log import Location, decode, unpack_keys, unpack_locations
from .hashing import BlockHash
from .prefix_index import PrefixIndex
from .wire import IndexChange, PrefixHit, TrackerChanges

logger = logging.getLogger(__name__)

# fetch(since, wait_s): the tracker's mirror_changes for this replica
FetchChanges = Callable[[int, float], Awaitable[TrackerChanges]]


class TrackerMirror:
    """Applied on an asyncio loop (``run``), read from any thread (``query``)."""

    def __init__(
        self,
        fetch: FetchChanges,
        *,
        rpc_timeout_s: float,
        wait_s: float = 10.0,
        retry_s: float = 1.0,
    ) -> None:
        self._fetch = fetch
        self._rpc_timeout_s = rpc_timeout_s
        self._wait_s = wait_s
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._index = PrefixIndex()
        self._addresses: dict[int, str] = {}
        self._version = -1  # -1: nothing applied, the next poll asks for everything
        self._ready = False
        self._stopping = False
        self.polls = 0
        self.failures = 0

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def version(self) -> int:
        return self._version

    def query(self, rank: int, keys: Sequence[BlockHash]) -> PrefixHit | None:
        """The tracker's ``query_prefix`` answer, from the mirror."""
        with self._lock:
            found = self._index.longest_prefix(rank, keys)
            if found is None:
                return None
            holder, depth = found
            address = self._addresses.get(holder)
        if address is None:
            return None  # a holder whose address has not arrived yet
        return PrefixHit(rank=holder, address=address, num_blocks=depth)

    def held_by(self, rank: int, keys: Sequence[BlockHash]) -> set[BlockHash]:
        """Those of ``keys`` the tracker lists for ``rank``, as last mirrored."""
        with self._lock:
            return self._index.held_by(rank, keys)

    def locate(
        self, rank: int, keys: Sequence[BlockHash]
    ) -> list[tuple[int, int]] | None:
        """``(row, generation)`` of each of ``keys`` in ``rank``'s device tier as
        last published, or None unless every key has one."""
        with self._lock:
            return self._index.locations(rank, keys)

    def forget_locations(self, rank: int, locations: Sequence[Location]) -> None:
        """A reader found these locations of ``rank``'s keys stale: drop them,
        unless a newer one arrived meanwhile (the key is still held; its next
        hit reserves, until the holder publishes where it is again)."""
        with self._lock:
            self._index.forget_locations(rank, locations)

    def stop(self) -> None:
        """``run`` returns when its current poll ends (the caller may end it at
        once with the tracker's ``wake_mirrors``): no call is left in flight for
        the tracker to answer into a closed connection."""
        self._stopping = True
        self._ready = False

    async def run(self) -> None:
        """Follow the tracker until stopped or cancelled; failures are retried,
        logged once per outage."""
        while not self._stopping:
            try:
                changes = await with_deadline(
                    self._fetch(self._version, self._wait_s),
                    self._wait_s + self._rpc_timeout_s,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopping:
                    return
                self.failures += 1
                if self._ready or self.failures == 1:
                    logger.warning(
                        "Xavier: the tracker mirror lost the tracker (%s: %s); "
                        "lookups ask the tracker until it is back",
                        type(exc).__name__,
                        exc,
                    )
                self._ready = False
                self._version = -1
                await asyncio.sleep(self._retry_s)
                continue
            if not self._stopping:
                self.apply(changes)

    def apply(self, changes: TrackerChanges) -> None:
        with self._lock:
            if changes.reset:
                self._index.clear()
            for change in changes.changes:
                if change.op == IndexChange.ADD:
                    self._index.add(change.rank, change.keys)
                elif change.op == IndexChange.REMOVE:
                    self._index.remove(change.rank, change.keys)
                elif change.op == IndexChange.FORGET:
                    self._index.forget(change.rank)
            for op, rank, packed in decode(changes.packed):
                if op == IndexChange.ADD:
                    self._index.add(rank, unpack_keys(packed))
                elif op == IndexChange.REMOVE:
                    self._index.remove(rank, unpack_keys(packed))
                elif op == IndexChange.LOCATE:
                    self._index.locate(rank, unpack_locations(packed))
                else:
                    self._index.forget(rank)
            self._addresses = dict(changes.addresses)
            self._version = changes.version
        self.polls += 1
        self._ready = True
