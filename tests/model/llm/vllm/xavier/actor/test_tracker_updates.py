"""A replica's updates to the tracker: one call per send interval at most, the net
change of the interval (a key staged and dropped within it never travels), the
buffer's bound, and a replica forgotten while its changes wait stays forgotten."""

from __future__ import annotations

import asyncio
import time

from xinference.model.llm.vllm.xavier.actor.tracker_updates import (
    PendingChanges,
    TrackerUpdates,
)
from xinference.model.llm.vllm.xavier.change_log import unpack_keys, unpack_locations
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.stats import ActorCounters
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror
from xinference.model.llm.vllm.xavier.wire import PrefixHit

KEYS = hash_full_blocks(list(range(16 * 12)), 16, "tracker-updates-test")
INTERVAL_S = 0.3


class RecordingTracker:
    """The tracker's ref: records each call (when, dropped, added; the locations
    apart) and applies it to a real tracker, when given one."""

    def __init__(self, tracker: BlockTrackerActor | None = None) -> None:
        self.tracker = tracker
        self.calls: list[tuple[float, list[bytes], list[bytes]]] = []
        self.located: list[list[tuple[bytes, int, int]]] = []

    async def update_blocks(
        self, rank: int, dropped: bytes, added: bytes, located: bytes = b""
    ) -> None:
        self.calls.append((time.monotonic(), unpack_keys(dropped), unpack_keys(added)))
        self.located.append(unpack_locations(located))
        if self.tracker is not None:
            self.tracker.update_blocks(rank, dropped, added, located)


async def no_deadline(call):
    return await call


def updates_to(
    tracker: RecordingTracker, interval_s: float = INTERVAL_S, **kw
) -> tuple[TrackerUpdates, ActorCounters]:
    counters = ActorCounters()
    updates = TrackerUpdates(1, counters, no_deadline, interval_s=interval_s, **kw)
    updates.tracker = tracker
    return updates, counters


async def test_changes_reach_the_tracker_within_the_interval_in_one_call():
    tracker = RecordingTracker()
    updates, _ = updates_to(tracker)
    started = time.monotonic()
    await updates.tell(KEYS[:1], [])  # after a quiet spell: at once
    assert tracker.calls[0][0] - started < INTERVAL_S / 2
    tasks = [updates.tell([key], []) for key in KEYS[1:6]]  # one engine step each
    await asyncio.wait_for(asyncio.gather(*tasks), INTERVAL_S * 3)
    assert len(tracker.calls) == 2  # five updates, one call
    waited = tracker.calls[1][0] - tracker.calls[0][0]
    assert INTERVAL_S * 0.8 <= waited < INTERVAL_S * 2
    assert tracker.calls[1][1:] == ([], KEYS[1:6])
    assert updates.calls == 2


async def test_a_key_staged_and_dropped_within_one_interval_never_travels():
    tracker = RecordingTracker()
    updates, _ = updates_to(tracker)
    await updates.tell(KEYS[:2], [])  # registered: the tracker has KEYS[0:2]
    # within the next interval: KEYS[2] staged then dropped, KEYS[0] dropped then
    # staged again, KEYS[1] dropped for good, KEYS[3] staged
    told = [
        updates.tell([KEYS[2]], []),
        updates.tell([], [KEYS[2], KEYS[0]]),
        updates.tell([KEYS[0], KEYS[3]], [KEYS[1]]),
    ]
    await asyncio.gather(*told)
    assert [call[1:] for call in tracker.calls] == [
        ([], KEYS[:2]),
        ([KEYS[1]], [KEYS[3]]),
    ]
    # an interval whose changes all cancel out costs no call at all
    await asyncio.gather(updates.tell([KEYS[4]], []), updates.tell([], [KEYS[4]]))
    assert len(tracker.calls) == 2


def test_pending_changes_keep_each_keys_net_change():
    a, b, c, d = KEYS[:4]
    pending = PendingChanges()
    pending.add([a, b], [])
    pending.add([c], [a])  # a dropped to make room for c: a cancels out
    pending.add([a], [b])  # a staged again, b dropped: b cancels out
    pending.add([], [d])  # d was registered by an earlier send
    assert len(pending) == 3
    assert pending.take() == ([c, a], [d], [])
    assert len(pending) == 0 and pending.take() == ([], [], [])
    pending.add([a], [a])  # dropped and staged again in one update: as it was
    assert pending.take() == ([], [], [])


async def test_a_full_buffer_is_sent_without_waiting_out_the_interval():
    tracker = RecordingTracker()
    updates, _ = updates_to(tracker, interval_s=10.0, max_buffered_keys=4)
    await updates.tell(KEYS[:1], [])
    waiting = updates.tell(KEYS[1:4], [])  # three keys: they wait
    await asyncio.sleep(0.2)
    assert len(tracker.calls) == 1
    started = time.monotonic()
    await asyncio.wait_for(updates.tell([], KEYS[4:5]), 2.0)  # the fourth key
    assert time.monotonic() - started < 1.0
    assert waiting.done()
    assert tracker.calls[1][1:] == ([KEYS[4]], KEYS[1:4])


async def test_wait_sends_what_is_buffered_at_once():
    tracker = RecordingTracker()
    updates, _ = updates_to(tracker, interval_s=10.0)
    await updates.tell(KEYS[:1], [])
    updates.tell(KEYS[1:3], [])
    await asyncio.wait_for(updates.wait(), 2.0)  # a shutdown, a test
    assert tracker.calls[1][1:] == ([], KEYS[1:3])


async def test_a_replica_forgotten_while_its_changes_wait_stays_forgotten():
    """The replica's buffered registrations arrive after the tracker forgot it:
    refused (counted, logged), and neither the tracker nor a mirror lists them."""
    tracker = BlockTrackerActor()
    for rank in range(3):
        tracker.register_replica(rank, f"nixl://{rank}")
    recording = RecordingTracker(tracker)
    updates, counters = updates_to(recording)
    mirror = TrackerMirror(lambda since, wait_s: None, rpc_timeout_s=1)
    mirror.apply(await tracker.mirror_changes(0, -1, 0.0))
    await updates.tell(KEYS[:4], [])
    mirror.apply(await tracker.mirror_changes(0, mirror.version, 0.0))
    assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://1", 4)
    buffered = updates.tell(KEYS[4:8], KEYS[:1])  # waits out the interval
    await asyncio.sleep(0)
    assert len(recording.calls) == 1
    tracker.forget_replica(1)  # the replica went away meanwhile
    await buffered
    assert len(recording.calls) == 2 and counters.tracker_failures == 1
    assert tracker.num_blocks(1) == 0
    assert tracker.query_prefix(0, KEYS[4:]) is None
    mirror.apply(await tracker.mirror_changes(0, mirror.version, 0.0))
    assert mirror.query(0, KEYS) is None and mirror.query(0, KEYS[4:]) is None


def test_locations_travel_as_each_held_keys_last_one():
    a, b, c = KEYS[:3]
    pending = PendingChanges()
    pending.add([a, b], [], [(a, 0, 2), (b, 1, 2)])
    pending.add([], [], [(a, 3, 4)])  # a rewritten into another slot
    pending.add([c], [b], [(c, 1, 6)])  # b dropped: its location with it
    assert pending.take() == ([a, c], [], [(a, 3, 4), (c, 1, 6)])
    # a location alone (a key demoted out of the device tier) is a change too
    pending.add([], [], [(a, 0, 0)])
    assert len(pending) == 1
    assert pending.take() == ([], [], [(a, 0, 0)])


async def test_a_location_alone_is_sent_to_the_tracker():
    tracker = RecordingTracker()
    updates = TrackerUpdates(0, ActorCounters(), no_deadline, interval_s=0.0)
    updates.tracker = tracker
    await updates.tell([], [], [(KEYS[0], 0, 0)])
    assert tracker.located == [[(KEYS[0], 0, 0)]]
