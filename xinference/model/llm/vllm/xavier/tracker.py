"""The block tracker: which replica holds which published snapshot.

One actor per model, in the supervisor's pool. Replicas register snapshots when they
publish them and unregister them in batches when the store drops them; a loader asks
for the longest contiguous prefix of its prompt's keys that one *other* replica holds.

Each replica's scheduler keeps a mirror of the index (``tracker_mirror.py``), fed by
``mirror_changes`` (a long poll over a bounded change log), so that looking up a
prompt costs no round trip. ``query_prefix`` for a rank whose mirror is live answers
what that mirror has applied; for rank -1 (the router, the REST API) what every live
mirror has applied: "replica r will find this prefix" then holds when it is said.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import xoscar as xo

from .change_log import (
    ChangeLog,
    Keys,
    encode,
    encode_snapshot,
    pack_keys,
    unpack_keys,
    unpack_locations,
)
from .hashing import BlockHash
from .prefix_index import PrefixIndex
from .wire import IndexChange, PrefixHit, TrackerChanges

logger = logging.getLogger(__name__)

# The change log keeps at least this many keys' worth of changes; a mirror further
# behind gets the whole index instead.
CHANGE_LOG_KEYS = 200_000
# A mirror that has not polled again this long after its last wait ended no longer
# holds back what rank -1 queries see.
MIRROR_GRACE_S = 5.0
# A mirror gets at most one answer per this window (see ``mirror_changes``): at 64
# replicas the tracker's cost is mostly per message, and 25 answers a second per
# mirror is 1,600 a second. A change reaches a mirror within about the replica's
# send interval (tracker_updates.SEND_INTERVAL_S, 40 ms) plus this window plus a
# round trip: under the 100 ms budget of benchmark/results/index-scale.md.
MIRROR_BATCH_S = 0.04


def tracker_uid(model_uid: str) -> str:
    return f"xavier-block-tracker-{model_uid}"


class BlockTrackerActor(xo.StatelessActor):
    """Index of published snapshots. Every method but ``mirror_changes`` is
    synchronous, hence atomic; every change to the index bumps ``version``."""

    def __init__(self, mirror_window_s: float | None = None) -> None:
        """``mirror_window_s``: ``MIRROR_BATCH_S`` unless given (benchmarks)."""
        super().__init__()
        self._window_s = MIRROR_BATCH_S if mirror_window_s is None else mirror_window_s
        self._index = PrefixIndex()
        # rank -> transfer actor pool address
        self._addresses: dict[int, str] = {}
        self._version = 0
        self._log = ChangeLog(CHANGE_LOG_KEYS)
        self._changed = asyncio.Event()
        # rank -> (version its mirror has applied, monotonic time until which the
        # mirror counts as live: the end of its current poll plus a grace)
        self._mirrors: dict[int, tuple[int, float]] = {}
        # rank -> monotonic time of its mirror's last answer
        self._answered: dict[int, float] = {}
        # (version, the whole index as change records) of the last snapshot sent
        self._snapshot_of: tuple[int, bytes] = (-1, b"")
        # relay id -> monotonic time of its last answer (``relay_changes``)
        self._relays_answered: dict[str, float] = {}

    @classmethod
    def default_uid(cls) -> str:
        return "xavier-block-tracker"

    def register_replica(self, rank: int, address: str) -> None:
        """Add a replica; a rank registering again replaces its old entry.

        A replica that restarted lost its snapshots, so whatever the old incarnation
        registered must not be served on its behalf.
        """
        if rank in self._addresses:
            logger.info(
                "replica %d re-registered at %s; dropping its old blocks", rank, address
            )
            self._change(IndexChange.FORGET, rank)
        self._addresses[rank] = address
        self._index.add(rank, ())

    def register_blocks(self, rank: int, keys: Keys) -> None:
        """``keys``: block keys, or those keys packed (``change_log.pack_keys``,
        what transfer actors send: logged as received, never re-encoded)."""
        if rank not in self._addresses:
            raise KeyError(f"replica {rank} is not registered with the block tracker")
        self._change(IndexChange.ADD, rank, pack_keys(keys))

    def unregister_blocks(self, rank: int, keys: Keys) -> None:
        if rank not in self._addresses:
            return  # the replica was forgotten meanwhile: nothing left to remove
        self._change(IndexChange.REMOVE, rank, pack_keys(keys))

    def update_blocks(
        self, rank: int, dropped: Keys, added: Keys, located: bytes = b""
    ) -> None:
        """A replica's net update in one call, drops first (what ``TrackerUpdates``
        sends): at fleet scale the tracker's cost is mostly per call, not per key.
        ``located`` (``change_log.pack_locations``): where its device-tier keys
        are, passed on to the mirrors as received, for lease-free reads, and
        kept with the keys (each key's latest; a drop of the key or of the
        replica forgets it), so that snapshots carry them too."""
        if len(dropped):
            self.unregister_blocks(rank, dropped)
        if len(added):
            self.register_blocks(rank, added)
        if located and rank in self._addresses:
            self._change(IndexChange.LOCATE, rank, located)

    def query_prefix(self, rank: int, keys: Sequence[BlockHash]) -> PrefixHit | None:
        """Longest contiguous run of leading ``keys`` held by one replica != ``rank``,
        as the mirrors see it (see the module docstring)."""
        found = self._index.longest_prefix(rank, keys, self._visible_upto(rank))
        if found is None:
            return None
        holder, depth = found
        return PrefixHit(rank=holder, address=self._addresses[holder], num_blocks=depth)

    def forget_replica(self, rank: int) -> None:
        """A replica went away: drop it and everything it held."""
        if rank in self._addresses:
            self._change(IndexChange.FORGET, rank)
        self._addresses.pop(rank, None)
        self._mirrors.pop(rank, None)
        self._answered.pop(rank, None)

    def replicas(self) -> dict[int, str]:
        return dict(self._addresses)

    def num_blocks(self, rank: int) -> int:
        return self._index.num_blocks(rank)

    # ---- mirrors ------------------------------------------------------------------

    async def mirror_changes(
        self, rank: int, since: int, wait_s: float
    ) -> TrackerChanges:
        """What replica ``rank``'s mirror, which has applied every change up to
        ``since`` (-1: nothing yet), must apply next; waits up to ``wait_s`` for a
        change when there is none. Also records how far that mirror is.

        A mirror gets at most one answer per window (``MIRROR_BATCH_S``): a poll
        answers once the window since that mirror's last answer is over, and only
        then, so that under steady traffic each mirror costs the tracker one
        answer per window, not one per round trip or per change, and a change
        waits at most one window here. A mirror that waited through a quiet spell
        longer than the window is answered at the first change."""
        if since < 0 or since > self._version:
            self._mirrors.pop(rank, None)  # not a live mirror until it has a base
            self._note_answer(rank)
            return self._snapshot()
        self._mirrors[rank] = (since, time.monotonic() + wait_s + MIRROR_GRACE_S)
        await self._wait_window(since, wait_s, self._answered.get(rank, 0.0))
        self._note_answer(rank)
        return self._changes_since(since)

    async def _wait_window(self, since: int, wait_s: float, answered: float) -> None:
        """Until a change after ``since`` (or ``wait_s``), then until the window
        since the poller's last answer (monotonic ``answered``) is over."""
        if since == self._version:
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except TimeoutError:
                pass
        if self._version > since:  # not a timeout, nor ``wake_mirrors``
            # Replicas send every few tens of ms: the changes that follow this one
            # closely travel in the same answer.
            rest = answered + self._window_s - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)

    def _changes_since(self, since: int) -> TrackerChanges:
        if not self._log.reaches(since):
            return self._snapshot()  # the log no longer reaches back that far
        return TrackerChanges(
            self._version,
            False,
            (),
            self._address_list(),
            self._log.since(since, self._version),
        )

    # ---- per-host relays (tracker_relay.py) ---------------------------------------

    async def relay_changes(
        self, relay: str, versions: dict[int, int], since: int, wait_s: float
    ) -> TrackerChanges:
        """``mirror_changes`` for a host's relay, which serves that host's mirrors:
        one long poll (one answer per window) instead of one per mirror.
        ``versions``: rank -> the version its mirror has applied (what it last
        asked the relay from), recorded as a direct poll of that mirror would
        record it, so that ``query_prefix`` keeps its bound. Ranks forgotten
        meanwhile are left out: nothing of theirs may linger here."""
        live_until = time.monotonic() + wait_s + MIRROR_GRACE_S
        for rank, version in versions.items():
            if rank in self._addresses and 0 <= version <= self._version:
                self._mirrors[rank] = (version, live_until)
        if since < 0 or since > self._version:
            self._relays_answered[relay] = time.monotonic()
            return self._snapshot()
        await self._wait_window(since, wait_s, self._relays_answered.get(relay, 0.0))
        self._relays_answered[relay] = time.monotonic()
        return self._changes_since(since)

    def snapshot(self) -> TrackerChanges:
        """The whole index now (a relay's mirror that has no usable base)."""
        return self._snapshot()

    def update_blocks_batch(
        self, updates: Sequence[tuple[int, Keys, Keys, bytes]]
    ) -> list[str | None]:
        """Several replicas' ``update_blocks`` in one call (a relay's batch), each
        applied exactly as ``update_blocks`` applies it, in the order given. Per
        update: None, or why it failed (one replica's error fails only its own)."""
        errors: list[str | None] = []
        for rank, dropped, added, located in updates:
            try:
                self.update_blocks(rank, dropped, added, located)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            else:
                errors.append(None)
        return errors

    def wake_mirrors(self) -> None:
        """End every waiting poll now (with no change): a mirror that is stopping
        then leaves without a call in flight."""
        self._changed.set()
        self._changed = asyncio.Event()

    def mirror_versions(self) -> dict[int, int]:
        """rank -> the version its live mirror has applied; and -1 -> the tracker's."""
        versions = {rank: version for rank, (version, _) in self._live_mirrors()}
        versions[-1] = self._version
        return versions

    def _note_answer(self, rank: int) -> None:
        if rank in self._addresses:  # forgotten ranks leave no entry behind
            self._answered[rank] = time.monotonic()

    def _snapshot(self) -> TrackerChanges:
        """The whole index, locations included, encoded once per version:
        mirrors starting together (a deployment coming up) share it."""
        if self._snapshot_of[0] != self._version:
            blocks = self._index.blocks_by_rank().items()
            located = self._index.located_by_rank().items()
            self._snapshot_of = (self._version, encode_snapshot(blocks, located))
        return TrackerChanges(
            self._version, True, (), self._address_list(), self._snapshot_of[1]
        )

    def _address_list(self) -> tuple[tuple[int, str], ...]:
        return tuple(self._addresses.items())

    def _live_mirrors(self) -> list[tuple[int, tuple[int, float]]]:
        now = time.monotonic()
        return [item for item in self._mirrors.items() if item[1][1] >= now]

    def _visible_upto(self, rank: int) -> int | None:
        """The version a query on behalf of ``rank`` may see (None: all): what the
        live mirror of ``rank`` has applied; for rank -1 the slowest live mirror's.
        A mirror that stopped polling holds nothing back: its replica asks the
        tracker meanwhile and must see every change, not the mirror's last."""
        live = dict(self._live_mirrors())
        if rank >= 0:
            mirror = live.get(rank)
            return None if mirror is None else mirror[0]
        return min((version for version, _ in live.values()), default=None)

    def _change(self, op: str, rank: int, packed_keys: bytes = b"") -> None:
        self._version += 1
        if op == IndexChange.ADD:
            self._index.add(rank, unpack_keys(packed_keys), self._version)
        elif op == IndexChange.REMOVE:
            self._index.remove(rank, unpack_keys(packed_keys))
        elif op == IndexChange.LOCATE:
            self._index.locate(rank, unpack_locations(packed_keys))
        elif op == IndexChange.FORGET:
            self._index.forget(rank)
        self._log.append(self._version, encode(op, rank, packed_keys))
        self.wake_mirrors()
