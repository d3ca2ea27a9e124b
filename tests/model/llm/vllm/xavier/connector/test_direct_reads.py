"""Lease-free loads READ by the engine process (``connector/direct_reads.py``),
with real NIXL agents: the holder's in a sub-pool process (a real store served by
the serving transport, generation words published beside its device tier), the
loader's in this process, as the worker half owns it in vLLM's engine process.

A slot reused after the loader learned its location, or a holder stopped in the
middle of a load, must end as failed blocks (vLLM recomputes them), never as
another snapshot's bytes reported loaded, and never as a write that lands after
the engine was told the load ended.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
import xoscar as xo

from xinference.core.metrics import XAVIER_METRICS, lookup
from xinference.core.placement import DEFAULT_UCX_TLS, UCX_MEMTYPE_CACHE
from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector.direct_reads import (
    REPLY_ALLOWANCE_S,
    DirectReads,
    run_lease_free,
)
from xinference.model.llm.vllm.xavier.connector.stale_loads import StaleLoad
from xinference.model.llm.vllm.xavier.connector.step import RequestLoad
from xinference.model.llm.vllm.xavier.connector.totals_report import (
    TotalsReport,
)
from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.layout import detect_layout
from xinference.model.llm.vllm.xavier.stats import ActorCounters, XavierStats
from xinference.model.llm.vllm.xavier.wire import (
    ConnectorTotals,
    KVGeometry,
)

from .._support import CUDA_SKIP
from .direct_holder import (
    HOLDER_RANK,
    HOLDER_UID,
    StoreHolder,
    key,
    lease_free_load,
    reader,
)

pytestmark = pytest.mark.nixl
pytest.importorskip("nixl", reason="NIXL is not installed")

KiB = 1024
GEOMETRY = KVGeometry(
    num_layers=2, layer_block_nbytes=4 * KiB, logical_dtype="bfloat16"
)
ENGINE_BLOCKS = 8


def engine_cache(device: str = "cpu") -> BlockMajorCache:
    """Per-layer bf16 caches (blocks, 2, 16 tokens, 2 heads, 32): 4 KiB a block."""
    tensors = [
        torch.zeros((ENGINE_BLOCKS, 2, 16, 2, 32), dtype=torch.bfloat16, device=device)
        for _ in range(GEOMETRY.num_layers)
    ]
    layout = detect_layout(tensors, ENGINE_BLOCKS, "block_first")
    return BlockMajorCache(tensors, layout)


def block_bytes(cache: BlockMajorCache, block: int) -> set[int]:
    index = torch.tensor([block], dtype=torch.long)
    rows = [cache.gather(layer, index) for layer in range(cache.num_layers)]
    return set(torch.cat(rows).flatten().tolist())


@pytest.fixture
async def holder(request) -> AsyncIterator[tuple[Any, str]]:
    """A holder with 2 device slots, its device tier on the CPU; ``param``: the
    environment of its process, or ``{"device": "cuda"}`` for a tier on a GPU."""
    param = dict(getattr(request, "param", None) or {})
    device = param.pop("device", "cpu")
    pool = await xo.create_actor_pool(
        "127.0.0.1",
        n_process=1,
        external_address_schemes=["nixl"] * 2,
        envs=[param] if param else None,
        auto_recover=False,
    )
    async with pool:
        (address,) = list(pool.sub_processes)
        ref = await xo.create_actor(
            StoreHolder, GEOMETRY, 2, device, address=address, uid=HOLDER_UID
        )
        yield ref, address


async def test_a_lease_free_load_lands_in_the_engine_blocks(holder):
    ref, address = holder
    locations = [await ref.put(i) for i in (3, 4)]
    cache = engine_cache()
    loop, reads = await asyncio.to_thread(reader, address, cache, "test")
    try:
        request = lease_free_load("ok", [3, 4], locations, [5, 2])
        outcome = await asyncio.to_thread(reads.load_now, [request], 5.0)
        assert outcome == {"ok": None}
        assert block_bytes(cache, 5) == {3} and block_bytes(cache, 2) == {4}
        assert reads.loads == 1 and reads.stale == 0
        # what the page and terminate's summary count as this load's hits and bytes
        assert reads.blocks == 2
        assert (
            reads.useful_bytes == 2 * GEOMETRY.num_layers * GEOMETRY.layer_block_nbytes
        )
        assert reads.wire_bytes >= reads.useful_bytes
    finally:
        await asyncio.to_thread(loop.run, reads.close(), 10.0)
        loop.close()


async def test_a_slot_reused_after_its_location_was_published_fails_the_load(holder):
    """The holder reuses the slot (a newer snapshot takes it) after the loader
    learned the location: the READ brings the new snapshot's bytes, and only the
    generation word read back afterwards tells them apart."""
    ref, address = holder
    first, other = [await ref.put(i) for i in (3, 4)]  # the device tier is full
    cache = engine_cache()
    loop, reads = await asyncio.to_thread(reader, address, cache, "test")
    try:
        reused = await ref.put(7)  # demotes 3; 7 takes its device slot
        assert reused[0] == first[0] and reused[1] != first[1]
        stale = lease_free_load("stale", [3], [first], [6])
        fresh = lease_free_load("fresh", [4], [other], [3])
        outcome = await asyncio.to_thread(reads.load_now, [stale, fresh], 5.0)
        assert outcome["stale"] is not None and "changed" in outcome["stale"].describe()
        assert outcome["fresh"] is None and block_bytes(cache, 3) == {4}
        # what would have been reported loaded without the check
        assert block_bytes(cache, 6) == {7}
        assert reads.loads == 2 and reads.stale == 1
        assert reads.blocks == 1  # the fresh one's: the stale load kept none
        # ... and the metrics say so, through the loader's transfer actor
        exported = await asyncio.to_thread(exported_counts, loop, reads)
        seconds = exported.pop("xavier_direct_read_seconds")
        assert exported == {"xavier_direct_reads": 2, "xavier_direct_reads_stale": 1}
        # both loads' own time (READs and word checks), well inside the bound
        assert seconds == pytest.approx(reads.seconds) and 0 < seconds < 10
    finally:
        await asyncio.to_thread(loop.run, reads.close(), 10.0)
        loop.close()


async def test_a_slot_reused_just_before_its_rows_are_read_fails_the_load(holder):
    """The reuse lands once the load is under way, right before its rows are
    READ: a generation word read before the rows would still match; only the
    word read back after them tells."""
    ref, address = holder
    first, _ = [await ref.put(i) for i in (3, 4)]  # the device tier is full
    cache = engine_cache()
    loop, reads = await asyncio.to_thread(reader, address, cache, "test")
    transport = reads._transport
    assert transport is not None
    read_rows = transport.load

    async def reuse_then_read_rows(*args: Any, **kwargs: Any) -> None:
        on_this_loop = await xo.actor_ref(address, HOLDER_UID)
        await on_this_loop.put(7)  # demotes 3; 7 takes its device slot
        await read_rows(*args, **kwargs)

    transport.load = reuse_then_read_rows  # type: ignore[method-assign]
    try:
        request = lease_free_load("raced", [3], [first], [6])
        outcome = await asyncio.to_thread(reads.load_now, [request], 5.0)
        assert isinstance(outcome["raced"], StaleLoad)
        assert "changed" in outcome["raced"].describe()
        assert block_bytes(cache, 6) == {7}  # what the READ brought
    finally:
        await asyncio.to_thread(loop.run, reads.close(), 10.0)
        loop.close()


async def test_a_stale_block_in_the_middle_fails_only_from_itself_on(holder):
    """Load [4, 3, 7] where 3's slot was reused by 7 after the loader learned
    3's location: block 0 (key 4) is verified by its own word and stays
    loaded; block 1 (key 3) is stale; block 2 (key 7) matched but comes after
    the first stale block, which vLLM recomputes from. The report names only
    the stale location, so the loader's mirror forgets just that one."""
    ref, address = holder
    first, other = [await ref.put(i) for i in (3, 4)]
    cache = engine_cache()
    loop, reads = await asyncio.to_thread(reader, address, cache, "test")
    try:
        reused = await ref.put(7)  # 7 takes 3's device slot
        assert reused[0] == first[0]
        load = lease_free_load("mid", [4, 3, 7], [other, first, reused], [1, 2, 3])
        outcome = await asyncio.to_thread(reads.load_now, [load], 5.0)
        assert outcome == {
            "mid": StaleLoad(1, HOLDER_RANK, ((key(3), *first),), num_blocks=3)
        }
        assert outcome["mid"].failed_blocks(load.dst_block_ids) == (2, 3)
        assert block_bytes(cache, 1) == {4}
        assert reads.loads == 1 and reads.stale == 1
        assert reads.blocks == 1  # block 0, before the first stale one
    finally:
        await asyncio.to_thread(loop.run, reads.close(), 10.0)
        loop.close()


async def test_a_holder_whose_meeting_failed_is_met_again_at_a_later_call(holder):
    """The reader's first meeting with the holder fails (its pool did not
    answer yet): the holder is not given up; a later call meets it again, and
    its lease-free loads then run here."""
    ref, address = holder
    location = await ref.put(5)
    cache = engine_cache()
    loop = BackgroundLoop("direct-reads-met-again")
    # per holder link the reader asked for (one per meeting, one per load):
    # whether the holder answers on it
    links: list[bool] = []

    def holder_calls(holder_address: str, rank: int) -> Any:
        answers = bool(links)  # the first meeting's calls fail
        links.append(answers)

        async def call(op: str, *args: Any) -> Any:
            if not answers:
                raise ConnectionRefusedError("the holder's pool is not up yet")
            on_this_loop = await xo.actor_ref(address, HOLDER_UID)
            return await on_this_loop.transport_call(op, *args)

        return call

    reads = DirectReads(loop, cache, "met-again", holder_calls, rpc_timeout_s=10.0)
    try:
        outcomes = []
        deadline = time.monotonic() + 30
        while not outcomes or outcomes[-1] is not None:
            assert time.monotonic() < deadline, (links, outcomes[-1])
            # one engine step: a lease-free load from this holder
            load = lease_free_load(f"step-{len(outcomes)}", [5], [location], [1])
            outcome = await asyncio.to_thread(reads.load_now, [load], 5.0)
            outcomes.append(outcome[load.load_id])
            await asyncio.sleep(0.02)
        assert "has not met the holder" in outcomes[0]
        assert links == [False, True, True]  # failed meeting, meeting, load
        assert block_bytes(cache, 1) == {5}
    finally:
        await asyncio.to_thread(loop.run, reads.close(), 10.0)
        loop.close()


async def test_lease_free_loads_of_a_step_wait_up_to_the_largest_bound(holder):
    """Two lease-free loads in one step, bounded at 20 ms and at 5 s; the second
    takes longer than 20 ms (its READ starts 0.3 s late here). The step waits up
    to the larger bound: the slower load is not failed at the other's bound."""
    ref, address = holder
    locations = [await ref.put(i) for i in (3, 4)]
    cache = engine_cache()
    loop, reads = await asyncio.to_thread(reader, address, cache, "test")
    transport = reads._transport
    assert transport is not None
    read_rows = transport.load

    async def slow_for_the_generous_one(*args: Any, **kwargs: Any) -> None:
        lease_id = args[2]
        if lease_id.endswith("generous"):
            await asyncio.sleep(0.3)
        await read_rows(*args, **kwargs)

    transport.load = slow_for_the_generous_one  # type: ignore[method-assign]
    try:
        tight = lease_free_load("tight", [3], [locations[0]], [5])
        generous = lease_free_load("generous", [4], [locations[1]], [2])
        items = [
            RequestLoad("a", tight, asynchronous=False, bound_s=0.02),
            RequestLoad("b", generous, asynchronous=False, bound_s=5.0),
        ]
        outcomes, rest = await asyncio.to_thread(run_lease_free, reads, items)
        assert rest == []
        assert outcomes == {"tight": None, "generous": None}
        assert block_bytes(cache, 5) == {3} and block_bytes(cache, 2) == {4}
    finally:
        await asyncio.to_thread(loop.run, reads.close(), 10.0)
        loop.close()


# The UCX environment the launch path gives every replica on a CUDA host
# (core/placement.py): only tcp between host buffers of two processes.
LAUNCH_UCX_ON_CUDA = {
    "UCX_TLS": DEFAULT_UCX_TLS,
    "UCX_MEMTYPE_CACHE": UCX_MEMTYPE_CACHE,
}


@pytest.mark.cuda
@CUDA_SKIP
@pytest.mark.parametrize(
    "holder",
    [{"device": "cuda"}, {"device": "cuda", **LAUNCH_UCX_ON_CUDA}],
    indirect=True,
    ids=["ucx-defaults", "launch-ucx"],
)
async def test_a_holder_with_its_device_tier_on_a_gpu_serves_lease_free_loads(
    holder, request, monkeypatch
):
    """The holder's rows are in VRAM, its generation words in host memory: it
    serves the words (so its transfer actor publishes locations), a lease-free
    load of its rows lands in engine blocks on the GPU, and one whose slot was
    reused after the location was learned is failed, not reported loaded. Also
    with the UCX settings of a real launch (both processes): the engine's
    reader must READ host words where only tcp joins host buffers."""
    if "launch-ucx" in request.node.callspec.id:
        for name, value in LAUNCH_UCX_ON_CUDA.items():
            monkeypatch.setenv(name, value)  # the reader's agent, in this process
    ref, address = holder
    assert await ref.serves_generation_words()
    first, other = [await ref.put(i) for i in (3, 4)]  # the device tier is full
    cache = engine_cache("cuda")
    loop, reads = await asyncio.to_thread(reader, address, cache, "test")
    try:
        ok = lease_free_load("ok", [3, 4], [first, other], [5, 2])
        outcome = await asyncio.to_thread(reads.load_now, [ok], 5.0)
        assert outcome == {"ok": None}, outcome
        assert block_bytes(cache, 5) == {3} and block_bytes(cache, 2) == {4}

        reused = await ref.put(7)  # demotes 3; 7 takes its device slot
        assert reused[0] == first[0] and reused[1] != first[1]
        stale = lease_free_load("stale", [3], [first], [6])
        fresh = lease_free_load("fresh", [4], [other], [3])
        outcome = await asyncio.to_thread(reads.load_now, [stale, fresh], 5.0)
        assert isinstance(outcome["stale"], StaleLoad), outcome
        assert "changed" in outcome["stale"].describe()
        assert outcome["fresh"] is None, outcome
        assert block_bytes(cache, 3) == {4}
        assert block_bytes(cache, 6) == {7}  # the bytes the check kept out
        assert reads.loads == 3 and reads.stale == 1
    finally:
        await asyncio.to_thread(loop.run, reads.close(), 10.0)
        loop.close()


class CountingActor:
    """The loader's transfer actor as the counts reach it: its own counters."""

    def __init__(self) -> None:
        self.counters = ActorCounters()

    async def record_connector_totals(self, totals: ConnectorTotals) -> None:
        self.counters.record_connector_totals(totals)


def exported_counts(loop: BackgroundLoop, reads: DirectReads) -> dict[str, float]:
    """The direct-read series the metrics export once the worker reported."""
    actor = CountingActor()

    async def own_actor() -> CountingActor:
        return actor

    report = TotalsReport(loop, own_actor, rpc_timeout_s=5.0, delay_s=0.05)
    report.start(
        lambda: ConnectorTotals(
            direct_reads=reads.loads,
            direct_reads_stale=reads.stale,
            direct_read_seconds=reads.seconds,
        )
    )
    deadline = time.monotonic() + 10
    while actor.counters.direct_reads < reads.loads and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = XavierStats(actor=actor.counters)
    return {
        metric.name: lookup(stats, metric.stat) or 0
        for metric in XAVIER_METRICS
        if metric.name.startswith("xavier_direct_read")
    }


# Over shared memory a READ needs nothing of the holder's process, so stopping it
# stalls nothing; over TCP the holder's UCX must answer, so a stopped holder
# stalls the READ: both agents use TCP here.
TCP_ONLY = {"UCX_TLS": "tcp"}


@pytest.mark.parametrize("holder", [TCP_ONLY], indirect=True)
async def test_a_stopped_holder_costs_the_bound_and_writes_nothing_afterwards(
    holder, monkeypatch
):
    """SIGSTOP the holder's process before the load: ``load_now`` returns within
    the bound (plus the reply allowance and scheduling slack) with the load
    failed; after SIGCONT, whatever the READ still brings lands in the receive
    slab, not in the engine block."""
    monkeypatch.setenv("UCX_TLS", TCP_ONLY["UCX_TLS"])
    ref, address = holder
    (location,) = [await ref.put(5)]
    pid = await ref.pid()
    cache = engine_cache()
    loop, reads = await asyncio.to_thread(reader, address, cache, "test")
    bound_s = 0.02
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            request = lease_free_load("stalled", [5], [location], [1])
            started = time.monotonic()
            outcome = await asyncio.to_thread(reads.load_now, [request], bound_s)
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
        assert outcome["stalled"] is not None
        assert took < bound_s + REPLY_ALLOWANCE_S + 0.1, took
        await asyncio.sleep(0.5)  # the READ, if still posted, completes now
        assert block_bytes(cache, 1) == {0}
    finally:
        await asyncio.to_thread(loop.run, reads.close(), 10.0)
        loop.close()


def test_generation_words_are_planned_one_descriptor_each_within_the_scratch_row():
    from xinference.model.llm.vllm.xavier.transports.nixl.generation_words import (
        words_plan,
    )
    from xinference.model.llm.vllm.xavier.transports.nixl.wire import NixlRegion

    scratch = NixlRegion("DRAM", 1000, 16, 0)  # two words
    words = NixlRegion("DRAM", 5000, 8 * 4, 0)  # four slots
    plan = words_plan(scratch, words, [3, 1])
    assert plan.remote[:, 0].tolist() == [5000 + 24, 5000 + 8]
    assert plan.local[:, 0].tolist() == [1000, 1008]
    assert plan.nbytes == 16
    with pytest.raises(ValueError, match="do not fit"):
        words_plan(scratch, words, [0, 1, 2])
    with pytest.raises(ValueError, match="outside"):
        words_plan(scratch, words, [4])
