"""A tensor-parallel replica's lead rank tells the tracker a snapshot only once
every rank staged its shard, and takes it back once any rank dropped its shard."""

from __future__ import annotations

import asyncio

import pytest

from xinference.model.llm.vllm.xavier.actor.rank_registry import (
    LeadLink,
    RankRegistry,
    ReplicaRanks,
)
from xinference.model.llm.vllm.xavier.change_log import pack_keys, unpack_keys
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor

KEYS = hash_full_blocks(list(range(24)), 4, "registry-test|bfloat16|4")


class Tracker:
    """Records what the tracker is told, and what it lists for replica 3."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[bytes], list[bytes]]] = []
        self.listed: set[bytes] = set()
        self.registered: list[tuple[int, str]] = []

    async def update_blocks(self, rank: int, dropped: bytes, added: bytes) -> None:
        assert rank == 3
        self.calls.append((unpack_keys(dropped), unpack_keys(added)))
        self.listed -= set(unpack_keys(dropped))
        self.listed |= set(unpack_keys(added))

    async def register_replica(self, rank: int, address: str) -> None:
        self.registered.append((rank, address))


def test_a_key_is_listed_once_every_rank_staged_it():
    async def scenario() -> None:
        tracker = Tracker()
        registry = RankRegistry(3, 2, tracker)
        await registry.rank_changed(0, [], KEYS[:3])
        assert tracker.listed == set() and tracker.calls == []
        await registry.rank_changed(1, b"", pack_keys(KEYS[1:4]))
        assert tracker.listed == set(KEYS[1:3])
        assert registry.held_by_all(KEYS[1]) and not registry.held_by_all(KEYS[0])
        # any rank dropping its shard takes the key back
        await registry.rank_changed(1, [KEYS[1]], [])
        assert tracker.listed == {KEYS[2]}
        # a rank that had dropped it staging it again lists it again
        await registry.rank_changed(1, [], [KEYS[1], KEYS[0]])
        assert tracker.listed == set(KEYS[:3])
        # dropped and staged again by one rank in one change: still listed, and
        # the tracker is told it was added, not dropped
        await registry.rank_changed(0, [KEYS[2]], [KEYS[2]])
        assert tracker.listed == set(KEYS[:3])
        assert tracker.calls[-1] == ([], [KEYS[2]])
        # a key one rank never had, dropped by the other: nothing to tell
        before = len(tracker.calls)
        await registry.rank_changed(1, [KEYS[3]], [])
        await registry.rank_changed(0, [KEYS[5]], [])
        assert len(tracker.calls) == before
        with pytest.raises(ValueError, match="tp_rank 2 out of range"):
            await registry.rank_changed(2, [], [KEYS[0]])

    asyncio.run(scenario())


def test_the_real_tracker_finds_only_what_every_rank_holds():
    tracker = BlockTrackerActor()
    tracker.register_replica(3, "nixl://holder")
    tracker.register_replica(4, "nixl://loader")

    class AsTheActorRef:  # the actor's methods, awaited as through its ref
        async def update_blocks(self, rank: int, dropped: bytes, added: bytes) -> None:
            tracker.update_blocks(rank, dropped, added)

    async def scenario() -> None:
        registry = RankRegistry(3, 2, AsTheActorRef())
        await registry.rank_changed(0, [], KEYS[:4])
        await registry.rank_changed(1, [], KEYS[:2])
        hit = tracker.query_prefix(-1, list(KEYS[:4]))
        assert hit is not None and hit.rank == 3 and hit.num_blocks == 2

    asyncio.run(scenario())


def test_only_the_lead_registers_and_the_others_send_to_it():
    async def scenario() -> None:
        tracker = Tracker()
        lead = ReplicaRanks(3, 0, 2)
        lead_view = await lead.connect(tracker, "nixl://a", lead=_never)
        assert tracker.registered == [(3, "nixl://a")]

        class LeadActor:
            async def rank_blocks_changed(self, tp_rank, dropped, added):
                await lead.rank_changed(tp_rank, dropped, added)

        async def lead_ref():
            return LeadActor()

        other = ReplicaRanks(3, 1, 2)
        link = await other.connect(tracker, "nixl://a", lead=lead_ref)
        assert isinstance(link, LeadLink) and not other.leads
        assert tracker.registered == [(3, "nixl://a")]  # once, by the lead
        await lead_view.update_blocks(3, b"", pack_keys(KEYS[:2]))
        await link.update_blocks(3, b"", pack_keys(KEYS[1:3]))
        assert tracker.listed == {KEYS[1]}
        with pytest.raises(RuntimeError, match="not the lead"):
            await other.rank_changed(0, b"", b"")
        # one rank per replica: the tracker itself, no registry in between
        single = ReplicaRanks(5, 0, 1)
        assert await single.connect(tracker, "nixl://b", lead=_never) is tracker

    asyncio.run(scenario())


async def _never():
    raise AssertionError("the lead never asks for itself")


@pytest.mark.parametrize("tp_rank, tp_size", [(2, 2), (-1, 2), (0, 0)])
def test_rank_numbers_are_checked(tp_rank, tp_size):
    with pytest.raises(ValueError, match="tp_rank must be in"):
        ReplicaRanks(0, tp_rank, tp_size)


@pytest.mark.timeout(20)  # without the deadline the registry would wait for ever
def test_a_stopped_tracker_holds_the_registry_only_until_the_deadline():
    class StoppedOnce(Tracker):
        def __init__(self) -> None:
            super().__init__()
            self.stopped = True

        async def update_blocks(self, rank, dropped, added):
            if self.stopped:
                self.stopped = False
                await asyncio.sleep(3600)
            await super().update_blocks(rank, dropped, added)

    async def deadline(call):
        return await asyncio.wait_for(call, 0.2)

    async def scenario() -> None:
        tracker = StoppedOnce()
        registry = RankRegistry(3, 2, tracker, deadline)
        await registry.rank_changed(0, [], KEYS[:2])
        with pytest.raises(asyncio.TimeoutError):
            await registry.rank_changed(1, [], KEYS[:2])  # the tracker hangs
        # the next change goes through at once (the lock was released)
        await asyncio.wait_for(registry.rank_changed(1, [], KEYS[2:3]), 1.0)
        await registry.rank_changed(0, [], KEYS[2:3])
        assert tracker.listed == {KEYS[2]}  # the missed change stays missed

    asyncio.run(scenario())
