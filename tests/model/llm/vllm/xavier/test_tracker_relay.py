"""A host's tracker relay, with the tracker and the relay each a real actor in its
own process of a real xoscar pool (the tracker in the main pool, the relay in a
sub-pool), and mirrors that are the replicas' own ``TrackerMirror``. The pool is
the module's; each test has a tracker and a relay of its own, destroyed after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
import xoscar as xo
from xoscar.errors import ActorNotExist

from xinference.model.llm.vllm.xavier.actor.tracker_updates import TrackerUpdates
from xinference.model.llm.vllm.xavier.change_log import (
    decode_changes,
    pack_keys,
    pack_locations,
    split_records,
)
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.stats import ActorCounters
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror
from xinference.model.llm.vllm.xavier.tracker_relay import TrackerRelayActor
from xinference.model.llm.vllm.xavier.wire import (
    IndexChange,
    PrefixHit,
    TrackerChanges,
)

# every test runs on the module's loop, the one the module's pool lives on
pytestmark = pytest.mark.asyncio(loop_scope="module")

KEYS = hash_full_blocks(list(range(16 * 8)), 16, "relay-test")
OTHER = hash_full_blocks(list(range(1000, 1000 + 16 * 4)), 16, "relay-test")
ADDRESSES = ("nixl://a", "nixl://b", "nixl://c")


class Setup:
    def __init__(self, tracker: Any, relay: Any, tracker_address: str) -> None:
        self.tracker = tracker
        self.relay = relay
        self.tracker_address = tracker_address


class SpoilingTracker(BlockTrackerActor):
    """The tracker, except that the first answer with changes it gives a relay
    after ``spoil`` is spoiled: ``"drop"`` leaves its last record out (fewer
    records than the versions it advances), ``"snapshot"`` answers with the whole
    index instead, as a tracker whose log no longer reaches the relay's version
    answers."""

    def __init__(self) -> None:
        super().__init__()
        self._spoil: str | None = None

    def spoil(self, how: str) -> None:
        self._spoil = how

    async def relay_changes(
        self, relay: str, versions: dict[int, int], since: int, wait_s: float
    ) -> TrackerChanges:
        answer = await super().relay_changes(relay, versions, since, wait_s)
        if self._spoil is None or answer.reset or not answer.packed:
            return answer
        how, self._spoil = self._spoil, None
        if how == "snapshot":
            return self.snapshot()
        kept = b"".join(split_records(answer.packed)[:-1])
        return dataclasses.replace(answer, packed=kept)


async def start_tracker(address: str, cls: type = BlockTrackerActor) -> Any:
    tracker = await xo.create_actor(cls, address=address, uid="trk")
    for rank, replica in enumerate(ADDRESSES):
        await tracker.register_replica(rank, replica)
    return tracker


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[tuple[str, str]]:
    """The main pool's address (the tracker's) and its sub-pool's (the relay's)."""
    made = await xo.create_actor_pool("127.0.0.1", n_process=1)
    async with made:
        config = await xo.get_pool_config(made.external_address)
        main, sub = list(config.get_external_addresses())
        yield main, sub


@contextlib.asynccontextmanager
async def tracker_and_relay(
    pool: tuple[str, str],
    tracker_class: type = BlockTrackerActor,
    **relay_options: Any,
) -> AsyncIterator[Setup]:
    main, sub = pool
    tracker = await start_tracker(main, tracker_class)
    relay = await xo.create_actor(
        TrackerRelayActor,
        main,
        "trk",
        **{"rpc_timeout_s": 1.0, "wait_s": 0.5, "retry_s": 0.2, **relay_options},
        address=sub,
        uid="relay",
    )
    try:
        # until its first poll is answered a relay refuses mirrors (as not ready)
        await eventually(lambda: _connected(relay))
        yield Setup(tracker, relay, main)
    finally:
        # the relay first: it ends its poll at the tracker as it leaves
        if await xo.has_actor(relay):
            await xo.destroy_actor(relay)
        # a test may have replaced the tracker (same address and uid)
        with contextlib.suppress(xo.ActorNotExist):
            await xo.destroy_actor(await xo.actor_ref(main, "trk"))


async def _connected(relay: Any) -> bool:
    return (await relay.stats())["connected"]


@pytest_asyncio.fixture(loop_scope="module")
async def setup(pool: tuple[str, str]) -> AsyncIterator[Setup]:
    async with tracker_and_relay(pool) as made:
        yield made


@dataclasses.dataclass
class Following:
    """A replica's mirror following ``ref`` (the tracker or a relay)."""

    mirror: TrackerMirror
    task: asyncio.Task[None]
    ref: Any


def start_mirror(ref: Any, rank: int) -> Following:
    mirror = TrackerMirror(
        lambda since, wait: ref.mirror_changes(rank, since, wait),
        rpc_timeout_s=1.0,
        wait_s=0.5,
        retry_s=0.1,
    )
    return Following(mirror, asyncio.create_task(mirror.run()), ref)


async def eventually(check: Callable[[], Any], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        assert time.monotonic() < deadline, "not reached in time"
        await asyncio.sleep(0.02)


async def stop(followers: list[Following]) -> None:
    """Stop the mirrors as a replica does: each returns once the poll it has in
    flight is answered, which ``wake_mirrors`` makes at once. Cancelling the
    task instead would leave that call to be answered into nobody's hands (and
    an exception nobody retrieves once the relay or its pool is gone)."""
    for following in followers:
        following.mirror.stop()
    for following in followers:
        with contextlib.suppress(Exception):  # e.g. the tracker was destroyed
            await following.ref.wake_mirrors()
    tasks = [following.task for following in followers]
    _, late = await asyncio.wait(tasks, timeout=5.0)
    assert not late, "a stopped mirror did not return"
    await asyncio.gather(*tasks)


async def test_mirrors_through_the_relay_apply_what_direct_mirrors_apply(setup):
    direct = start_mirror(setup.tracker, 0)
    relayed = start_mirror(setup.relay, 1)
    try:
        await setup.relay.update_blocks(2, b"", pack_keys(KEYS[:6]))
        await setup.tracker.update_blocks(
            1, b"", pack_keys(OTHER), pack_locations([(OTHER[0], 3, 7)])
        )
        await setup.relay.update_blocks(2, pack_keys(KEYS[3:6]), b"")
        await setup.relay.forget_replica(1)
        await setup.tracker.register_replica(1, "nixl://b2")
        await setup.relay.update_blocks(
            1, b"", pack_keys(KEYS[:2]), pack_locations([(KEYS[0], 5, 9)])
        )
        final = (await setup.tracker.mirror_versions())[-1]
        await eventually(
            lambda: direct.mirror.version == final and relayed.mirror.version == final
        )
        for keys in (KEYS, OTHER):
            for rank in (-1, 0, 1, 2):
                assert direct.mirror.query(rank, keys) == relayed.mirror.query(
                    rank, keys
                )
        assert relayed.mirror.query(0, KEYS) == PrefixHit(2, "nixl://c", 3)
        assert relayed.mirror.query(2, KEYS) == PrefixHit(1, "nixl://b2", 2)
        assert relayed.mirror.query(0, OTHER) is None  # forgotten with replica 1
        assert relayed.mirror.locate(1, KEYS[:1]) == [(5, 9)]
        assert direct.mirror.locate(1, KEYS[:1]) == [(5, 9)]
        # both mirrors' versions reach the tracker, so rank -1 sees everything
        await eventually(
            lambda: _versions_are(setup.tracker, {0: final, 1: final, -1: final})
        )
        assert await setup.tracker.query_prefix(-1, KEYS) == PrefixHit(2, "nixl://c", 3)
    finally:
        await stop([direct, relayed])


async def _versions_are(tracker: Any, expected: dict[int, int]) -> bool:
    return await tracker.mirror_versions() == expected


async def test_a_query_never_sees_what_a_relayed_mirror_has_not_applied(setup):
    """The relay reports the version a mirror asked from, not the one it sent it."""
    relay, tracker = setup.relay, setup.tracker
    base = (await relay.mirror_changes(0, -1, 0.0)).version
    await relay.mirror_changes(0, base, 0.0)  # live at `base`
    await eventually(lambda: _versions_are(tracker, {0: base, -1: base}))
    await tracker.update_blocks(1, b"", pack_keys(KEYS[:4]))
    sent = await relay.mirror_changes(0, base, 5.0)  # received, not applied
    assert sent.version == base + 1
    assert KEYS[0] in sent.packed
    for _ in range(3):  # the relay's next polls (each at most 0.5 s)
        await asyncio.sleep(0.3)
        assert (await tracker.mirror_versions())[0] == base
        assert await tracker.query_prefix(0, KEYS) is None
        assert await tracker.query_prefix(-1, KEYS) is None
    await relay.mirror_changes(0, sent.version, 0.0)  # now it has applied it
    await eventually(lambda: _versions_are(tracker, {0: base + 1, -1: base + 1}))
    assert await tracker.query_prefix(0, KEYS) == PrefixHit(1, "nixl://b", 4)


async def test_coalesced_updates_keep_each_replicas_order(setup):
    relay, tracker = setup.relay, setup.tracker
    base = (await tracker.mirror_versions())[-1]
    calls = []
    expected: dict[int, list[tuple[str, tuple[bytes, ...]]]] = {0: [], 1: []}
    for step in range(40):
        rank = step % 2
        keys = tuple(KEYS[step % 8 : step % 8 + 1])
        if step % 4 < 2:
            calls.append(relay.update_blocks(rank, b"", pack_keys(keys)))
            expected[rank].append((IndexChange.ADD, keys))
        else:
            calls.append(relay.update_blocks(rank, pack_keys(keys), b""))
            expected[rank].append((IndexChange.REMOVE, keys))
    await asyncio.gather(*calls)
    stats = await relay.stats()
    assert stats["updates"] == 40
    assert stats["forwards"] < 40  # some were coalesced
    logged = decode_changes((await tracker.mirror_changes(2, base, 0.0)).packed)
    for rank in (0, 1):
        assert [(c.op, c.keys) for c in logged if c.rank == rank] == expected[rank]


async def test_one_replicas_failed_update_fails_only_its_own_call(setup):
    results = await asyncio.gather(
        setup.relay.update_blocks(0, b"", pack_keys(KEYS[:2])),
        setup.relay.update_blocks(7, b"", pack_keys(KEYS[:2])),  # not registered
        setup.relay.update_blocks(1, b"", pack_keys(OTHER[:2])),
        return_exceptions=True,
    )
    assert results[0] is None and results[2] is None
    assert "not registered" in str(results[1])
    assert await setup.tracker.num_blocks(0) == 2
    assert await setup.tracker.num_blocks(1) == 2


async def test_forgetting_a_replica_reaches_relayed_mirrors(setup):
    relayed = start_mirror(setup.relay, 0)
    try:
        await setup.relay.update_blocks(2, b"", pack_keys(KEYS[:3]))
        await eventually(lambda: relayed.mirror.query(0, KEYS) is not None)
        await setup.tracker.forget_replica(2)  # e.g. the supervisor saw it die
        await eventually(lambda: relayed.mirror.query(0, KEYS) is None)
        # a rank forgotten through the relay is no longer reported as a mirror
        await setup.relay.mirror_changes(1, relayed.mirror.version, 0.0)
        await eventually(lambda: _has_mirror(setup.tracker, 1))
        await setup.relay.forget_replica(1)
        await asyncio.sleep(1.2)  # two of the relay's polls
        assert 1 not in await setup.tracker.mirror_versions()
    finally:
        await stop([relayed])


async def _has_mirror(tracker: Any, rank: int) -> bool:
    return rank in await tracker.mirror_versions()


async def test_without_the_tracker_updates_fail_loudly_and_mirrors_stop(setup):
    relayed = start_mirror(setup.relay, 0)
    counters = ActorCounters()

    async def deadline(call: Any) -> Any:
        return await xo.wait_for(call, 3.0)

    updates = TrackerUpdates(0, counters, deadline, interval_s=0.0)
    updates.tracker = setup.relay
    try:
        await eventually(lambda: relayed.mirror.ready)
        await xo.destroy_actor(setup.tracker)
        updates.tell(list(KEYS[:2]), [])
        await updates.wait()
        assert counters.tracker_failures == 1  # as when the tracker call fails
        await eventually(lambda: not relayed.mirror.ready)
        with pytest.raises(ActorNotExist):  # what the tracker call raised
            await setup.relay.update_blocks(0, b"", pack_keys(KEYS[:1]))
        with pytest.raises(ConnectionError, match="no tracker"):
            await setup.relay.mirror_changes(3, -1, 0.0)
    finally:
        await stop([relayed])


def _mirror_from(relay, answer) -> TrackerMirror:
    """A fresh mirror of ``relay`` that has applied ``answer``."""
    mirror = TrackerMirror(
        lambda s, w: relay.mirror_changes(0, s, w), rpc_timeout_s=1.0
    )
    mirror.apply(answer)
    return mirror


async def test_a_mirror_behind_the_relays_log_gets_a_fresh_snapshot(pool):
    async with tracker_and_relay(pool, log_keys=4) as setup:
        relay, tracker = setup.relay, setup.tracker
        base = (await relay.mirror_changes(0, -1, 0.0)).version
        keys = list(KEYS) + list(OTHER)
        for start in range(0, len(keys), 2):  # 6 records of 2 keys
            await tracker.update_blocks(1, b"", pack_keys(keys[start : start + 2]))
        newest = (await tracker.mirror_versions())[-1]
        await eventually(lambda: _relay_at(relay, newest))
        # the relay's log (4 keys) no longer reaches `base`, nor does its first
        # snapshot: it fetches one from the tracker
        answer = await relay.mirror_changes(0, base, 0.0)
        assert answer.reset and answer.version == newest
        mirror = _mirror_from(relay, answer)
        assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 8)
        assert mirror.query(0, OTHER) == PrefixHit(1, "nixl://b", 4)
        await tracker.update_blocks(1, pack_keys(KEYS[:1]), b"")
        follow = await relay.mirror_changes(0, answer.version, 5.0)
        assert not follow.reset and follow.version == newest + 1


async def _relay_at(relay: Any, version: int) -> bool:
    return (await relay.stats())["version"] == version


async def test_the_relay_follows_a_tracker_that_comes_back(setup):
    relayed = start_mirror(setup.relay, 0)
    try:
        await setup.tracker.update_blocks(1, b"", pack_keys(KEYS[:5]))
        await setup.tracker.update_blocks(1, pack_keys(KEYS[3:5]), b"")
        await eventually(lambda: relayed.mirror.query(0, KEYS) is not None)
        await xo.destroy_actor(setup.tracker)
        await eventually(lambda: not relayed.mirror.ready)
        # a new tracker: its versions start again below the relay's
        tracker = await start_tracker(setup.tracker_address)
        await tracker.update_blocks(2, b"", pack_keys(KEYS[:2]))
        await eventually(lambda: relayed.mirror.ready, timeout_s=10.0)
        await eventually(
            lambda: relayed.mirror.query(0, KEYS) == PrefixHit(2, "nixl://c", 2)
        )
    finally:
        await stop([relayed])


async def test_a_relay_ends_its_poll_at_the_tracker_when_destroyed(pool):
    """Its poll waits up to 30 s here: destroying the relay wakes it at the tracker
    instead of waiting it out or leaving it to be answered into a closed pool."""
    async with tracker_and_relay(pool, wait_s=30.0, rpc_timeout_s=3.0) as setup:
        await asyncio.sleep(0.3)  # the relay's poll now waits at the tracker
        started = time.monotonic()
        await xo.destroy_actor(setup.relay)
        assert time.monotonic() - started < 1.5
        assert not await xo.has_actor(setup.relay)


async def test_records_that_do_not_match_the_versions_restart_the_relays_log(pool):
    """An answer with fewer records than the versions it advances: the relay
    cannot tell which version each record is, so it starts its log again there,
    and a mirror that applied less gets the whole index, never records numbered
    wrongly (or none, and a mirror that skipped a change)."""
    async with tracker_and_relay(pool, SpoilingTracker) as setup:
        relay, tracker = setup.relay, setup.tracker
        await tracker.update_blocks(1, b"", pack_keys(KEYS[:2]))
        before = (await tracker.mirror_versions())[-1]
        await eventually(lambda: _relay_at(relay, before))
        await tracker.spoil("drop")
        await tracker.update_blocks(1, b"", pack_keys(KEYS[2:4]))  # one version
        await eventually(lambda: _relay_at(relay, before + 1))
        answer = await relay.mirror_changes(0, before, 0.0)
        assert answer.reset and answer.version == before + 1
        mirror = _mirror_from(relay, answer)
        assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 4)


async def test_a_mirror_older_than_the_relays_log_base_gets_a_snapshot(pool):
    """The tracker answers the relay with the whole index (as it does once its
    own log no longer reaches the relay's version): the relay's log starts
    there, and a mirror that applied less gets a snapshot, never "nothing new"
    (which would let it skip the change and keep a stale index)."""
    async with tracker_and_relay(pool, SpoilingTracker) as setup:
        relay, tracker = setup.relay, setup.tracker
        before = (await relay.mirror_changes(0, -1, 0.0)).version
        await tracker.spoil("snapshot")
        await tracker.update_blocks(1, b"", pack_keys(KEYS[:3]))
        await eventually(lambda: _relay_at(relay, before + 1))
        answer = await relay.mirror_changes(0, before, 0.0)
        assert answer.reset and answer.version == before + 1
        mirror = _mirror_from(relay, answer)
        assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://b", 3)
