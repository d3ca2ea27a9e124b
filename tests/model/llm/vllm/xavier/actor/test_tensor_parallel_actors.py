"""Tensor-parallel replicas over real pools: two replicas of two engine ranks each.

Each replica's ranks are two ``SyntheticEngine``s (one KV-head shard each, filled
with different bytes) whose transfer actors, created as one group in the replica's
sub-pool process, map them. Shards move rank r to rank r, a replica is listed by
the tracker only for what both of its ranks staged, and the grant is the prefix
both ranks hold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import xoscar as xo

from xinference.model.llm.vllm.xavier.actor.rank_group import TransferActorGroup
from xinference.model.llm.vllm.xavier.actor.transfer_actor import TransferActorConfig
from xinference.model.llm.vllm.xavier.config import transfer_actor_uid
from xinference.model.llm.vllm.xavier.connector.ranks import (
    release_every_rank,
    reserve_every_rank,
    shard_for_rank,
)
from xinference.model.llm.vllm.xavier.engine.layout import PACKED_KV_LAYOUT
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import tracker_uid
from xinference.model.llm.vllm.xavier.wire import LoadRequest, StageItem

from .._support import MODEL, Cluster, EngineSpec, SyntheticEngine, cluster, new_id

__all__ = ["cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(180)]

SPEC = EngineSpec(PACKED_KV_LAYOUT, num_layers=2, num_blocks=32)
TP = 2
KEYS = hash_full_blocks(list(range(6 * SPEC.block_size)), SPEC.block_size, "tp-actors")


async def replica(
    cluster: Cluster,
    rank: int,
    gpu_cache_bytes: int | None = None,
    transport: str = "nixl",
) -> tuple[list[SyntheticEngine], Any]:
    engines = [SyntheticEngine(SPEC) for _ in range(TP)]
    config = TransferActorConfig(
        model_uid=MODEL,
        rank=rank,
        tracker_address=cluster.tracker_address,
        tracker_uid=tracker_uid(MODEL),
        gpu_cache_bytes=gpu_cache_bytes,
        cpu_capacity_blocks=32,
        rpc_timeout_s=20.0,
        tp_size=TP,
        transport=transport,
    )
    group = await TransferActorGroup.create(config, cluster.sub_pool(rank))
    for tp_rank, (engine, ref) in enumerate(zip(engines, group.refs, strict=True)):
        assert ref.uid.decode() == transfer_actor_uid(MODEL, rank, tp_rank)
        identity = await ref.map_engine_caches(
            engine.handles, SPEC.num_blocks, MODEL, SPEC.block_size
        )
        assert identity.tensor_parallel_size == TP
    return engines, group


async def stage(group: Any, tp_rank: int, keys: list[bytes], blocks: list[int]) -> None:
    ref = group.refs[tp_rank]
    items = [StageItem(k, b) for k, b in zip(keys, blocks, strict=True)]
    assert await ref.stage(items) == len(items)
    await ref.wait_tracker_updates()  # a rank other than the lead: via the lead


@pytest.mark.parametrize(
    "budget_blocks, transport",
    [(None, "nixl"), (16, "nixl"), (16, "xoscar")],
    ids=["cpu-tier", "device-tier-nixl", "device-tier-xoscar"],
)
async def test_shards_move_rank_to_rank_and_only_whole_blocks_are_listed(
    cluster, budget_blocks, transport
):
    budget = None
    if budget_blocks is not None:
        budget = (
            budget_blocks * SyntheticEngine(SPEC, share=False).geometry.block_nbytes
        )
    holder_engines, holder = await replica(cluster, 0, budget, transport)
    loader_engines, loader = await replica(cluster, 1, None, transport)
    for tp_rank, engine in enumerate(holder_engines):
        engine.fill_random(range(0, 6), seed=100 + tp_rank)
    requester = dataclasses.replace(
        loader_engines[0].identity(), tensor_parallel_size=TP
    )

    # Rank 0 alone staged: no replica holds them yet.
    await stage(holder, 0, KEYS[:6], list(range(6)))
    assert await cluster.tracker.query_prefix(1, KEYS) is None
    # Rank 1 staged four of them: the replica holds those four.
    await stage(holder, 1, KEYS[:4], list(range(4)))
    hit = await cluster.tracker.query_prefix(1, KEYS)
    assert hit is not None and (hit.rank, hit.num_blocks) == (0, 4)

    # One reservation over both ranks: the prefix both hold, one lease each.
    lease_id = new_id("lease")

    async def reserve(tp_rank: int):
        return await holder.refs[tp_rank].reserve(KEYS, lease_id, requester)

    async def release(tp_rank: int) -> None:
        await holder.refs[tp_rank].release(lease_id)

    grant = await reserve_every_rank(TP, reserve, release)
    assert grant.keys == tuple(KEYS[:4])
    assert [(await r.stats()).store.active_leases for r in holder.refs] == [1, 1]

    # Each loader rank loads its part from the holder's same rank.
    dst = (20, 21, 22, 23)
    load_id = new_id("load")
    for tp_rank, ref in enumerate(loader.refs):
        part = shard_for_rank(grant, tp_rank)
        await ref.start_load(LoadRequest(load_id, part, hit.address, dst))
    for ref in loader.refs:
        result = await ref.wait_load(load_id, 60.0)
        assert result.ok and result.num_blocks == 4, result.error
    for tp_rank in range(TP):
        assert loader_engines[tp_rank].blocks_equal(
            holder_engines[tp_rank], dst, range(4)
        )
    # rank to rank: rank 0's shard differs from rank 1's (different bytes)
    assert not loader_engines[0].blocks_equal(holder_engines[1], dst, range(4))

    # The replica's stats are its ranks' summed.
    stats = await loader.stats()
    assert stats.actor.loads_ok == TP
    loaded = stats.actor.cpu_tier_blocks_loaded + stats.actor.device_tier_blocks_loaded
    assert loaded == TP * 4
    tier = "cpu" if budget_blocks is None else "device"
    assert all(set(shard_for_rank(grant, tp).tiers) == {tier} for tp in range(TP))
    await release_every_rank(TP, release)  # idempotent after the loads' own
    await holder.close()
    await loader.close()


class SquatterActor(xo.StatelessActor):
    """Holds a rank's actor uid, so that creating that rank's actor fails."""


async def test_a_rank_that_cannot_be_created_takes_the_ranks_before_it_down(cluster):
    """Rank 1's uid is taken in the pool: the group is not created, and rank 0's
    actor, created first, is destroyed rather than left mapping nothing."""
    address = cluster.sub_pool(0)
    squatter = await xo.create_actor(
        SquatterActor, address=address, uid=transfer_actor_uid(MODEL, 0, 1)
    )
    config = TransferActorConfig(
        model_uid=MODEL,
        rank=0,
        tracker_address=cluster.tracker_address,
        tracker_uid=tracker_uid(MODEL),
        cpu_capacity_blocks=32,
        rpc_timeout_s=20.0,
        tp_size=TP,
    )
    with pytest.raises(xo.ActorAlreadyExist):
        await TransferActorGroup.create(config, address)
    with pytest.raises(xo.ActorNotExist):
        await xo.actor_ref(address, transfer_actor_uid(MODEL, 0, 0))
    assert await xo.has_actor(squatter)  # the group destroys only its own actors
    await xo.destroy_actor(squatter)


class ClosingRank:
    """A rank's actor ref as ``close`` sees it; ``fails``: its close raises."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails
        self.closed = False

    async def close(self) -> None:
        if self.fails:
            raise ConnectionError("the rank's pool stopped answering")
        self.closed = True


async def test_closing_a_replica_tries_every_rank_and_raises_if_one_failed():
    """The lead's close fails: the other ranks are closed all the same (each
    drains its loads), and the caller learns that the replica did not close."""
    ranks = [ClosingRank(fails=tp == 0) for tp in range(3)]
    with pytest.raises(ConnectionError, match="stopped answering"):
        await TransferActorGroup(ranks).close()
    assert [rank.closed for rank in ranks] == [False, True, True]
    fine = [ClosingRank(fails=False) for _ in range(3)]
    await TransferActorGroup(fine).close()
    assert all(rank.closed for rank in fine)
