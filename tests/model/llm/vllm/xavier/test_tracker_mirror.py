"""The tracker's change feed and a replica's mirror of its index.

The feed and the visibility rule are exercised on the actor's logic called in
process (deterministic: each poll is a direct call); the long poll and the mirror's
own loop against the tracker as a real actor in a real xoscar pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from xinference.model.llm.vllm.xavier import tracker as tracker_module
from xinference.model.llm.vllm.xavier.change_log import Location, all_changes
from xinference.model.llm.vllm.xavier.hashing import BlockHash, hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror
from xinference.model.llm.vllm.xavier.wire import PrefixHit, TrackerChanges

KEYS = hash_full_blocks(list(range(16 * 8)), 16, "mirror-test")
OTHER = hash_full_blocks(list(range(1000, 1000 + 16 * 4)), 16, "mirror-test")


def fresh_tracker() -> BlockTrackerActor:
    tracker = BlockTrackerActor()
    for rank, address in enumerate(("nixl://a", "nixl://b", "nixl://c")):
        tracker.register_replica(rank, address)
    return tracker


async def poll(tracker: BlockTrackerActor, rank: int, since: int) -> TrackerChanges:
    return await tracker.mirror_changes(rank, since, 0.0)


async def test_queries_see_only_what_the_mirrors_applied():
    """After the tracker says "replica 0 will find this prefix", replica 0's mirror
    must already have it: queries answer as the mirrors see the index."""
    tracker = fresh_tracker()
    base = (await poll(tracker, 0, -1)).version
    await poll(tracker, 0, base)  # mirror 0 is live at `base`
    tracker.register_blocks(1, KEYS[:4])
    assert tracker.query_prefix(0, KEYS) is None
    assert tracker.query_prefix(-1, KEYS) is None
    # replica 2 has no mirror: it sees everything at once
    assert tracker.query_prefix(2, KEYS) == PrefixHit(1, "nixl://b", 4)

    changes = await poll(tracker, 0, base)
    assert not changes.reset and changes.version == base + 1
    await poll(tracker, 0, changes.version)  # mirror 0 applied it
    assert tracker.query_prefix(0, KEYS) == PrefixHit(1, "nixl://b", 4)
    assert tracker.query_prefix(-1, KEYS) == PrefixHit(1, "nixl://b", 4)
    assert tracker.mirror_versions() == {0: base + 1, -1: base + 1}


async def test_a_replica_whose_mirror_stopped_polling_sees_every_change(monkeypatch):
    """A mirror that stopped polling (its replica's scheduler then asks the tracker)
    must not hold back that replica's own queries at the last version it applied."""
    tracker = fresh_tracker()
    base = (await poll(tracker, 0, -1)).version
    await poll(tracker, 0, base)  # mirror 0 is live at `base`, then goes quiet
    tracker.register_blocks(1, KEYS[:4])
    assert tracker.query_prefix(0, KEYS) is None  # not applied yet, still live

    later = time.monotonic() + tracker_module.MIRROR_GRACE_S + 1
    clock = SimpleNamespace(monotonic=lambda: later)  # the tracker's clock only
    monkeypatch.setattr(tracker_module, "time", clock)
    assert tracker.query_prefix(0, KEYS) == PrefixHit(1, "nixl://b", 4)
    assert tracker.query_prefix(-1, KEYS) == PrefixHit(1, "nixl://b", 4)


async def test_a_mirror_applies_every_kind_of_change_like_the_tracker():
    tracker = fresh_tracker()
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(0, since, wait), rpc_timeout_s=1
    )
    mirror.apply(await poll(tracker, 0, -1))

    def same_answers(keys: Sequence[BlockHash]) -> None:
        for rank in (-1, 0, 1, 2):
            assert mirror.query(rank, keys) == tracker.query_prefix(rank, keys)

    async def catch_up() -> None:
        mirror.apply(await poll(tracker, 0, mirror.version))
        await poll(tracker, 0, mirror.version)

    tracker.register_blocks(1, KEYS[:6])
    tracker.register_blocks(2, KEYS[:3])
    tracker.register_blocks(2, OTHER)
    await catch_up()
    assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 6)
    same_answers(KEYS)
    same_answers(OTHER)
    tracker.unregister_blocks(1, KEYS[2:])
    await catch_up()
    assert mirror.query(0, KEYS) == PrefixHit(2, "nixl://c", 3)
    assert mirror.query(2, KEYS) == PrefixHit(1, "nixl://b", 2)
    same_answers(KEYS)
    tracker.forget_replica(1)
    await catch_up()
    assert mirror.query(2, KEYS) is None
    same_answers(KEYS)
    tracker.register_replica(2, "nixl://c2")  # restarted: its old blocks are gone
    tracker.register_blocks(2, KEYS[:1])
    await catch_up()
    assert mirror.query(0, KEYS) == PrefixHit(2, "nixl://c2", 1)
    assert mirror.query(0, OTHER) is None
    same_answers(KEYS)
    same_answers(OTHER)


async def test_a_mirror_too_far_behind_gets_the_whole_index(monkeypatch):
    monkeypatch.setattr(tracker_module, "CHANGE_LOG_KEYS", 4)
    tracker = fresh_tracker()
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(0, since, wait), rpc_timeout_s=1
    )
    mirror.apply(await poll(tracker, 0, -1))
    behind = mirror.version
    for key in KEYS:  # 8 changes of one key: the log keeps only the last 4
        tracker.register_blocks(1, [key])
    changes = await poll(tracker, 0, behind)
    assert changes.reset
    mirror.apply(changes)
    assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", len(KEYS))
    # one change behind is still served from the log
    tracker.unregister_blocks(1, KEYS[4:])
    changes = await poll(tracker, 0, mirror.version)
    assert not changes.reset and len(all_changes(changes)) == 1
    mirror.apply(changes)
    assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 4)


async def test_a_reset_drops_whatever_the_mirror_held_before(monkeypatch):
    """The whole index replaces the mirror's: a holder that dropped its blocks
    while the mirror was too far behind must not stay in it for good."""
    monkeypatch.setattr(tracker_module, "CHANGE_LOG_KEYS", 4)
    tracker = fresh_tracker()
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(0, since, wait), rpc_timeout_s=1
    )
    mirror.apply(await poll(tracker, 0, -1))
    tracker.register_blocks(1, KEYS[:4])
    mirror.apply(await poll(tracker, 0, mirror.version))
    assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 4)
    behind = mirror.version
    tracker.unregister_blocks(1, KEYS[:4])
    tracker.register_blocks(2, OTHER)  # the log now starts after `behind`
    changes = await poll(tracker, 0, behind)
    assert changes.reset
    mirror.apply(changes)
    assert mirror.query(0, KEYS) is None
    assert mirror.query(0, OTHER) == PrefixHit(2, "nixl://c", len(OTHER))


async def test_a_poll_gets_exactly_the_changes_after_its_version():
    """Served from the newest end of a long log: the answer holds every change
    after ``since``, in order, and none before it."""
    tracker = fresh_tracker()
    base = (await poll(tracker, 0, -1)).version
    for key in KEYS + OTHER:
        tracker.register_blocks(1, [key])
    tracker.unregister_blocks(1, [KEYS[0]])
    since = base + len(KEYS)
    changes = await poll(tracker, 0, since)
    assert not changes.reset
    logged = all_changes(changes)
    assert [c.keys for c in logged] == [(k,) for k in OTHER] + [(KEYS[0],)]
    assert [c.op for c in logged][-1] == "remove"
    assert changes.version == since + len(OTHER) + 1
    assert all_changes(await poll(tracker, 0, changes.version)) == ()


async def test_changes_that_follow_a_wake_closely_travel_together(monkeypatch):
    """A waiting poll answers after a short window, with every change made in it:
    replicas publish every engine step, and one answer per change would cost the
    supervisor's process a round trip per mirror per step."""
    monkeypatch.setattr(tracker_module, "MIRROR_BATCH_S", 0.5)  # a slow machine
    tracker = fresh_tracker()
    base = (await poll(tracker, 0, -1)).version
    waiting = asyncio.create_task(tracker.mirror_changes(0, base, 5.0))
    await asyncio.sleep(0)  # the poll now waits for a change
    for key in KEYS[:3]:
        tracker.register_blocks(1, [key])
        await asyncio.sleep(0.01)  # the waiting poll runs in between
    assert not waiting.done()
    changes = await asyncio.wait_for(waiting, 2.0)
    assert [c.keys for c in all_changes(changes)] == [(k,) for k in KEYS[:3]]
    assert changes.version == base + 3


async def wait_until(condition, timeout: float) -> float:
    """Seconds until ``condition()`` held; fails past ``timeout``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, "condition not met in time"
        await asyncio.sleep(0.005)
    return time.monotonic() - started


async def test_a_waiting_mirror_gets_a_change_at_once(tracker):
    """The poll waits up to a minute for a change; a change must end the wait (a
    poll that only returned at its timeout would fail this test)."""
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(0, since, wait),
        rpc_timeout_s=2,
        wait_s=60,
    )
    task = asyncio.create_task(mirror.run())
    try:
        await wait_until(lambda: mirror.ready, 5)
        await asyncio.sleep(0.2)  # the next poll is now waiting in the tracker
        polls = mirror.polls
        await tracker.register_blocks(1, KEYS[:3])
        waited = await wait_until(lambda: mirror.query(0, KEYS) is not None, 2)
        assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 3)
        assert mirror.polls == polls + 1
        assert waited < 1.0
        # and its next poll tells the tracker how far it is
        deadline = time.monotonic() + 2
        while (await tracker.mirror_versions()).get(0) != mirror.version:
            assert time.monotonic() < deadline, "the mirror's version never arrived"
            await asyncio.sleep(0.005)
        assert (await tracker.mirror_versions())[-1] == mirror.version
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_mirror_that_loses_the_tracker_is_not_ready_until_it_is_back(
    tracker,
):
    outage = asyncio.Event()

    async def fetch(since: int, wait: float) -> TrackerChanges:
        if outage.is_set():
            raise ConnectionRefusedError("the supervisor's pool is gone")
        return await tracker.mirror_changes(0, since, wait)

    mirror = TrackerMirror(fetch, rpc_timeout_s=1, wait_s=0.1, retry_s=0.01)
    task = asyncio.create_task(mirror.run())
    try:
        await tracker.register_blocks(2, OTHER)
        await wait_until(lambda: mirror.ready and mirror.query(0, OTHER), 5)
        outage.set()
        await wait_until(lambda: not mirror.ready, 2)
        await tracker.register_blocks(1, KEYS[:2])
        await tracker.unregister_blocks(2, OTHER)  # while the mirror cannot see
        outage.clear()
        await wait_until(lambda: mirror.ready and mirror.query(0, KEYS), 5)
        assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 2)
        # what it held before the outage and the tracker dropped meanwhile is gone
        assert mirror.query(0, OTHER) is None
        assert mirror.failures >= 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_stopped_mirror_leaves_at_once_when_the_tracker_wakes_it(
    tracker,
):
    """Stopping ends the mirror's loop after the poll in flight; waking the polls
    ends that one at once, so nothing is left for the tracker to answer."""
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(0, since, wait),
        rpc_timeout_s=2,
        wait_s=60,
    )
    task = asyncio.create_task(mirror.run())
    try:
        await wait_until(lambda: mirror.ready, 5)
        await asyncio.sleep(0.2)  # the next poll waits in the tracker
        mirror.stop()
        assert not mirror.ready
        await tracker.wake_mirrors()
        await asyncio.wait_for(task, 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_mirror_learns_where_device_tier_keys_are():
    """Locations travel with the keys (``LOCATE`` records) for lease-free reads;
    a drop, a move out of the device tier, a forgotten holder or a snapshot reset
    takes them away, so the mirror never offers a location it was told is gone."""
    from xinference.model.llm.vllm.xavier.change_log import pack_keys, pack_locations

    tracker = fresh_tracker()
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(0, since, wait), rpc_timeout_s=1
    )

    async def sync() -> None:
        mirror.apply(await poll(tracker, 0, mirror.version))

    await sync()
    located = [(k, 3 * i, 2 * i + 2) for i, k in enumerate(KEYS[:3])]
    tracker.update_blocks(1, b"", pack_keys(KEYS[:3]), pack_locations(located))
    await sync()
    assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 3)
    assert mirror.locate(1, KEYS[:3]) == [(0, 2), (3, 4), (6, 6)]
    assert mirror.locate(2, KEYS[:1]) is None
    # key 1 left the device tier (demoted): no location, so no lease-free read
    tracker.update_blocks(1, b"", b"", pack_locations([(KEYS[1], 0, 0)]))
    await sync()
    assert mirror.locate(1, KEYS[:1]) == [(0, 2)]
    assert mirror.locate(1, KEYS[:2]) is None
    tracker.update_blocks(1, pack_keys(KEYS[:1]), b"")  # dropped
    await sync()
    assert mirror.locate(1, KEYS[:1]) is None
    assert mirror.locate(1, KEYS[2:3]) == [(6, 6)]
    tracker.forget_replica(1)
    await sync()
    assert mirror.locate(1, KEYS[2:3]) is None
    # a mirror that starts from a snapshot has the locations at once (the
    # tracker keeps each key's latest): its hits need no lease
    tracker.update_blocks(2, b"", pack_keys(KEYS[:1]), pack_locations(located[:1]))
    fresh = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(0, since, wait), rpc_timeout_s=1
    )
    fresh.apply(await poll(tracker, 0, -1))
    assert fresh.query(0, KEYS[:1]) == PrefixHit(2, "nixl://c", 1)
    assert fresh.locate(2, KEYS[:1]) == [(0, 2)]


def located_keys(keys: Sequence[BlockHash], first_row: int) -> list[Location]:
    return [(k, first_row + 2 * i, 1000 + 2 * i) for i, k in enumerate(keys)]


def every_location(mirror: TrackerMirror) -> dict[tuple[int, BlockHash], Any]:
    """What ``locate`` answers for each (rank, key) of the test's keys."""
    return {
        (rank, key): mirror.locate(rank, [key])
        for rank in range(3)
        for key in (*KEYS, *OTHER)
    }


async def test_a_mirror_from_a_snapshot_locates_what_a_following_mirror_does(
    monkeypatch,
):
    """Every (replica, key)'s latest location survives into snapshots: a mirror
    that starts now, or one too far behind the change log, locates exactly what
    a mirror that followed every change does; a demotion, a drop, a replica
    forgotten or registered again takes locations away everywhere."""
    from xinference.model.llm.vllm.xavier.change_log import pack_keys, pack_locations

    monkeypatch.setattr(tracker_module, "CHANGE_LOG_KEYS", 6)
    tracker = fresh_tracker()

    def new_mirror() -> TrackerMirror:
        return TrackerMirror(
            lambda since, wait: tracker.mirror_changes(0, since, wait),
            rpc_timeout_s=1,
        )

    follower, behind = new_mirror(), new_mirror()
    for mirror in (follower, behind):
        mirror.apply(await poll(tracker, 0, -1))

    async def check() -> None:
        follower.apply(await poll(tracker, 0, follower.version))
        fresh = new_mirror()
        fresh.apply(await poll(tracker, 0, -1))
        assert every_location(fresh) == every_location(follower)

    tracker.update_blocks(
        1, b"", pack_keys(KEYS[:4]), pack_locations(located_keys(KEYS[:4], 10))
    )
    tracker.update_blocks(
        2, b"", pack_keys(OTHER), pack_locations(located_keys(OTHER, 0))
    )
    await check()
    assert follower.locate(1, KEYS[:4]) == [
        (10, 1000),
        (12, 1002),
        (14, 1004),
        (16, 1006),
    ]
    # a newer location replaces the old one; a demotion (generation 0) drops it
    tracker.update_blocks(
        1, b"", b"", pack_locations([(KEYS[0], 40, 2000), (KEYS[1], 0, 0)])
    )
    await check()
    assert follower.locate(1, KEYS[:1]) == [(40, 2000)]
    assert follower.locate(1, KEYS[1:2]) is None
    assert follower.query(0, KEYS) == PrefixHit(1, "nixl://b", 4)  # still held
    tracker.update_blocks(1, pack_keys(KEYS[2:3]), b"")  # dropped
    await check()
    assert follower.locate(1, KEYS[2:3]) is None
    tracker.forget_replica(2)
    await check()
    assert follower.locate(2, OTHER[:1]) is None
    # registered again (a restarted replica): its old locations are not served,
    # even for keys it registers again
    tracker.update_blocks(1, b"", b"", pack_locations(located_keys(KEYS[3:4], 60)))
    tracker.register_replica(1, "nixl://b2")
    tracker.register_blocks(1, KEYS[:4])
    await check()
    assert follower.locate(1, KEYS[:1]) is None
    # the mirror left behind gets the whole index, locations included
    tracker.update_blocks(1, b"", b"", pack_locations(located_keys(KEYS[:2], 70)))
    changes = await poll(tracker, 0, behind.version)
    assert changes.reset
    behind.apply(changes)
    await check()
    assert behind.locate(1, KEYS[:2]) == [(70, 1000), (72, 1002)]
    assert every_location(behind) == every_location(follower)


async def test_a_location_found_stale_is_dropped_unless_a_newer_one_came():
    from xinference.model.llm.vllm.xavier.change_log import pack_keys, pack_locations

    tracker = fresh_tracker()
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(0, since, wait), rpc_timeout_s=1
    )
    mirror.apply(await poll(tracker, 0, -1))
    located = located_keys(KEYS[:3], 0)
    tracker.update_blocks(1, b"", pack_keys(KEYS[:3]), pack_locations(located))
    mirror.apply(await poll(tracker, 0, mirror.version))
    # key 1's location was republished before the reader's report arrives
    newer = (KEYS[1], 30, 3000)
    tracker.update_blocks(1, b"", b"", pack_locations([newer]))
    mirror.apply(await poll(tracker, 0, mirror.version))
    mirror.forget_locations(1, [located[0], located[1]])
    assert mirror.locate(1, KEYS[:1]) is None
    assert mirror.locate(1, KEYS[1:3]) == [(30, 3000), (4, 1004)]
    assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 3)  # still held
