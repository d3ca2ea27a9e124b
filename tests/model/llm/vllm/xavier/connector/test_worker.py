"""The worker half of the connector against real transfer actors, without vLLM.

A real ``nixl://`` pool holds the tracker and the transfer actors (sub-pool
processes); the "engine" is a set of per-layer KV tensors in vLLM's CPU layout, views
of one allocation, in this test process. The actors map them through shared memory
exactly as they map a vLLM worker's cache.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from xinference.model.llm.vllm.xavier.connector.scheduler import (
    BackgroundLoop,
    RequestLoad,
    StepMetadata,
)
from xinference.model.llm.vllm.xavier.connector.totals_report import (
    TotalsReport,
)
from xinference.model.llm.vllm.xavier.connector.worker import WorkerSettings, WorkerSide
from xinference.model.llm.vllm.xavier.engine.device import DeviceWorkMark
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.wire import LoadRequest, StageItem

from ..vllm_support import XavierCluster

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

LAYERS, HEADS, BS, HEAD = 2, 2, 32, 32
NUM_BLOCKS = 24
MODEL = "worker-side-test"
_ranks = itertools.count(10)  # fresh transfer actors per test: each maps once


# One block of every layer: the unit of the staging ring and the store.
SNAPSHOT_NBYTES = LAYERS * HEADS * BS * 2 * HEAD * 2


def engine_cache(seed: int) -> list[torch.Tensor]:
    """Per-layer CPU-layout KV tensors, views of one allocation, random bf16."""
    generator = torch.Generator().manual_seed(seed)
    whole = torch.randn(
        LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HEAD, generator=generator
    ).to(torch.bfloat16)
    return [whole[layer] for layer in range(LAYERS)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[XavierCluster]:
    cluster = XavierCluster(MODEL, num_replicas=2, rpc_timeout_s=5.0)
    yield cluster
    cluster.close()


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-worker-side")
    yield background
    background.close()


class CountingActor:
    """The transfer actor's ref, counting the mapping calls that reach it."""

    def __init__(self, ref: Any) -> None:
        self._ref = ref
        self.map_calls = 0
        self.stage_ring_calls = 0

    async def map_engine_caches(self, *args: Any, **kwargs: Any) -> Any:
        self.map_calls += 1
        return await self._ref.map_engine_caches(*args, **kwargs)

    async def stage_ring(self, *args: Any, **kwargs: Any) -> Any:
        self.stage_ring_calls += 1
        return await self._ref.stage_ring(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ref, name)


def make_worker(
    cluster: XavierCluster,
    loop: BackgroundLoop,
    rank: int,
    load_async: bool = False,
    factory: Any = None,
    counter: list[CountingActor] | None = None,
    staging_ring_blocks: int | None = 64,  # None: the ring sizes itself
    rpc_timeout_s: float = 5.0,
    wrapper: type[CountingActor] = CountingActor,
    gpu_cache_bytes: int | None = None,  # the actor's, and the worker's budget
    step_tokens: int = 0,
) -> WorkerSide:
    import xoscar as xo

    from xinference.model.llm.vllm.xavier.config import transfer_actor_uid

    address = cluster.start_transfer_actor(rank, gpu_cache_bytes=gpu_cache_bytes)

    async def actor() -> Any:
        ref = wrapper(await xo.actor_ref(address, transfer_actor_uid(MODEL, rank)))
        if counter is not None:
            counter.append(ref)
        return ref

    async def plain_actor() -> Any:  # the report's: not counted among the refs
        return await xo.actor_ref(address, transfer_actor_uid(MODEL, rank))

    report = TotalsReport(loop, plain_actor, rpc_timeout_s, delay_s=0.05)
    settings = WorkerSettings(
        model=MODEL,
        num_blocks=NUM_BLOCKS,
        block_size=BS,
        load_async=load_async,
        rpc_timeout_s=rpc_timeout_s,
        load_timeout_s=15.0,
        layout_hint="packed_kv",
        map_retry_s=0.1,
        staging_ring_bytes=(
            None
            if staging_ring_blocks is None
            else staging_ring_blocks * SNAPSHOT_NBYTES
        ),
        step_tokens=step_tokens,
        device_budget_bytes=gpu_cache_bytes or 0,
    )
    worker = WorkerSide(settings, loop, factory or actor)
    report.start(worker.totals)  # as the facade does: the counts feed the metrics
    return worker


def test_the_staging_ring_comes_out_of_the_device_budget(cluster, loop):
    """The worker's ring and the actor's device tier share one device budget: a
    ring sized by itself takes half of a small one, the tier the rest."""
    budget = 64 * SNAPSHOT_NBYTES
    worker = make_worker(
        cluster,
        loop,
        next(_ranks),
        staging_ring_blocks=None,
        gpu_cache_bytes=budget,
        step_tokens=NUM_BLOCKS * BS,
    )
    worker.register_kv_caches(engine_cache(5))
    worker.wait_mapped(60)
    assert worker.staging_ring is not None and worker.staging_ring.num_slots == 32
    stats = loop.run(worker._actor.stats(), 30)
    assert stats.store.device_capacity_blocks == 64 - 32


def test_concurrent_mapping_maps_once(cluster, loop):
    actors: list[CountingActor] = []
    worker = make_worker(cluster, loop, next(_ranks), counter=actors)
    worker._kv_caches = engine_cache(0)

    async def many() -> list[Any]:
        return await asyncio.gather(
            *(worker._ensure_gpu_cache_mapping() for _ in range(8))
        )

    identities = loop.run(many(), 60)
    assert sum(actor.map_calls for actor in actors) == 1
    assert all(identity == identities[0] for identity in identities)
    assert identities[0].model == MODEL
    assert identities[0].geometry.num_layers == LAYERS
    # The actor itself refuses a second mapping, so "once" is not just our counter.
    with pytest.raises(RuntimeError, match="already"):
        loop.run(
            worker._actor.map_engine_caches(
                worker._handles, NUM_BLOCKS, MODEL, BS, "packed_kv"
            ),
            30,
        )


def test_failed_mapping_is_retried(cluster, loop):
    rank = next(_ranks)
    attempts = []
    reached: list[CountingActor] = []

    async def flaky() -> Any:
        import xoscar as xo

        from xinference.model.llm.vllm.xavier.config import transfer_actor_uid

        attempts.append(time.monotonic())
        if len(attempts) == 1:
            raise ConnectionRefusedError("transfer actor not created yet")
        address = cluster.transfer_addresses[rank]
        ref = CountingActor(
            await xo.actor_ref(address, transfer_actor_uid(MODEL, rank))
        )
        reached.append(ref)
        return ref

    worker = make_worker(cluster, loop, rank, factory=flaky)
    worker._kv_caches = engine_cache(1)
    with pytest.raises(ConnectionRefusedError):
        loop.run(worker._ensure_gpu_cache_mapping(), 30)
    assert worker.identity is None
    identity = loop.run(worker._ensure_gpu_cache_mapping(), 60)
    assert worker.identity == identity and len(attempts) == 2
    # the failed attempt never reached an actor; the second mapped once
    assert [actor.map_calls for actor in reached] == [1]


def test_background_mapping_retries_until_the_actor_exists(cluster, loop):
    """The engine registers its caches before the launcher creates the actor."""
    rank = next(_ranks)
    created: list[bool] = []

    async def late() -> Any:
        import xoscar as xo

        from xinference.model.llm.vllm.xavier.config import transfer_actor_uid

        if not created:
            raise LookupError("no transfer actor yet")
        return await xo.actor_ref(
            cluster.transfer_addresses[rank], transfer_actor_uid(MODEL, rank)
        )

    worker = make_worker(cluster, loop, rank, factory=late)
    worker.register_kv_caches(engine_cache(2))
    time.sleep(0.3)
    assert worker.identity is None
    created.append(True)
    assert worker.wait_mapped(30).model == MODEL
    assert worker.take_identity_report() == worker.identity
    assert worker.take_identity_report() is None  # reported once


def test_mapping_after_close_raises(cluster, loop):
    worker = make_worker(cluster, loop, next(_ranks))
    worker._kv_caches = engine_cache(3)
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        loop.run(worker._ensure_gpu_cache_mapping(), 30)


class Pair:
    """A holder worker and a loader worker, both mapped."""

    def __init__(
        self,
        cluster: XavierCluster,
        loop: BackgroundLoop,
        load_async: bool,
        staging_ring_blocks: int = 64,
    ):
        self.holder_rank, self.loader_rank = next(_ranks), next(_ranks)
        self.holder = make_worker(
            cluster,
            loop,
            self.holder_rank,
            load_async,
            staging_ring_blocks=staging_ring_blocks,
        )
        self.loader = make_worker(cluster, loop, self.loader_rank, load_async)
        self.holder_cache = engine_cache(11)
        self.loader_cache = engine_cache(12)
        self.holder.register_kv_caches(self.holder_cache)
        self.loader.register_kv_caches(self.loader_cache)
        self.holder.wait_mapped(60)
        self.loader_identity = self.loader.wait_mapped(60)
        self.cluster = cluster
        self.load_async = load_async

    def stage(
        self, block_ids: list[int], then: Callable[[], None] | None = None
    ) -> list[bytes]:
        """The holder stages ``block_ids`` after a forward; ``then`` runs right
        after ``wait_for_save`` returns, as the engine's next step would."""
        keys = hash_full_blocks(list(range(BS * len(block_ids))), BS, f"ns{block_ids}")
        step = StepMetadata(
            stage=tuple(StageItem(k, b) for k, b in zip(keys, block_ids, strict=True))
        )
        self.holder.wait_for_save(step)
        if then is not None:
            then()
        # Staging runs in the background: wait for the copy, then for the tracker.
        self.holder.wait_for_stagings()
        self.cluster.call(
            self.cluster.transfer_refs[self.holder_rank].wait_tracker_updates()
        )
        return keys

    def reserve(self, keys: list[bytes], lease_id: str) -> Any:
        return self.cluster.call(
            self.cluster.transfer_refs[self.holder_rank].reserve(
                keys, lease_id, self.loader_identity
            )
        )

    def load_step(self, req_id: str, grant: Any, dst: list[int]) -> StepMetadata:
        load = LoadRequest(
            load_id=grant.lease_id,
            grant=grant,
            holder_address=self.cluster.transfer_addresses[self.holder_rank],
            dst_block_ids=tuple(dst),
        )
        return StepMetadata(
            loads=(RequestLoad(req_id, load),), load_async=self.load_async
        )


def block_bytes(cache: list[torch.Tensor], block_id: int) -> list[torch.Tensor]:
    return [layer[block_id].view(torch.int16).clone() for layer in cache]


def assert_same_blocks(pair: Pair, src: list[int], dst: list[int]) -> None:
    for s, d in zip(src, dst, strict=True):
        for a, b in zip(
            block_bytes(pair.holder_cache, s),
            block_bytes(pair.loader_cache, d),
            strict=True,
        ):
            assert torch.equal(a, b)


def test_staged_blocks_load_synchronously_into_the_peer(cluster, loop):
    pair = Pair(cluster, loop, load_async=False)
    keys = pair.stage([3, 5])
    grant = pair.reserve(keys, "lease-sync")
    assert grant.keys == tuple(keys)
    assert not torch.equal(pair.holder_cache[0][3], pair.loader_cache[0][7])
    pair.loader.start_load_kv(pair.load_step("r1", grant, [7, 8]))
    assert_same_blocks(pair, [3, 5], [7, 8])
    assert pair.loader.get_block_ids_with_load_errors() == set()
    assert pair.loader.get_finished(set()) == (None, None)


def test_blocks_reused_right_after_the_step_are_published_as_they_were(cluster, loop):
    """The engine writes the staged blocks again as soon as wait_for_save returns
    (a finished request's blocks zeroed or reused): the snapshots still hold what
    the forward computed, because their copies into the ring came first."""
    pair = Pair(cluster, loop, load_async=False)
    staged = [3, 5, 17, 18, 20]
    computed = {b: block_bytes(pair.holder_cache, b) for b in staged}

    def reuse() -> None:
        for layer in pair.holder_cache:
            layer[staged] = 0

    keys = pair.stage(staged, then=reuse)
    grant = pair.reserve(keys, "lease-reused")
    assert grant.keys == tuple(keys)
    dst = [7, 8, 9, 10, 11]
    pair.loader.start_load_kv(pair.load_step("r-reused", grant, dst))
    assert pair.loader.get_block_ids_with_load_errors() == set()
    for s, d in zip(staged, dst, strict=True):
        for want, got in zip(
            computed[s], block_bytes(pair.loader_cache, d), strict=True
        ):
            assert torch.equal(want, got)


def test_blocks_that_find_no_free_ring_slot_are_skipped_and_counted(cluster, loop):
    """Five blocks for a ring of two: two are staged, whole and right, three are
    skipped (counted) instead of waiting for the actor to free slots; the next
    step, with the slots back, stages again."""
    pair = Pair(cluster, loop, load_async=False, staging_ring_blocks=2)
    keys = pair.stage([3, 5, 17, 18, 20])
    counts = pair.holder.staging_counts
    assert (counts.copied, counts.skipped_ring_full) == (2, 3)
    grant = pair.reserve(keys, "lease-tiny-ring")
    assert grant.keys == tuple(keys[:2])  # the holder has the first two only
    pair.loader.start_load_kv(pair.load_step("r-tiny-ring", grant, [7, 8]))
    assert pair.loader.get_block_ids_with_load_errors() == set()
    assert_same_blocks(pair, [3, 5], [7, 8])
    again = pair.stage([21])
    assert pair.holder.staging_counts.copied == 3
    assert pair.reserve(again, "lease-tiny-ring-2").keys == tuple(again)
    # the counts reach the holder's actor, whose stats feed the metrics
    holder_actor = cluster.transfer_refs[pair.holder_rank]
    deadline = time.monotonic() + 10
    while True:
        counters = cluster.call(holder_actor.stats()).actor
        if counters.worker_staged_blocks == 3:
            break
        assert time.monotonic() < deadline, "the staging counts never arrived"
        time.sleep(0.05)
    assert counters.stage_skipped_ring_full == 3


def test_without_a_ring_nothing_is_staged_and_nothing_waits(cluster, loop):
    pair = Pair(cluster, loop, load_async=False, staging_ring_blocks=0)
    assert pair.holder.staging_ring is None
    keys = pair.stage([3, 5])
    assert pair.holder.staging_counts.skipped_no_ring == 2
    assert pair.reserve(keys, "lease-no-ring").keys == ()


def test_ring_stagings_reach_the_actor_only_once_their_copies_completed(
    cluster, loop, monkeypatch
):
    """On a GPU the copies into the ring are queued on the engine's stream, and the
    actor reads the ring from another process. The engine's thread hands a staging
    over once its copies completed, checked at each step without blocking; it
    blocks for them only when it needs the staging back (``wait_for_stagings``)."""
    completed = [False]
    monkeypatch.setattr(DeviceWorkMark, "done", lambda self: completed[0])
    actors: list[CountingActor] = []
    worker = make_worker(cluster, loop, next(_ranks), counter=actors)
    worker.register_kv_caches(engine_cache(13))
    worker.wait_mapped(60)

    def calls() -> int:
        return sum(actor.stage_ring_calls for actor in actors)

    def stage(block_ids: list[int], namespace: str) -> None:
        keys = hash_full_blocks(list(range(BS * len(block_ids))), BS, namespace)
        items = tuple(StageItem(k, b) for k, b in zip(keys, block_ids, strict=True))
        worker.wait_for_save(StepMetadata(stage=items))

    try:
        stage([1, 2], "handover-a")
        worker.get_finished(set())  # the next step: the copies are still running
        time.sleep(0.3)
        assert calls() == 0
        completed[0] = True
        worker.get_finished(set())  # a step after they completed
        deadline = time.monotonic() + 10
        while calls() < 1:
            assert time.monotonic() < deadline, "the staging was never handed over"
            time.sleep(0.01)
        completed[0] = False
        stage([3], "handover-b")
        time.sleep(0.3)
        assert calls() == 1
        worker.wait_for_stagings()  # waits for the copies, then for the actor
        assert calls() == 2
    finally:
        worker.close()


class NeverStages(CountingActor):
    """A transfer actor that takes ring stagings and never answers: it may still
    be reading their slots when the worker stops waiting."""

    def __init__(self, ref: Any) -> None:
        super().__init__(ref)
        self.ring_slots: list[list[int]] = []

    async def stage_ring(self, keys: Any, slots: Any) -> Any:
        self.stage_ring_calls += 1
        self.ring_slots.append(list(slots))
        await asyncio.sleep(3600)


def test_a_stalled_actor_never_lengthens_a_step(cluster, loop):
    """The actor takes ring stagings and never answers (a stalled actor process):
    every step's wait_for_save still returns at once. Blocks that find the ring
    full are skipped and counted; nothing waits for the actor, whose stagings
    end only at their deadline (3 s; their slots are then retired, so the counts
    below hold either way). Waiting for a free slot, as the write path once did,
    fails the bound at the first full ring."""
    actors: list[CountingActor] = []
    worker = make_worker(
        cluster,
        loop,
        next(_ranks),
        counter=actors,
        staging_ring_blocks=4,
        rpc_timeout_s=3.0,
        wrapper=NeverStages,
    )
    cache = engine_cache(15)
    worker.register_kv_caches(cache)
    worker.wait_mapped(60)
    step_bound_s = 0.5  # generous for a loaded 2-core machine; a wait is 3 s
    try:
        longest = 0.0
        for step in range(12):
            keys = hash_full_blocks(list(range(3 * BS)), BS, f"stalled-{step}")
            items = tuple(StageItem(k, b) for k, b in zip(keys, [1, 2, 3], strict=True))
            started = time.monotonic()
            worker.wait_for_save(StepMetadata(stage=items))
            worker.get_finished(set())
            longest = max(longest, time.monotonic() - started)
        assert longest < step_bound_s
        counts = worker.staging_counts
        # 4 slots: the first step's 3 blocks and one of the second's, then none
        assert (counts.copied, counts.skipped_ring_full) == (4, 32)
        actor = actors[-1]
        assert isinstance(actor, NeverStages)

        def handed_over() -> list[int]:
            return sorted(s for slots in actor.ring_slots for s in slots)

        deadline = time.monotonic() + 10
        while handed_over() != [0, 1, 2, 3]:  # the calls run on the loop
            assert time.monotonic() < deadline, handed_over()
            time.sleep(0.01)
    finally:
        worker.close()  # waits out the stagings' deadline


def test_ring_slots_of_a_staging_that_timed_out_are_never_reused(cluster, loop):
    """The actor did not answer in time: its slots are retired, not handed out
    again (new blocks copied into them would change what the actor may still be
    copying into its store under the old keys). With every slot retired, later
    blocks are skipped, which costs future hits only."""
    actors: list[CountingActor] = []
    worker = make_worker(
        cluster,
        loop,
        next(_ranks),
        counter=actors,
        staging_ring_blocks=2,
        rpc_timeout_s=1.0,
        wrapper=NeverStages,
    )
    worker.register_kv_caches(engine_cache(14))
    worker.wait_mapped(60)

    def stage(block_ids: list[int], namespace: str) -> None:
        keys = hash_full_blocks(list(range(BS * len(block_ids))), BS, namespace)
        items = tuple(StageItem(k, b) for k, b in zip(keys, block_ids, strict=True))
        worker.wait_for_save(StepMetadata(stage=items))

    try:
        stage([1, 2], "retired-a")  # both slots, handed to an actor that hangs
        stage([3], "retired-b")  # the ring is full: skipped at once
        ring = worker.staging_ring
        assert ring is not None
        assert (ring.retired, ring.free_slots) == (0, 0)
        deadline = time.monotonic() + 10
        while ring.retired < 2:  # the first staging's deadline passes
            assert time.monotonic() < deadline, "the staging never timed out"
            worker.get_finished(set())
            time.sleep(0.05)
        stage([4], "retired-c")
        assert (ring.retired, ring.free_slots) == (2, 0)
        counts = worker.staging_counts
        assert (counts.copied, counts.skipped_ring_full) == (2, 2)
        assert counts.ring_slots_retired == 2
        actor = actors[-1]
        assert isinstance(actor, NeverStages)
        assert [sorted(slots) for slots in actor.ring_slots] == [[0, 1]]
    finally:
        worker.close()


def test_async_load_is_reported_finished(cluster, loop):
    pair = Pair(cluster, loop, load_async=True)
    keys = pair.stage([1, 2, 4])
    grant = pair.reserve(keys, "lease-async")
    pair.loader.start_load_kv(pair.load_step("r2", grant, [9, 10, 11]))
    finished: set[str] = set()
    deadline = time.monotonic() + 20
    while "r2" not in finished and time.monotonic() < deadline:
        finished |= pair.loader.get_finished(set())[1] or set()
        time.sleep(0.02)
    assert finished == {"r2"}
    assert pair.loader.get_block_ids_with_load_errors() == set()
    assert_same_blocks(pair, [1, 2, 4], [9, 10, 11])


@pytest.mark.parametrize("load_async", [False, True])
def test_failed_load_names_its_blocks(cluster, loop, load_async):
    """A load whose lease the holder does not know fails; its blocks are reported."""
    pair = Pair(cluster, loop, load_async=load_async)
    keys = pair.stage([6])
    grant = pair.reserve(keys, "lease-real")
    forged = type(grant)(
        "lease-unknown",
        grant.holder_rank,
        grant.keys,
        grant.tiers,
        grant.logical_dtypes,
    )
    pair.loader.start_load_kv(pair.load_step("r3", forged, [12]))
    errors: set[int] = set()
    finished: set[str] = set()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        finished |= pair.loader.get_finished(set())[1] or set()
        errors |= pair.loader.get_block_ids_with_load_errors()
        if errors and (finished or not load_async):
            break
        time.sleep(0.02)
    assert errors == {12}
    if load_async:
        assert finished == {"r3"}


def test_aborted_async_load_is_reported_once_its_writes_end(cluster, loop):
    pair = Pair(cluster, loop, load_async=True)
    keys = pair.stage([13, 14])
    grant = pair.reserve(keys, "lease-abort")
    pair.loader.start_load_kv(pair.load_step("r4", grant, [15, 16]))
    finished: set[str] = set()
    deadline = time.monotonic() + 20
    while "r4" not in finished and time.monotonic() < deadline:
        # vLLM passes the aborted request's id in finished_req_ids.
        finished |= pair.loader.get_finished({"r4"})[1] or set()
        time.sleep(0.02)
    assert finished == {"r4"}
    assert pair.loader._loads.in_flight == {}
