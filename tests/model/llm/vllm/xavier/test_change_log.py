"""The tracker's packed change feed: encoding, the shared answers, the poll pacing,
and the rank-bit index both ends keep (see change_log.py, prefix_index.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from xinference.model.llm.vllm.xavier import tracker as tracker_module
from xinference.model.llm.vllm.xavier.actor.tracker_updates import TrackerUpdates
from xinference.model.llm.vllm.xavier.change_log import (
    ChangeLog,
    all_changes,
    decode,
    decode_changes,
    encode,
    pack_keys,
    unpack_keys,
)
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.prefix_index import PrefixIndex
from xinference.model.llm.vllm.xavier.stats import ActorCounters
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror
from xinference.model.llm.vllm.xavier.wire import IndexChange, PrefixHit

KEYS = hash_full_blocks(list(range(16 * 8)), 16, "change-log-test")


def test_changes_round_trip_through_the_packed_records():
    records = (
        encode(IndexChange.ADD, 3, pack_keys(KEYS[:5]))
        + encode(IndexChange.REMOVE, 70, pack_keys(KEYS[2:3]))
        + encode(IndexChange.FORGET, 3)
        + encode(IndexChange.ADD, 0, pack_keys([]))
    )
    assert decode_changes(records) == (
        IndexChange(IndexChange.ADD, 3, tuple(KEYS[:5])),
        IndexChange(IndexChange.REMOVE, 70, (KEYS[2],)),
        IndexChange(IndexChange.FORGET, 3, ()),
        IndexChange(IndexChange.ADD, 0, ()),
    )
    assert unpack_keys(pack_keys(KEYS)) == KEYS
    assert pack_keys(pack_keys(KEYS)) == pack_keys(KEYS)  # packed passes as is


def test_bad_keys_and_cut_records_are_refused():
    with pytest.raises(ValueError):
        pack_keys([KEYS[0], b"short"])
    with pytest.raises(ValueError):
        pack_keys(b"x" * 17)
    record = encode(IndexChange.ADD, 1, pack_keys(KEYS[:2]))
    with pytest.raises(ValueError):
        list(decode(record[:-1]))  # a record cut short, never a short key


def test_the_log_answers_exactly_the_records_after_a_version_and_shares_them():
    log = ChangeLog(max_keys=4)
    for version, key in enumerate(KEYS[:3], start=1):
        log.append(version, encode(IndexChange.ADD, 1, key))
    after_one = log.since(1, 3)
    assert [keys for _, _, keys in decode(after_one)] == KEYS[1:3]
    # mirrors asking for the same range get the very same bytes: encoded once
    assert log.since(1, 3) is after_one
    assert log.since(3, 3) == b""
    # past max_keys the oldest records go; a mirror from before them must reset
    for version, key in enumerate(KEYS[3:6], start=4):
        log.append(version, encode(IndexChange.ADD, 1, key))
    assert not log.reaches(1)
    assert log.reaches(2)
    assert [keys for _, _, keys in decode(log.since(2, 6))] == KEYS[2:6]


def fresh_tracker() -> BlockTrackerActor:
    tracker = BlockTrackerActor()
    for rank in range(3):
        tracker.register_replica(rank, f"nixl://{rank}")
    return tracker


def unpolled(since: int, wait_s: float):
    raise AssertionError("these mirrors are fed by hand")


async def test_mirrors_starting_together_share_one_encoded_snapshot():
    tracker = fresh_tracker()
    tracker.register_blocks(1, pack_keys(KEYS[:4]))
    first = await tracker.mirror_changes(0, -1, 0.0)
    second = await tracker.mirror_changes(2, -1, 0.0)
    assert first.reset and second.reset
    assert first.packed is second.packed
    mirror = TrackerMirror(unpolled, rpc_timeout_s=1)
    mirror.apply(first)
    assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://1", 4)
    tracker.register_blocks(2, KEYS[:1])
    assert (await tracker.mirror_changes(0, -1, 0.0)).packed != first.packed


async def test_a_forgotten_replica_leaves_every_mirror_fed_by_the_packed_feed():
    tracker = fresh_tracker()
    mirror = TrackerMirror(unpolled, rpc_timeout_s=1)
    mirror.apply(await tracker.mirror_changes(0, -1, 0.0))
    tracker.register_blocks(1, KEYS[:6])
    tracker.register_blocks(2, KEYS[:2])
    mirror.apply(await tracker.mirror_changes(0, mirror.version, 0.0))
    assert mirror.query(0, KEYS) == PrefixHit(1, "nixl://1", 6)
    tracker.forget_replica(1)
    changes = await tracker.mirror_changes(0, mirror.version, 0.0)
    assert [c.op for c in all_changes(changes)] == [IndexChange.FORGET]
    mirror.apply(changes)
    assert mirror.query(0, KEYS) == PrefixHit(2, "nixl://2", 2)
    assert mirror.query(2, KEYS) is None


async def test_a_mirror_gets_one_answer_per_window(monkeypatch):
    """At most one answer per mirror per window (a snapshot counts): under steady
    traffic a mirror is always behind when it polls again and waits out the rest
    of its window, and no longer (its lag stays bounded by the window); after a
    quiet spell longer than the window the first change is answered at once."""
    window = 0.3
    monkeypatch.setattr(tracker_module, "MIRROR_BATCH_S", window)
    tracker = fresh_tracker()
    started = time.monotonic()
    base = (await tracker.mirror_changes(0, -1, 0.0)).version
    tracker.register_blocks(1, KEYS[:1])
    first = await tracker.mirror_changes(0, base, 5.0)
    assert window * 0.8 <= time.monotonic() - started < window * 2
    tracker.register_blocks(1, KEYS[1:2])  # arrived while the answer travelled
    started = time.monotonic()
    second = await tracker.mirror_changes(0, first.version, 5.0)
    assert window * 0.8 <= time.monotonic() - started < window * 2
    assert [c.keys for c in all_changes(second)] == [(KEYS[1],)]
    # a quiet spell: the mirror waits for a change, which then goes at once
    waiting = asyncio.create_task(tracker.mirror_changes(0, second.version, 5.0))
    await asyncio.sleep(window * 1.2)
    started = time.monotonic()
    tracker.register_blocks(1, KEYS[2:3])
    third = await waiting
    assert time.monotonic() - started < window / 2
    assert [c.keys for c in all_changes(third)] == [(KEYS[2],)]
    # another mirror's window is its own
    await tracker.mirror_changes(2, -1, 0.0)
    await asyncio.sleep(window * 1.2)
    started = time.monotonic()
    await tracker.mirror_changes(2, base, 5.0)
    assert time.monotonic() - started < window / 2


async def test_replicas_send_one_packed_update_per_send_logged_as_sent():
    tracker = fresh_tracker()
    sent: list[tuple[str, int, object]] = []

    class Recording:
        async def update_blocks(self, rank, dropped, added, located=b""):
            assert located == b""  # these updates locate nothing
            sent.append((rank, dropped, added))
            tracker.update_blocks(rank, dropped, added, located)

    async def no_deadline(call):
        return await call

    updates = TrackerUpdates(1, ActorCounters(), no_deadline)
    updates.tracker = Recording()
    base = (await tracker.mirror_changes(0, -1, 0.0)).version
    await updates.tell(KEYS[:4], [])
    await updates.tell([], KEYS[3:4])
    await updates.tell(KEYS[3:5], KEYS[:1])  # one call, the drops applied first
    assert sent == [
        (1, b"", pack_keys(KEYS[:4])),
        (1, pack_keys(KEYS[3:4]), b""),
        (1, pack_keys(KEYS[:1]), pack_keys(KEYS[3:5])),
    ]
    assert tracker.query_prefix(2, KEYS[1:]) == PrefixHit(1, "nixl://1", 4)
    assert tracker.query_prefix(2, KEYS) is None  # KEYS[0] was dropped
    answer = await tracker.mirror_changes(0, base, 0.0)
    assert answer.packed.endswith(pack_keys(KEYS[3:5]))


def test_the_rank_bit_index_keeps_the_prefix_rule_for_any_rank():
    index = PrefixIndex()
    index.add(70, KEYS[:5], version=1)
    index.add(3, KEYS[:3], version=2)
    index.add(65, KEYS[:3], version=3)
    assert index.longest_prefix(-1, KEYS) == (70, 5)
    assert index.longest_prefix(70, KEYS) == (3, 3)  # lowest among equals
    assert index.longest_prefix(70, KEYS, visible_upto=1) is None
    assert index.longest_prefix(3, KEYS, visible_upto=2) == (70, 5)
    index.remove(70, KEYS[1:2])
    assert index.longest_prefix(-1, KEYS) == (3, 3)
    index.forget(3)
    index.forget(65)
    assert index.longest_prefix(-1, KEYS) == (70, 1)
    assert not index.holds(3) and index.num_blocks(70) == 4
    index.remove(70, KEYS)
    assert index._holders == {}  # no empty entries left behind
    with pytest.raises(ValueError):
        index.add(-1, KEYS[:1])


def test_locate_records_round_trip_and_count_their_keys():
    from xinference.model.llm.vllm.xavier.change_log import (
        ChangeLog,
        decode,
        decode_changes,
        encode,
        pack_locations,
        unpack_locations,
    )
    from xinference.model.llm.vllm.xavier.wire import IndexChange

    keys = [bytes([i]) * 16 for i in range(3)]
    located = [(k, 10 * i, 2 * i + 2) for i, k in enumerate(keys)]
    record = encode(IndexChange.LOCATE, 5, pack_locations(located))
    record += encode(IndexChange.REMOVE, 5, b"".join(keys[:1]))
    (op, rank, packed), removed = list(decode(record))
    assert (op, rank) == (IndexChange.LOCATE, 5)
    assert unpack_locations(packed) == located
    assert removed[0] == IndexChange.REMOVE and removed[2] == keys[0]
    assert decode_changes(record)[0] == IndexChange(IndexChange.LOCATE, 5, tuple(keys))
    log = ChangeLog(max_keys=3)
    log.append(1, encode(IndexChange.LOCATE, 5, pack_locations(located)))
    log.append(2, encode(IndexChange.ADD, 5, b"".join(keys[:1])))
    assert not log.reaches(0)  # 4 keys logged: the LOCATE record (3) fell out


def test_a_location_shares_its_entry_with_the_version_and_never_outlives_the_key():
    """Locations live in the index's entries (one int each): they must not
    change what an entry's version makes visible, must not exist for a key its
    rank does not hold, and anything no store publishes reads as no location."""
    index = PrefixIndex()
    index.add(1, KEYS[:3], version=2**40 + 5)
    generation = 2**62 + 2  # clock-based generations are this large
    index.locate(1, [(KEYS[0], 2**47, generation), (KEYS[1], 7, 8), (KEYS[5], 1, 2)])
    assert index.locations(1, KEYS[:2]) == [(2**47, generation), (7, 8)]
    assert index.locations(1, KEYS[:3]) is None  # KEYS[2] has none
    assert index.locations(1, KEYS[5:6]) is None  # not held: not kept
    assert index.longest_prefix(0, KEYS, visible_upto=2**40 + 4) is None
    assert index.longest_prefix(0, KEYS, visible_upto=2**40 + 5) == (1, 3)
    assert index.located_by_rank() == {
        1: [(KEYS[0], 2**47, generation), (KEYS[1], 7, 8)]
    }
    index.locate(1, [(KEYS[0], -1, 4), (KEYS[1], 2**48, 8), (KEYS[2], 3, 0)])
    assert index.located_by_rank() == {}
    index.locate(1, [(KEYS[0], 3, 4)])
    index.add(1, KEYS[:1], version=9)  # registered again: a new slot to come
    assert index.locations(1, KEYS[:1]) is None
    index.locate(1, [(KEYS[0], 3, 4)])
    index.remove(1, KEYS[:1])
    index.add(1, KEYS[:1], version=10)
    assert index.locations(1, KEYS[:1]) is None
    index.locate(1, [(KEYS[1], 5, 6)])
    index.forget(1)
    index.add(1, KEYS[:3], version=11)
    assert index.located_by_rank() == {}
