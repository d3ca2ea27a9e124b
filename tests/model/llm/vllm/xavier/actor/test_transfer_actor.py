"""The transfer actor over real pools: two replicas in two processes, real NIXL DRAM.

Each replica is a ``SyntheticEngine`` in this process (standing in for a vLLM
worker) whose KV tensors its transfer actor, in a sub-pool process, maps through
shared memory. Every load below goes holder store -> NIXL or RPC -> loader engine.

The pools are the module's (``shared_cluster``): each test gets a tracker of its
own, and its replicas and tracker are destroyed after it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest
import torch

from xinference.model.llm.vllm.xavier.actor.tracker_updates import net_tracker_change
from xinference.model.llm.vllm.xavier.actor.transfer_actor import TransferActorConfig
from xinference.model.llm.vllm.xavier.config import DEFAULT_TRANSPORT
from xinference.model.llm.vllm.xavier.engine.layout import (
    BLOCK_FIRST_LAYOUT,
    KV_FIRST_LAYOUT,
    PACKED_KV_LAYOUT,
    PACKED_KV_NHD_LAYOUT,
)
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.wire import (
    CPU_TIER,
    DEVICE_TIER,
    LeaseGrant,
    LoadRequest,
    StageItem,
)

from .._support import (
    DEVICES,
    MODEL,
    ON_SHARED_POOLS,
    Cluster,
    EngineSpec,
    SyntheticEngine,
    all_bf16_patterns,
    load_blocks,
    new_id,
    reserve_and_start,
    shared_cluster,
    shared_pools,
    stage_and_register,
)

__all__ = ["shared_cluster", "shared_pools"]  # the fixtures, imported for pytest

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(180)]

SPEC = EngineSpec(PACKED_KV_LAYOUT, num_layers=2, num_blocks=64)


def prompt_keys(n: int, salt: int = 0) -> list[bytes]:
    tokens = [salt * 100_000 + i for i in range(n * SPEC.block_size)]
    return hash_full_blocks(tokens, SPEC.block_size, f"transfer-actor-test-{salt}")


def stage_items(keys: list[bytes], blocks: list[int]) -> list[StageItem]:
    return [StageItem(k, b) for k, b in zip(keys, blocks, strict=True)]


async def leases_released(holder: Any, timeout: float = 10.0) -> bool:
    """Whether the holder's leases all went back within ``timeout``: a load
    reports its result first and releases its lease right after, unawaited."""
    deadline = time.monotonic() + timeout
    while (await holder.stats()).store.active_leases:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def holder_and_loader(
    cluster: Cluster,
    gpu_cache_bytes: int | None = None,
    cpu_capacity_blocks: int = 64,
    spec: EngineSpec = SPEC,
    device: str = "cpu",
    transport: str = DEFAULT_TRANSPORT,
):
    spec = dataclasses.replace(spec, device=device)
    engines = [SyntheticEngine(spec), SyntheticEngine(spec)]
    holder = await cluster.add_replica(
        0, engines[0], gpu_cache_bytes, cpu_capacity_blocks, transport=transport
    )
    loader = await cluster.add_replica(1, engines[1], None, 64, transport=transport)
    return engines, holder, loader


# ---- bit-exact loads ------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "budget_blocks, expected_tiers",
    [
        pytest.param(32, {DEVICE_TIER}, id="device-tier"),
        pytest.param(4, {DEVICE_TIER, CPU_TIER}, id="demoted-to-cpu-tier"),
        pytest.param(None, {CPU_TIER}, id="cpu-tier-only"),
    ],
)
@ON_SHARED_POOLS
async def test_all_bf16_bit_patterns_survive_a_load_from_a_peer_process(
    cluster, budget_blocks, expected_tiers, device
):
    """The 65,536 BF16 patterns fill 16 blocks of the holder's engine; the holder
    stages them (the demoting case keeps 4 on the device tier and demotes 12), the
    loader in another process loads them into other block ids in reverse order."""
    block_nbytes = (
        SPEC.num_layers * SPEC.kv_heads * SPEC.block_size * 2 * SPEC.head_size * 2
    )
    budget = None if budget_blocks is None else budget_blocks * block_nbytes
    (source, target), holder, loader = await holder_and_loader(
        cluster, budget, device=device
    )
    patterns = all_bf16_patterns()
    n = patterns.numel() // source.block_elements()
    assert n == 16
    src_blocks = source.fill_blocks(range(3, 3 + n), patterns)
    keys = prompt_keys(n)
    # Four blocks per step, as an engine would publish them step by step; a new
    # step demotes the previous one when the device tier holds just four.
    for i in range(0, n, 4):
        assert (
            await stage_and_register(
                holder, stage_items(keys[i : i + 4], src_blocks[i : i + 4])
            )
            == 4
        )
    assert await cluster.tracker.num_blocks(0) == n

    dst_blocks = list(range(60, 60 - n, -1))
    grant, result = await load_blocks(
        loader, holder, keys, dst_blocks, target.identity()
    )
    assert result.ok, result.error
    assert result.num_blocks == n and grant.keys == tuple(keys)
    assert set(grant.tiers) == expected_tiers
    loaded = torch.cat([target.read_block(b).reshape(-1) for b in dst_blocks])
    assert torch.equal(loaded.view(torch.int16), patterns.view(torch.int16))

    assert await leases_released(holder)  # released after the load
    holder_stats = await holder.stats()
    if budget_blocks == 4:
        assert holder_stats.store.demotions == 12
    loader_stats = await loader.stats()
    assert loader_stats.actor.device_tier_blocks_loaded == grant.tiers.count(
        DEVICE_TIER
    )
    assert loader_stats.actor.cpu_tier_blocks_loaded == grant.tiers.count(CPU_TIER)
    if DEVICE_TIER in expected_tiers:
        # a real transfer carried them (a NIXL READ, or a copy_to with xoscar)
        assert loader_stats.transport.received_copies >= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "holder_layout, loader_layout",
    [
        (KV_FIRST_LAYOUT, KV_FIRST_LAYOUT),
        (BLOCK_FIRST_LAYOUT, BLOCK_FIRST_LAYOUT),
        (KV_FIRST_LAYOUT, BLOCK_FIRST_LAYOUT),
        (PACKED_KV_NHD_LAYOUT, PACKED_KV_NHD_LAYOUT),
    ],
)
@ON_SHARED_POOLS
async def test_gpu_layouts_load_bit_exact_through_both_tiers(
    cluster, holder_layout, loader_layout, device
):
    """vLLM's GPU layouts, mapped into the transfer actors the way the connector
    maps them (exported tensors, ``map_engine_caches``): the holder's device tier
    holds 4 snapshots, so staging the 16 blocks of BF16 patterns demotes 12 to the
    CPU tier; the loader brings all 16 back into its engine (on the GPU when the
    device is CUDA), bit-exact, also between the two GPU layouts, whose rows hold
    the same bytes."""
    holder_spec = dataclasses.replace(SPEC, layout=holder_layout, device=device)
    loader_spec = dataclasses.replace(SPEC, layout=loader_layout, device=device)
    source, target = SyntheticEngine(holder_spec), SyntheticEngine(loader_spec)
    budget = 4 * source.geometry.block_nbytes
    holder = await cluster.add_replica(0, source, budget, 64)
    loader = await cluster.add_replica(1, target, None, 64)
    patterns = all_bf16_patterns()
    n = patterns.numel() // source.block_elements()
    src_blocks = source.fill_blocks(range(5, 5 + n), patterns)
    keys = prompt_keys(n, salt=11)
    for i in range(0, n, 4):
        staged = await stage_and_register(
            holder, stage_items(keys[i : i + 4], src_blocks[i : i + 4])
        )
        assert staged == 4
    assert (await holder.stats()).store.demotions == n - 4

    dst_blocks = list(range(63, 63 - n, -1))
    grant, result = await load_blocks(
        loader, holder, keys, dst_blocks, target.identity()
    )
    assert result.ok, result.error
    assert set(grant.tiers) == {DEVICE_TIER, CPU_TIER}
    loaded = torch.cat([target.read_block(b).reshape(-1) for b in dst_blocks])
    assert torch.equal(loaded.view(torch.int16), patterns.view(torch.int16))
    assert target.tensors[0].device.type == device


@pytest.mark.parametrize("device", DEVICES)
@ON_SHARED_POOLS
async def test_two_replicas_load_from_each_other_at_the_same_time(cluster, device):
    """Each replica serves the other while loading from it: no deadlock, both
    loads complete and are exact."""
    (a, b), ra, rb = await holder_and_loader(
        cluster, gpu_cache_bytes=1 << 20, device=device
    )
    keys_a, keys_b = prompt_keys(40, salt=1), prompt_keys(40, salt=2)
    a.fill_random(range(40), seed=1)
    b.fill_random(range(40), seed=2)
    assert await stage_and_register(ra, stage_items(keys_a, list(range(40)))) == 40
    assert await stage_and_register(rb, stage_items(keys_b, list(range(40)))) == 40

    (_, into_b), (_, into_a) = await asyncio.wait_for(
        asyncio.gather(
            load_blocks(rb, ra, keys_a[:24], list(range(40, 64)), b.identity()),
            load_blocks(ra, rb, keys_b[:24], list(range(40, 64)), a.identity()),
        ),
        timeout=120,
    )
    assert into_b.ok and into_a.ok, (into_b.error, into_a.error)
    assert into_b.num_blocks == into_a.num_blocks == 24
    assert b.blocks_equal(a, list(range(40, 64)), list(range(24)))
    assert a.blocks_equal(b, list(range(40, 64)), list(range(24)))


# ---- cancellation and close -----------------------------------------------------------

BIG = EngineSpec(PACKED_KV_LAYOUT, num_layers=2, num_blocks=1024)
# The tests below need a load still running when they act on it. Over the xoscar
# path a 600-1000 block load takes a push call per chunk, long enough on CPU; the
# direct NIXL READs finish it before a cancel or close arrives. The transfer
# actor's cancel and close logic is the same for both transports.
SLOW_TRANSPORT = "xoscar"


@ON_SHARED_POOLS
async def test_cancel_mid_load_keeps_blocks_and_lease_until_writes_finish(cluster):
    """A cancelled load stops at its next chunk. Until its in-flight write has
    finished, its destination blocks cannot be given to another load and the
    holder's lease stays; afterwards both are free and a new load works."""
    (source, target), holder, loader = await holder_and_loader(
        cluster,
        gpu_cache_bytes=1 << 30,
        cpu_capacity_blocks=0,
        spec=BIG,
        transport=SLOW_TRANSPORT,
    )
    n = 1000
    keys = prompt_keys(n, salt=3)
    source.fill_random(range(n), seed=3)
    assert await stage_and_register(holder, stage_items(keys, list(range(n)))) == n
    dst = list(range(n))
    _, load_id = await reserve_and_start(loader, holder, keys, dst, target.identity())
    await asyncio.sleep(0.05)
    cancelling = asyncio.create_task(loader.cancel_load(load_id))
    await asyncio.sleep(0.05)
    assert not cancelling.done(), "the load ended before it could be cancelled"
    assert (await holder.stats()).store.active_leases == 1
    with pytest.raises(
        ValueError, match="conflicting destinations.*still being written"
    ):
        await reserve_and_start(loader, holder, keys[:1], dst[:1], target.identity())
    await asyncio.wait_for(cancelling, 60)

    result = await loader.wait_load(load_id, 5)
    assert not result.ok and "cancelled" in result.error
    # The release follows the result, unawaited by the load: it lands shortly.
    deadline = time.monotonic() + 10
    while (await holder.stats()).store.active_leases != 0:
        assert time.monotonic() < deadline, "the cancelled load's lease stayed held"
        await asyncio.sleep(0.05)
    assert (await loader.stats()).actor.loads_cancelled == 1
    # The blocks are free again: the same destinations load fine now.
    _, again = await load_blocks(loader, holder, keys[:8], dst[:8], target.identity())
    assert again.ok, again.error
    assert target.blocks_equal(source, dst[:8], list(range(8)))


@ON_SHARED_POOLS
async def test_close_while_loading_drains_the_load_then_refuses_work(cluster):
    (source, target), holder, loader = await holder_and_loader(
        cluster,
        gpu_cache_bytes=1 << 30,
        cpu_capacity_blocks=0,
        spec=BIG,
        transport=SLOW_TRANSPORT,
    )
    n = 600
    keys = prompt_keys(n, salt=4)
    source.fill_random(range(n), seed=4)
    assert await stage_and_register(holder, stage_items(keys, list(range(n)))) == n
    _, load_id = await reserve_and_start(
        loader, holder, keys, list(range(n)), target.identity()
    )
    await asyncio.sleep(0.05)
    assert (await loader.stats()).in_flight_loads == 1
    # Two concurrent closes share one close.
    await asyncio.wait_for(asyncio.gather(loader.close(), loader.close()), 60)
    result = await loader.wait_load(load_id, 5)
    assert result.ok, result.error  # drained, not abandoned
    assert target.blocks_equal(source, list(range(n)), list(range(n)))
    assert (await holder.stats()).store.active_leases == 0
    stats = await loader.stats()
    assert stats.closed and stats.in_flight_loads == 0
    with pytest.raises(RuntimeError, match="closed"):
        await reserve_and_start(loader, holder, keys[:1], [0], target.identity())
    assert (await holder.stats()).store.active_leases == 0
    await loader.close()  # again: returns at once
    assert 1 not in await cluster.tracker.replicas()


# ---- bad inputs -------------------------------------------------------------------------


@ON_SHARED_POOLS
async def test_bad_inputs_give_clear_errors_and_leave_the_store_consistent(cluster):
    (source, target), holder, loader = await holder_and_loader(cluster, 1 << 20)
    keys = prompt_keys(4, salt=5)
    source.fill_random(range(4), seed=5)
    assert await stage_and_register(holder, stage_items(keys, list(range(4)))) == 4
    me = target.identity()

    def other_geometry(**changes):
        return dataclasses.replace(
            me, geometry=dataclasses.replace(me.geometry, **changes)
        )

    with pytest.raises(ValueError, match="geometry differs"):
        await holder.reserve(
            keys, new_id("lease"), other_geometry(logical_dtype="float16")
        )
    with pytest.raises(ValueError, match="geometry differs"):
        await holder.reserve(
            keys, new_id("lease"), other_geometry(layer_block_nbytes=8192)
        )
    with pytest.raises(ValueError, match="order a block's bytes differently"):
        await holder.reserve(
            keys, new_id("lease"), dataclasses.replace(me, layout=KV_FIRST_LAYOUT)
        )
    with pytest.raises(ValueError, match="model differs"):
        await holder.reserve(
            keys, new_id("lease"), dataclasses.replace(me, model="other")
        )

    # A grant whose recorded dtype is not the engine's is refused at start, and the
    # lease it carried is released on the holder.
    lease_id = new_id("lease")
    grant = await holder.reserve(keys, lease_id, me)
    forged = dataclasses.replace(grant, logical_dtypes=("float16",) * 4)
    with pytest.raises(ValueError, match="logical dtype mismatch"):
        await loader.start_load(
            LoadRequest(new_id("load"), forged, holder.address, (0, 1, 2, 3))
        )
    assert (await holder.stats()).store.active_leases == 0

    # The same destination twice in one load.
    grant = await holder.reserve(keys, new_id("lease"), me)
    with pytest.raises(
        ValueError, match="conflicting destinations: block 9 appears twice"
    ):
        await loader.start_load(
            LoadRequest(new_id("load"), grant, holder.address, (9, 8, 9, 7))
        )
    # A destination outside the engine.
    grant = await holder.reserve(keys, new_id("lease"), me)
    with pytest.raises(ValueError, match="out of range"):
        await loader.start_load(
            LoadRequest(new_id("load"), grant, holder.address, (0, 1, 2, 64))
        )
    assert (await holder.stats()).store.active_leases == 0

    # A key the holder never leased (for each tier): the load fails with the
    # holder's reason, and the lease is still released.
    for tier in (DEVICE_TIER, CPU_TIER):
        lease_id = new_id("lease")
        grant = await holder.reserve(keys[:1], lease_id, me)
        unknown = LeaseGrant(
            lease_id, 0, (keys[0], b"\x01" * 16), (DEVICE_TIER, tier), ("bfloat16",) * 2
        )
        load_id = new_id("load")
        await loader.start_load(LoadRequest(load_id, unknown, holder.address, (20, 21)))
        result = await loader.wait_load(load_id, 60)
        assert not result.ok and "is not held by lease" in result.error, result.error
        assert await leases_released(holder)

    store = (await holder.stats()).store
    assert store.staging_snapshots == 0 and store.device_snapshots == 4
    # And a good load still works afterwards.
    _, result = await load_blocks(loader, holder, keys, [30, 31, 32, 33], me)
    assert result.ok, result.error
    assert target.blocks_equal(source, [30, 31, 32, 33], [0, 1, 2, 3])


# ---- staging ----------------------------------------------------------------------------


@ON_SHARED_POOLS
async def test_a_failing_stage_copy_publishes_nothing(cluster):
    """A stage whose copy fails midway (block 64 does not exist) rolls back every
    key it staged: nothing is visible, nothing is registered, the slots are free."""
    (source, _), holder, _ = await holder_and_loader(cluster, 1 << 20)
    keys = prompt_keys(3, salt=6)
    source.fill_random(range(2), seed=6)
    with pytest.raises(IndexError, match="block id 64 is out of range"):
        await stage_and_register(holder, stage_items(keys, [0, 1, 64]))
    store = (await holder.stats()).store
    assert store.published == 0 and store.staging_snapshots == 0
    assert await cluster.tracker.num_blocks(0) == 0
    grant = await holder.reserve(keys, new_id("lease"), source.identity())
    assert grant.keys == ()  # a miss
    # The same keys stage fine once the input is right.
    assert await stage_and_register(holder, stage_items(keys, [0, 1, 2])) == 3
    assert await cluster.tracker.num_blocks(0) == 3
    assert (
        await stage_and_register(holder, stage_items(keys, [0, 1, 2])) == 0
    )  # already present


@ON_SHARED_POOLS
async def test_a_lease_its_loader_abandoned_expires(cluster):
    """A loader reserved snapshots and died: after lease_ttl_s the holder releases
    the lease itself (on its next reservation), so the snapshots are not pinned
    forever; a fresh lease still works."""
    engine = SyntheticEngine(SPEC)
    holder = await cluster.add_replica(
        0, engine, None, 64, rpc_timeout_s=1.0, lease_ttl_s=1.5
    )
    keys = prompt_keys(2, salt=8)
    engine.fill_random(range(2), seed=8)
    assert await stage_and_register(holder, stage_items(keys, [0, 1])) == 2
    abandoned = await holder.reserve(keys, new_id("lease"), engine.identity())
    assert len(abandoned.keys) == 2
    assert (await holder.stats()).store.active_leases == 1
    await asyncio.sleep(2.0)
    fresh = await holder.reserve(keys[:1], new_id("lease"), engine.identity())
    assert len(fresh.keys) == 1
    stats = await holder.stats()
    assert stats.actor.leases_expired == 1
    assert stats.store.active_leases == 1  # only the fresh one


@ON_SHARED_POOLS
async def test_dropped_snapshots_are_unregistered_from_the_tracker(cluster):
    """A CPU tier of 4 blocks and no device tier: staging 6 drops the 2 oldest."""
    engine = SyntheticEngine(SPEC)
    holder = await cluster.add_replica(0, engine, None, cpu_capacity_blocks=4)
    keys = prompt_keys(6, salt=7)
    engine.fill_random(range(6), seed=7)
    assert await stage_and_register(holder, stage_items(keys[:4], [0, 1, 2, 3])) == 4
    assert await stage_and_register(holder, stage_items(keys[4:], [4, 5])) == 2
    assert await cluster.tracker.num_blocks(0) == 4
    hit = await cluster.tracker.query_prefix(1, keys[2:])
    assert hit is not None and hit.num_blocks == 4
    assert await cluster.tracker.query_prefix(1, keys) is None


def test_queued_tracker_updates_are_sent_as_their_net_change():
    """Updates that queued while one was in flight travel as one: each key ends
    up as its last update left it (the drops of an update precede its adds), and
    a key back where the tracker had it travels not at all."""
    a, b, c, d = prompt_keys(4, salt=11)
    updates = [
        ([a, b], [], [(a, 0, 2), (b, 2, 2)]),
        ([c], [a], [(c, 0, 4)]),  # a dropped to make room for c
        ([a], [b], [(a, 2, 4)]),  # a staged again; b dropped: never reached it
        ([], [d], []),  # d was registered by an earlier send
    ]
    added, dropped, located = net_tracker_change(updates)
    assert added == [c, a]
    assert dropped == [d]
    # each held key's last location; b's went with b, a's first with its drop
    assert located == [(c, 0, 4), (a, 2, 4)]
    # dropped and staged again in one update: registered as it was, newly located
    assert net_tracker_change([([a], [a], [(a, 0, 2)])]) == ([], [], [(a, 0, 2)])
    assert net_tracker_change([]) == ([], [], [])


@ON_SHARED_POOLS
async def test_engine_caches_are_mapped_exactly_once_and_must_match(cluster):
    engine = SyntheticEngine(dataclasses.replace(SPEC, layout=KV_FIRST_LAYOUT))
    actor = await cluster.add_replica(0, engine, None, 8, map_caches=False)
    with pytest.raises(RuntimeError, match="not mapped its engine KV caches"):
        await stage_and_register(actor, stage_items(prompt_keys(1), [0]))
    with pytest.raises(RuntimeError, match="not mapped its engine KV caches"):
        await actor.reserve(prompt_keys(1), new_id("lease"), engine.identity())
    nb, bs = SPEC.num_blocks, SPEC.block_size
    with pytest.raises(ValueError, match="blocks of 16 tokens"):
        await actor.map_engine_caches(engine.handles, nb, MODEL, 32)
    with pytest.raises(ValueError, match="unrecognised KV cache shape"):
        await actor.map_engine_caches(engine.handles, nb + 1, MODEL, bs)
    with pytest.raises(ValueError, match="does not fit layout 'packed_kv'"):
        await actor.map_engine_caches(engine.handles, nb, MODEL, bs, PACKED_KV_LAYOUT)
    # the last failure's cause is kept for the launcher, type and message
    error = (await actor.stats()).mapping_error
    assert error.startswith("ValueError: ") and "does not fit layout" in error
    # Failed attempts left nothing behind: mapping the right caches works, once.
    identity = await actor.map_engine_caches(engine.handles, nb, MODEL, bs)
    assert (await actor.stats()).mapping_error is None
    assert identity == engine.identity()
    assert identity.layout == KV_FIRST_LAYOUT and identity.geometry.block_size == bs
    with pytest.raises(RuntimeError, match="already mapped"):
        await actor.map_engine_caches(engine.handles, nb, MODEL, bs)
    assert (await actor.stats()).mapping_error is None  # still mapped
    # The actor reads through the mapping from this process's tensors.
    engine.fill_random([5], seed=8)
    assert (
        await stage_and_register(actor, stage_items(prompt_keys(1, salt=8), [5])) == 1
    )


@ON_SHARED_POOLS
async def test_a_store_too_large_to_allocate_is_a_mapping_error_with_its_cause(
    cluster,
):
    """A device budget no memory holds fails the mapping with the allocator's own
    message, and the caller in another process gets that message too."""
    engine = SyntheticEngine(SPEC)
    actor = await cluster.add_replica(0, engine, 2**50, 8, map_caches=False)
    with pytest.raises(RuntimeError) as raised:
        await actor.map_engine_caches(
            engine.handles, SPEC.num_blocks, MODEL, SPEC.block_size
        )
    assert "can't allocate memory" in str(raised.value)
    error = (await actor.stats()).mapping_error
    assert error.startswith("RuntimeError: ") and "can't allocate memory" in error


def test_config_is_validated_at_the_edge():
    base = dict(model_uid=MODEL, rank=0, tracker_address="x", tracker_uid="t")
    with pytest.raises(ValueError, match="rank"):
        TransferActorConfig(**{**base, "rank": -1})
    with pytest.raises(ValueError, match="unknown transport"):
        TransferActorConfig(**base, transport="carrier-pigeon")
    with pytest.raises(ValueError, match="rpc_timeout_s"):
        TransferActorConfig(**base, rpc_timeout_s=0)
    with pytest.raises(ValueError, match="gpu_cache_bytes"):
        TransferActorConfig(**base, gpu_cache_bytes=-1)
    with pytest.raises(ValueError, match="cpu_capacity_blocks"):
        TransferActorConfig(**base, cpu_capacity_blocks=-1)
