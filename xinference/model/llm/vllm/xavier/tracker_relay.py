"""A host's relay to the block tracker: one long poll and one update stream per
host instead of one per replica.

At 64 replicas the tracker's cost is per message (benchmark/results/index-scale.md):
each replica sends one ``update_blocks`` call and its mirror takes one long-poll
answer per 40 ms window. A relay, one per worker host and model, speaks the
tracker's own contract to that host's replicas (their transfer actors and their
schedulers' mirrors are given its address instead of the tracker's) and costs the
tracker about two messages per window for the whole host:

- mirrors: the relay keeps one long poll to the tracker (``relay_changes``, answered
  once per tracker window) and a log of the change records it received, numbered
  with the tracker's versions; a mirror's ``mirror_changes`` is answered from that
  log as soon as new records arrive (no second window). A mirror with no base, or
  further behind than the log reaches, gets a snapshot fetched from the tracker on
  demand and shared by the mirrors that ask meanwhile. Each poll of the relay
  reports what every live mirror of the host has applied (the version it last
  asked from, never what it was sent), so the tracker's ``query_prefix`` bound
  holds: a query never sees a key its mirror has not applied. After an answer the
  relay waits up to ``REPORT_WAIT_S`` for its mirrors to come back before polling
  again, so that report is fresh (the tracker holds the poll for its window anyway).
- updates: ``update_blocks`` calls are forwarded at once when no forward is in
  flight; what arrives meanwhile goes in the next call, one ``update_blocks_batch``
  applied in arrival order. Registrations and forgets travel in the same queue, so
  a replica's calls reach the tracker in the order it made them. Each caller's
  call returns once its own update was applied, or raises what failed it: a
  replica learns of a failed forward as it learns of a failed tracker call.
- the rest (``query_prefix``, ``replicas``...) is forwarded as is.

While the relay cannot reach the tracker its mirrors' polls fail, so they stop
being ``ready`` and their lookups ask (through the relay) the tracker, as they do
when they lose the tracker directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import xoscar as xo

from .aio import with_deadline
from .change_log import ChangeLog, Keys, split_records
from .hashing import BlockHash
from .tracker import CHANGE_LOG_KEYS, MIRROR_GRACE_S
from .wire import PrefixHit, TrackerChanges

logger = logging.getLogger(__name__)

# After a tracker answer, how long the relay waits for its mirrors to ask again
# (a local round trip and an apply) before its next poll reports their versions;
# under the tracker's 40 ms window, which holds that poll anyway.
REPORT_WAIT_S = 0.02
# The relay's own long poll to the tracker waits this long for a change: in a
# quiet spell, a mirror that came back after the relay's poll left is reported
# this late (rank -1 queries see its new keys that much later; one message a
# second per host).
RELAY_WAIT_S = 1.0
RETRY_S = 1.0


def relay_uid(model_uid: str) -> str:
    return f"xavier-tracker-relay-{model_uid}"


class TrackerUnreachable(ConnectionError):
    """The relay has lost the block tracker (its mirrors ask again later)."""


class TrackerRelayActor(xo.StatelessActor):
    """The tracker's methods for one host's replicas (see the module docstring)."""

    def __init__(
        self,
        tracker_address: str,
        tracker_uid: str,
        *,
        rpc_timeout_s: float = 10.0,
        wait_s: float = RELAY_WAIT_S,
        retry_s: float = RETRY_S,
        log_keys: int = CHANGE_LOG_KEYS,
    ) -> None:
        """``log_keys``: the local log's length (as the tracker's; tests)."""
        super().__init__()
        self._log_keys = log_keys
        self._tracker_address = tracker_address
        self._tracker_uid = tracker_uid
        self._rpc_timeout_s = rpc_timeout_s
        self._wait_s = wait_s
        self._retry_s = retry_s
        self._tracker: Any = None
        self._follow_task: asyncio.Task[None] | None = None
        self._stopping = False
        # the tracker's records after version ``_base`` up to ``_version``
        self._log = ChangeLog(log_keys)
        self._base = -1  # -1: nothing received yet
        self._version = -1
        self._addresses: tuple[tuple[int, str], ...] = ()
        self._changed = asyncio.Event()
        self._error: str | None = "not connected yet"  # None: following the tracker
        # rank -> (version its mirror has applied, monotonic time until it is live)
        self._mirrors: dict[int, tuple[int, float]] = {}
        self._mirrors_back: asyncio.Event | None = None
        self._snapshot: TrackerChanges | None = None  # the newest one received
        self._snapshot_fetch: asyncio.Future[TrackerChanges] | None = None
        # (method, args, the caller's future), in arrival order
        self._queue: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]] = []
        self._forwarding: asyncio.Task[None] | None = None
        self._counts = {"polls": 0, "answers": 0, "forwards": 0, "updates": 0}

    @classmethod
    def default_uid(cls) -> str:
        return "xavier-tracker-relay"

    async def __post_create__(self) -> None:
        self._tracker = await with_deadline(
            xo.actor_ref(self._tracker_address, self._tracker_uid),
            self._rpc_timeout_s,
        )
        self._follow_task = asyncio.create_task(self._follow())

    async def __pre_destroy__(self) -> None:
        """Ends the poll at the tracker before leaving (the tracker's
        ``wake_mirrors``), so that no call is left for it to answer into a closed
        connection; cancels it only if that fails."""
        self._stopping = True
        self._error = "the relay is stopping"
        self._wake()
        task = self._follow_task
        if task is None or task.done():
            return
        try:
            await self._call(self._tracker.wake_mirrors())
            await asyncio.wait_for(asyncio.shield(task), self._rpc_timeout_s)
        except Exception as exc:  # the tracker may be gone first
            logger.debug("Xavier: the tracker relay stops its poll: %r", exc)
        task.cancel()

    # ---- the tracker's contract for this host's replicas --------------------------

    async def register_replica(self, rank: int, address: str) -> None:
        await self._enqueue("register_replica", (rank, address))

    async def update_blocks(
        self, rank: int, dropped: Keys, added: Keys, located: bytes = b""
    ) -> None:
        await self._enqueue("update_blocks", (rank, dropped, added, located))

    async def register_blocks(self, rank: int, keys: Keys) -> None:
        await self.update_blocks(rank, b"", keys)

    async def unregister_blocks(self, rank: int, keys: Keys) -> None:
        await self.update_blocks(rank, keys, b"")

    async def forget_replica(self, rank: int) -> None:
        self._mirrors.pop(rank, None)  # no longer reported to the tracker
        await self._enqueue("forget_replica", (rank,))

    async def query_prefix(
        self, rank: int, keys: Sequence[BlockHash]
    ) -> PrefixHit | None:
        return await self._call(self._tracker.query_prefix(rank, keys))

    async def replicas(self) -> dict[int, str]:
        return await self._call(self._tracker.replicas())

    async def num_blocks(self, rank: int) -> int:
        return await self._call(self._tracker.num_blocks(rank))

    async def mirror_versions(self) -> dict[int, int]:
        return await self._call(self._tracker.mirror_versions())

    def wake_mirrors(self) -> None:
        """End every poll waiting here now (a mirror that is stopping)."""
        self._wake()

    async def mirror_changes(
        self, rank: int, since: int, wait_s: float
    ) -> TrackerChanges:
        """The tracker's ``mirror_changes``, answered from the relay's log: at once
        when the relay has records after ``since``, else at the next answer the
        relay receives (or after ``wait_s``, with none)."""
        self._check_connected()
        if not self._reaches(since):
            self._mirrors.pop(rank, None)  # not a live mirror until it has a base
            return await self._shared_snapshot()
        self._mirrors[rank] = (since, time.monotonic() + wait_s + MIRROR_GRACE_S)
        if self._mirrors_back is not None and not self._lagging():
            self._mirrors_back.set()
        if since >= self._version:
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except TimeoutError:
                pass
            self._check_connected()
            if not self._reaches(since):  # reset or trimmed meanwhile
                self._mirrors.pop(rank, None)
                return await self._shared_snapshot()
        self._counts["answers"] += 1
        if since >= self._version:  # a timeout or a wake: nothing new
            return TrackerChanges(since, False, (), self._addresses)
        return TrackerChanges(
            self._version,
            False,
            (),
            self._addresses,
            self._log.since(since, self._version),
        )

    def stats(self) -> dict[str, Any]:
        return {
            **self._counts,
            "version": self._version,
            "connected": self._error is None,
            "mirrors": {rank: version for rank, version in self._live_versions()},
        }

    # ---- following the tracker ----------------------------------------------------

    async def _follow(self) -> None:
        failures = 0
        while not self._stopping:
            versions = dict(self._live_versions())
            try:
                answer = await with_deadline(
                    self._tracker.relay_changes(
                        self.address, versions, self._version, self._wait_s
                    ),
                    self._wait_s + self._rpc_timeout_s,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopping:
                    return
                failures += 1
                if self._error is None or failures == 1:
                    logger.warning(
                        "Xavier: the tracker relay at %s lost the tracker (%r); its "
                        "mirrors ask again every %.0f s",
                        self.address,
                        exc,
                        self._retry_s,
                    )
                self._error = repr(exc)
                self._wake()  # waiting mirrors learn of it now
                await asyncio.sleep(self._retry_s)
                continue
            if self._stopping:
                return
            self._error = None
            self._counts["polls"] += 1
            self._take(answer)
            await self._await_mirrors()

    def _take(self, answer: TrackerChanges) -> None:
        records = [] if answer.reset else split_records(answer.packed)
        # A tracker that came back anew answers the relay's newer version with a
        # snapshot (``reset``), as it answers a mirror.
        if answer.reset or answer.changes:
            self._restart(answer.version)
            if answer.reset:
                self._snapshot = answer
        elif len(records) != answer.version - self._version:
            # one record per version is what lets the relay number them; if that
            # ever fails, start over (mirrors behind fetch a snapshot)
            logger.warning(
                "Xavier: the tracker relay got %d records for versions %d..%d",
                len(records),
                self._version + 1,
                answer.version,
            )
            self._restart(answer.version)
        else:
            for offset, record in enumerate(records, start=self._version + 1):
                self._log.append(offset, record)
        self._version = answer.version
        self._addresses = answer.addresses
        self._wake()

    def _restart(self, version: int) -> None:
        self._log = ChangeLog(self._log_keys)
        self._base = version

    async def _await_mirrors(self) -> None:
        if not self._lagging():
            return
        self._mirrors_back = asyncio.Event()
        try:
            await asyncio.wait_for(self._mirrors_back.wait(), REPORT_WAIT_S)
        except TimeoutError:
            pass
        finally:
            self._mirrors_back = None

    def _lagging(self) -> bool:
        return any(version < self._version for _, version in self._live_versions())

    def _live_versions(self) -> list[tuple[int, int]]:
        now = time.monotonic()
        return [
            (rank, version)
            for rank, (version, live_until) in self._mirrors.items()
            if live_until >= now
        ]

    def _reaches(self, since: int) -> bool:
        """Whether the relay can answer a mirror that has applied up to ``since``:
        from its log, or (a mirror that started from a snapshot newer than the log)
        once the log gets there."""
        if since < 0 or self._base < 0 or since < self._base:
            return False
        if since <= self._version:
            return self._log.reaches(since)
        return self._snapshot is not None and since <= self._snapshot.version

    async def _shared_snapshot(self) -> TrackerChanges:
        snapshot = self._snapshot
        if snapshot is not None and self._reaches(snapshot.version):
            return snapshot
        if self._snapshot_fetch is None:
            self._snapshot_fetch = asyncio.ensure_future(self._fetch_snapshot())
        return await asyncio.shield(self._snapshot_fetch)

    async def _fetch_snapshot(self) -> TrackerChanges:
        try:
            snapshot: TrackerChanges = await self._call(self._tracker.snapshot())
            if self._snapshot is None or snapshot.version >= self._snapshot.version:
                self._snapshot = snapshot
            return snapshot
        finally:
            self._snapshot_fetch = None

    def _check_connected(self) -> None:
        if self._error is not None:
            raise TrackerUnreachable(
                f"the tracker relay at {self.address} has no tracker: {self._error}"
            )

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- forwarding ---------------------------------------------------------------

    async def _call(self, call: Any) -> Any:
        return await with_deadline(call, self._rpc_timeout_s)

    async def _enqueue(self, method: str, args: tuple[Any, ...]) -> None:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((method, args, done))
        if self._forwarding is None or self._forwarding.done():
            self._forwarding = asyncio.create_task(self._forward())
        await done

    async def _forward(self) -> None:
        """Send the queue in order, one call at a time: the run of updates at its
        head as one batch, any other call on its own."""
        while self._queue:
            method = self._queue[0][0]
            count = 1
            if method == "update_blocks":
                while (
                    count < len(self._queue)
                    and self._queue[count][0] == "update_blocks"
                ):
                    count += 1
            sending, self._queue = self._queue[:count], self._queue[count:]
            self._counts["forwards"] += 1
            try:
                if method == "update_blocks":
                    self._counts["updates"] += count
                    errors = await self._call(
                        self._tracker.update_blocks_batch(
                            [args for _, args, _ in sending]
                        )
                    )
                else:
                    await self._call(getattr(self._tracker, method)(*sending[0][1]))
                    errors = [None]
            except Exception as exc:  # every caller of this call learns of it
                errors = [exc] * count
            if len(errors) != count:  # never left unanswered, whatever came back
                errors = [RuntimeError(f"{len(errors)} results for {count}")] * count
            for (_, _, done), error in zip(sending, errors, strict=True):
                if done.done():
                    continue  # the caller gave up waiting
                if error is None:
                    done.set_result(None)
                elif isinstance(error, Exception):
                    done.set_exception(error)
                else:
                    done.set_exception(RuntimeError(f"the block tracker: {error}"))
