"""Tensor-parallel replicas, the connector's side (``connector/ranks.py``): one
reservation over every rank of the holder, each worker carrying out its own rank's
part of the same step, and vLLM's aggregation of the ranks' load reports."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from xinference.model.llm.vllm.xavier.connector.ranks import (
    merge_round_trips,
    release_every_rank,
    reserve_every_rank,
    shard_for_rank,
    step_for_rank,
)
from xinference.model.llm.vllm.xavier.connector.step import (
    RequestLoad,
    StepMetadata,
)
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.wire import (
    CPU_TIER,
    DEVICE_TIER,
    KVGeometry,
    LeaseGrant,
    LoadRequest,
    ReplicaIdentity,
    StageItem,
)

KEYS = tuple(hash_full_blocks(list(range(16)), 4, "tp-test|bfloat16|4"))


def grant(n: int, tier: str = DEVICE_TIER, lease: str = "L") -> LeaseGrant:
    return LeaseGrant(lease, 0, KEYS[:n], (tier,) * n, ("bfloat16",) * n)


class Holder:
    """One rank of a holder: grants ``held`` keys, or fails."""

    def __init__(self, held: int, fail: bool = False, tier: str = DEVICE_TIER) -> None:
        self.held, self.fail, self.tier = held, fail, tier
        self.leased = False
        self.released = 0

    async def reserve(self) -> LeaseGrant:
        await asyncio.sleep(0)
        if self.fail:
            raise ConnectionError("rank gone")
        self.leased = bool(self.held)
        return grant(self.held, self.tier)

    async def release(self) -> None:
        self.released += 1
        self.leased = False


def run(holders: list[Holder]) -> LeaseGrant:
    return asyncio.run(
        reserve_every_rank(
            len(holders),
            lambda tp: holders[tp].reserve(),
            lambda tp: holders[tp].release(),
        )
    )


def test_one_reservation_covers_every_rank_with_the_prefix_all_hold():
    holders = [Holder(4), Holder(3, tier=CPU_TIER)]
    combined = run(holders)
    assert combined.keys == KEYS[:3]
    assert len(combined.rank_shards) == 1
    assert shard_for_rank(combined, 0).keys == shard_for_rank(combined, 1).keys
    # each rank's part keeps that rank's tiers (rank 1 demoted its shards)
    assert shard_for_rank(combined, 0).tiers == (DEVICE_TIER,) * 3
    assert shard_for_rank(combined, 1).tiers == (CPU_TIER,) * 3
    assert shard_for_rank(combined, 0).rank_shards == ()
    assert all(h.leased and h.released == 0 for h in holders)
    # the loader may take fewer: every rank's part shrinks alike
    assert shard_for_rank(combined.truncated(2), 1).keys == KEYS[:2]


def test_a_rank_that_fails_fails_the_reservation_and_frees_the_others():
    holders = [Holder(4), Holder(4, fail=True), Holder(4)]
    with pytest.raises(ConnectionError, match="rank gone"):
        run(holders)
    assert [h.released for h in holders] == [1, 0, 1]
    assert not any(h.leased for h in holders)


def test_a_rank_that_holds_nothing_is_a_miss_and_frees_the_others():
    holders = [Holder(4), Holder(0)]
    combined = run(holders)
    assert combined.keys == () and combined.rank_shards == ()
    assert holders[0].released == 1 and not holders[0].leased
    assert holders[1].released == 0  # nothing to release there


def test_release_tries_every_rank_then_raises():
    released: list[int] = []

    async def release(tp: int) -> None:
        if tp == 0:
            raise TimeoutError("rank 0 stopped")
        released.append(tp)

    with pytest.raises(TimeoutError):
        asyncio.run(release_every_rank(3, release))
    assert sorted(released) == [1, 2]


def test_a_shard_for_a_rank_the_grant_lacks_is_refused():
    with pytest.raises(ValueError, match="parts for 1 tensor-parallel ranks"):
        shard_for_rank(grant(2), 1)


def test_shards_must_carry_the_same_keys():
    with pytest.raises(ValueError, match="same keys"):
        dataclasses.replace(grant(3), rank_shards=(grant(2),))


def step_with_a_load(combined: LeaseGrant) -> StepMetadata:
    load = LoadRequest("load-1", combined, "nixl://holder", (7, 8, 9))
    return StepMetadata(
        loads=(RequestLoad("r1", load), RequestLoad("r2", None, (3,))),
        stage=(StageItem(KEYS[0], 1), StageItem(KEYS[1], 2)),
    )


def test_every_rank_stages_and_loads_under_the_scheduler_s_keys():
    """The scheduler half hashes once; each worker gets the same keys, and only
    its own rank's part of the grant."""
    combined = run([Holder(3), Holder(3, tier=CPU_TIER)])
    step = step_with_a_load(combined)
    parts = [step_for_rank(step, tp, 2) for tp in (0, 1)]
    for tp, part in enumerate(parts):
        assert part.stage == step.stage
        first, second = part.loads
        assert first.load is not None and first.load.grant.keys == KEYS[:3]
        assert first.load.grant == shard_for_rank(combined, tp)
        assert first.load.dst_block_ids == (7, 8, 9)
        assert second == step.loads[1]  # a load that cannot start, unchanged
    assert parts[0].loads[0].load.grant.tiers != parts[1].loads[0].load.grant.tiers


def test_one_rank_carries_the_step_as_the_scheduler_built_it():
    alone = step_with_a_load(grant(3))
    assert step_for_rank(alone, 0, 1) is alone


def test_round_trips_of_a_load_are_its_slowest_rank_s():
    assert merge_round_trips({"a": 2, "b": 1}, {"a": 3, "c": 1}) == {
        "a": 3,
        "b": 1,
        "c": 1,
    }


def test_replicas_of_other_tensor_parallel_sizes_are_incompatible():
    """KV moves rank r to rank r: a peer that splits the heads otherwise is
    refused by name (the holder's LeaseBook raises it), never loaded from."""
    geometry = KVGeometry(num_layers=2, layer_block_nbytes=64, logical_dtype="bf16")
    two = ReplicaIdentity("m", geometry, "packed_kv", tensor_parallel_size=2)
    one = dataclasses.replace(two, tensor_parallel_size=1)
    assert two.incompatibility(one) == (
        "tensor_parallel_size differs: 2 here, 1 on the peer"
    )
    assert two.incompatibility(dataclasses.replace(two)) is None
