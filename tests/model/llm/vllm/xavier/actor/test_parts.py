"""The transfer actor's parts without xoscar: the lease book, the load runner and
staging, in one process with a real store and a synthetic engine cache.

The holder is an in-process object with the calls a loader makes on a holder's
actor (``transport_call``, ``read_cpu_rows``, ``release``); the device-tier
transport is a small fake that reads rows out of the holder's store and hands them
to the runner's scatter in chunks, the way the real ones do.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from xinference.model.llm.vllm.xavier.actor.leases import LeaseBook
from xinference.model.llm.vllm.xavier.actor.loads import LoadRunner
from xinference.model.llm.vllm.xavier.actor.staging import (
    copy_blocks_into_store,
    stage_snapshots,
)
from xinference.model.llm.vllm.xavier.engine.device import DeviceWorkMark
from xinference.model.llm.vllm.xavier.engine.layout import PACKED_KV_LAYOUT
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.stats import (
    ActorCounters,
    LatencyRecorder,
    TransportStats,
)
from xinference.model.llm.vllm.xavier.store.tiered import TieredKVSnapshotStore
from xinference.model.llm.vllm.xavier.transports.cpu_tier import gather_cpu_rows
from xinference.model.llm.vllm.xavier.wire import (
    CPU_TIER,
    DEVICE_TIER,
    LeaseGrant,
    LoadRequest,
    TransportHint,
)

from .._support import EngineSpec, SyntheticEngine

SPEC = EngineSpec(PACKED_KV_LAYOUT, num_layers=3, num_blocks=32)


def keys(n: int, salt: int) -> list[bytes]:
    return hash_full_blocks(list(range(salt, salt + n * 16)), 16, f"parts-{salt}")


class FakeTransport:
    """Reads leased device-tier rows from the holder's store, ``chunk_rows`` at a
    time, and records the hints it was given."""

    # it makes no promise about the buffers it hands to scatter
    guards_scatter_source = False

    def __init__(self, chunk_rows: int = 2) -> None:
        self.chunk_rows = chunk_rows
        self.hints: list[TransportHint | None] = []
        self.before_chunk: Any = None  # awaited before each chunk, if set

    async def load(
        self,
        holder: Any,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[bytes],
        scatter: Any,
        *,
        hint: TransportHint | None = None,
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        self.hints.append(hint)
        rows = await holder("rows", lease_id, list(keys))
        for first in range(0, rows.shape[0], self.chunk_rows):
            if self.before_chunk is not None:
                await self.before_chunk()
            scatter(first, rows[first : first + self.chunk_rows])

    def hint(self, first_rows: Sequence[int | None]) -> TransportHint:
        return TransportHint("epoch-1", tuple(first_rows))

    def holder_ops(self) -> dict[str, Any]:
        return {}

    def stats(self) -> TransportStats:
        return TransportStats()

    async def close(self) -> None:
        return None


class Holder:
    """A holder's actor, in process: its store, a lease book, the holder calls."""

    def __init__(self, engine: SyntheticEngine, device_slots: int) -> None:
        geometry = engine.geometry
        self.engine = engine
        self.store = TieredKVSnapshotStore(
            geometry,
            "cpu",
            device_budget_bytes=device_slots * geometry.block_nbytes,
            cpu_capacity_blocks=16,
        )
        self.clock = [0.0]
        self.counters = ActorCounters()
        self.leases = LeaseBook(
            0,
            engine.identity(),
            self.store,
            FakeTransport(),  # type: ignore[arg-type]
            lease_ttl_s=60.0,
            counters=self.counters,
            clock=lambda: self.clock[0],
        )
        self.released: list[str] = []

    async def transport_call(self, op: str, lease_id: str, keys: list[bytes]) -> Any:
        assert op == "rows"
        rows = self.store.locate_device_rows(lease_id, keys)
        layers = self.engine.spec.num_layers
        index = torch.tensor(
            [r + layer for r in rows for layer in range(layers)], dtype=torch.long
        )
        return self.store.device_rows.index_select(0, index)

    async def read_cpu_rows(self, lease_id: str, keys: list[bytes]) -> Any:
        return gather_cpu_rows(self.store, lease_id, keys)

    async def release(self, lease_id: str) -> None:
        self.released.append(lease_id)
        self.leases.release(lease_id)


async def staged_holder(
    n: int, device_slots: int, salt: int = 1
) -> tuple[Holder, list]:
    engine = SyntheticEngine(SPEC, share=False)
    engine.fill_random(range(n), seed=salt)
    holder = Holder(engine, device_slots)
    published = await stage_snapshots(
        holder.store,
        {k: b for b, k in enumerate(keys(n, salt))},
        engine.cache.layout.dtype,
        functools.partial(copy_blocks_into_store, engine.cache, holder.store),
        holder.counters,
    )
    assert published == keys(n, salt)
    return holder, published


def runner_for(
    holder: Holder, transport: FakeTransport
) -> tuple[LoadRunner, SyntheticEngine, ActorCounters]:
    target = SyntheticEngine(SPEC, share=False)

    async def holders(address: str, rank: int) -> Holder:
        return holder

    counters = ActorCounters()
    runner = LoadRunner(
        1,
        target.cache,
        transport,  # type: ignore[arg-type]
        holders,  # type: ignore[arg-type]
        rpc_timeout_s=5.0,
        counters=counters,
        latency=LatencyRecorder(),
    )
    return runner, target, counters


def request(grant: LeaseGrant, blocks: list[int], load_id: str = "load-1") -> Any:
    return LoadRequest(load_id, grant, "holder", tuple(blocks))


# ---- the lease book ----------------------------------------------------------------


async def test_a_grant_names_tiers_and_carries_the_transports_hint_per_key():
    """Two snapshots fit the device tier, the third was demoted: the hint gives the
    device rows of the first two and nothing for the CPU-tier one."""
    holder, published = await staged_holder(3, device_slots=2)
    grant = holder.leases.grant(published, "lease-a", holder.engine.identity())
    assert grant.keys == tuple(published)
    assert sorted(grant.tiers) == [CPU_TIER, DEVICE_TIER, DEVICE_TIER]
    hint = grant.transport_hint
    assert hint is not None and hint.shared == "epoch-1"
    for tier, row in zip(grant.tiers, hint.per_key, strict=True):
        assert (row is None) == (tier == CPU_TIER)
    truncated = grant.truncated(1)
    assert truncated.transport_hint is not None
    assert truncated.transport_hint.per_key == hint.per_key[:1]


async def test_an_incompatible_requester_is_refused_and_a_miss_grants_nothing():
    holder, published = await staged_holder(2, device_slots=2)
    other = SyntheticEngine(EngineSpec(PACKED_KV_LAYOUT, num_layers=2), share=False)
    with pytest.raises(ValueError, match="cannot share KV"):
        holder.leases.grant(published, "lease-b", other.identity())
    miss = holder.leases.grant(keys(2, salt=9), "lease-c", holder.engine.identity())
    assert miss.keys == () and miss.transport_hint is None
    assert holder.store.stats().active_leases == 0


async def test_a_forgotten_lease_expires_and_unpins_its_snapshots():
    holder, published = await staged_holder(2, device_slots=2)
    holder.leases.grant(published, "lease-d", holder.engine.identity())
    assert holder.store.stats().active_leases == 1
    holder.clock[0] = 30.0
    holder.leases.expire()
    assert holder.store.stats().active_leases == 1
    holder.clock[0] = 61.0
    holder.leases.expire()
    assert holder.store.stats().active_leases == 0
    assert holder.counters.leases_expired == 1


# ---- the load runner -----------------------------------------------------------------


async def test_a_load_brings_both_tiers_into_engine_blocks_and_releases_the_lease():
    holder, published = await staged_holder(4, device_slots=2)
    grant = holder.leases.grant(published, "lease-e", holder.engine.identity())
    transport = FakeTransport()
    runner, target, counters = runner_for(holder, transport)
    dst = [31, 7, 12, 3]
    await runner.start(request(grant, dst))
    result = await runner.wait("load-1", 10)
    assert result.ok, result.error
    for src_block, dst_block in enumerate(dst):
        assert torch.equal(
            target.read_block(dst_block), holder.engine.read_block(src_block)
        )
    assert holder.released == ["lease-e"]
    assert counters.device_tier_blocks_loaded == 2
    assert counters.cpu_tier_blocks_loaded == 2
    (hint,) = transport.hints
    device_positions = [i for i, t in enumerate(grant.tiers) if t == DEVICE_TIER]
    assert grant.transport_hint is not None and hint is not None
    assert hint.per_key == tuple(
        grant.transport_hint.per_key[i] for i in device_positions
    )


async def test_conflicting_destinations_are_refused_and_the_lease_goes_back():
    holder, published = await staged_holder(2, device_slots=2)
    grant = holder.leases.grant(published, "lease-f", holder.engine.identity())
    runner, _, _ = runner_for(holder, FakeTransport())
    with pytest.raises(ValueError, match="conflicting destinations"):
        await runner.start(request(grant, [5, 5]))
    assert holder.released == ["lease-f"]
    assert runner.in_flight == 0


async def test_a_cancelled_load_stops_between_chunks_and_frees_its_blocks():
    """Cancel arrives while the transport waits for its first chunk: the scatter
    refuses every chunk from then on, and the blocks and the lease are free when
    cancel returns."""
    holder, published = await staged_holder(2, device_slots=2)
    grant = holder.leases.grant(published, "lease-g", holder.engine.identity())
    transport = FakeTransport(chunk_rows=1)
    in_chunk, go_on = asyncio.Event(), asyncio.Event()

    async def pause() -> None:
        if not in_chunk.is_set():
            in_chunk.set()
            await go_on.wait()

    transport.before_chunk = pause
    runner, _, counters = runner_for(holder, transport)
    await runner.start(request(grant, [1, 2]))
    await in_chunk.wait()
    cancelling = asyncio.ensure_future(runner.cancel("load-1"))
    await asyncio.sleep(0)
    go_on.set()
    await cancelling
    result = await runner.wait("load-1", 1)
    assert not result.ok and "cancelled" in result.error
    assert counters.loads_cancelled == 1
    assert holder.released == ["lease-g"]
    # the blocks are free again: the same destinations load fine
    grant2 = holder.leases.grant(published, "lease-h", holder.engine.identity())
    transport.before_chunk = None
    await runner.start(request(grant2, [1, 2], "load-2"))
    assert (await runner.wait("load-2", 10)).ok


class ThreadWriteTransport(FakeTransport):
    """Writes its rows from a worker thread, the way a real transfer writes engine
    blocks outside the event loop; the write says when it is in flight and waits
    for ``go_on`` before it lands."""

    def __init__(self) -> None:
        super().__init__()
        self.in_write = asyncio.Event()
        self.go_on = threading.Event()
        self.write_finished = False

    async def load(
        self,
        holder: Any,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[bytes],
        scatter: Any,
        *,
        hint: TransportHint | None = None,
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        rows = await holder("rows", lease_id, list(keys))
        loop = asyncio.get_running_loop()

        def write() -> None:
            loop.call_soon_threadsafe(self.in_write.set)
            if not self.go_on.wait(30):
                raise AssertionError("the test never let the write land")
            scatter(0, rows)
            self.write_finished = True

        await asyncio.to_thread(write)


async def test_a_cancelled_load_task_ends_only_after_its_write_in_flight():
    """The load's own task is cancelled (the actor pool shutting down) while a
    write into its engine blocks runs in a thread: the task keeps the blocks and
    the lease until that write has landed, then raises CancelledError."""
    holder, published = await staged_holder(2, device_slots=2)
    grant = holder.leases.grant(published, "lease-i", holder.engine.identity())
    transport = ThreadWriteTransport()
    runner, target, _ = runner_for(holder, transport)
    await runner.start(request(grant, [4, 9]))
    (task,) = runner.tasks()
    # What had landed when the task ended, captured at that very moment.
    at_end: list[tuple[bool, list[str]]] = []
    task.add_done_callback(
        lambda _: at_end.append((transport.write_finished, list(holder.released)))
    )
    await transport.in_write.wait()
    task.cancel()
    for _ in range(20):  # let the loop deliver the cancellation, several times over
        await asyncio.sleep(0)
    assert not task.done(), "the load ended with its write still in flight"
    assert holder.released == []
    with pytest.raises(ValueError, match="still being written"):
        other = holder.leases.grant(published, "lease-j", holder.engine.identity())
        await runner.start(request(other, [9, 5], "load-2"))
    assert holder.released == ["lease-j"]  # the refused one; ours is still held
    transport.go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert at_end == [(True, ["lease-j", "lease-i"])]
    result = await runner.wait("load-1", 1)
    assert not result.ok and "CancelledError" in result.error
    assert runner.in_flight == 0
    for src_block, dst_block in enumerate([4, 9]):
        assert torch.equal(
            target.read_block(dst_block), holder.engine.read_block(src_block)
        )


# ---- staging -----------------------------------------------------------------------


def stored_rows(store: TieredKVSnapshotStore, key: bytes) -> tuple[str, torch.Tensor]:
    """Tier and rows of a published snapshot, through a short lease."""
    ((tier, first_row, _),) = store.lease("peek", [key])
    rows = store.rows(tier)[first_row : first_row + SPEC.num_layers].clone()
    store.release("peek")
    return tier, rows


def assert_held(holder: Holder, blocks: Sequence[int], held: list, tier: str) -> None:
    """Each of ``held`` is published in ``tier`` with the rows of its engine block."""
    for block, key in zip(blocks, held, strict=True):
        where, rows = stored_rows(holder.store, key)
        assert where == tier, (block, where)
        assert torch.equal(
            rows, holder.engine.cache.gather_snapshots(torch.tensor([block]))
        )


async def stage_more(holder: Holder, blocks: Sequence[int], salt: int) -> list:
    engine = holder.engine
    return await stage_snapshots(
        holder.store,
        {k: b for k, b in zip(keys(len(blocks), salt), blocks, strict=True)},
        engine.cache.layout.dtype,
        functools.partial(copy_blocks_into_store, engine.cache, holder.store),
        holder.counters,
    )


async def test_staging_copies_its_demotions_off_the_event_loop():
    """The transfer actor shares its loop with the model actor, which streams
    tokens: the demotions' device-to-host copy must run in a worker thread, and
    the demoted snapshots then read back whole from the CPU tier."""
    holder, first = await staged_holder(2, device_slots=2)
    store = holder.store
    threads: list[int] = []
    copy_demotions = store.copy_demotions

    def recorded(batch: Any) -> None:
        threads.append(threading.get_ident())
        copy_demotions(batch)

    store.copy_demotions = recorded  # type: ignore[method-assign]
    holder.engine.fill_random(range(2, 4), seed=5)
    assert await stage_more(holder, [2, 3], salt=5) == keys(2, 5)
    assert len(threads) == 1 and threads[0] != threading.get_ident()
    assert_held(holder, [0, 1], first, CPU_TIER)
    assert_held(holder, [2, 3], keys(2, 5), DEVICE_TIER)


async def test_a_failed_demotion_copy_stages_nothing_and_keeps_the_victims():
    holder, first = await staged_holder(2, device_slots=2)
    store = holder.store

    def broken(batch: Any) -> None:
        raise RuntimeError("injected demotion fault")

    store.copy_demotions = broken  # type: ignore[method-assign]
    holder.engine.fill_random(range(2, 4), seed=6)
    with pytest.raises(RuntimeError, match="injected demotion fault"):
        await stage_more(holder, [2, 3], salt=6)
    assert holder.counters.stage_failures == 1
    assert not any(store.contains(k) or store.is_staging(k) for k in keys(2, 6))
    assert_held(holder, [0, 1], first, DEVICE_TIER)
    assert store.stats().cpu_snapshots == 0


async def test_a_failed_snapshot_copy_after_its_demotions_keeps_the_demotions():
    holder, first = await staged_holder(2, device_slots=2)
    store = holder.store

    def broken_copy(staged: Any) -> None:
        raise RuntimeError("injected snapshot copy fault")

    with pytest.raises(RuntimeError, match="injected snapshot copy fault"):
        await stage_snapshots(
            store,
            {k: b for k, b in zip(keys(2, 7), (2, 3), strict=True)},
            holder.engine.cache.layout.dtype,
            broken_copy,
            holder.counters,
        )
    assert not any(store.contains(k) or store.is_staging(k) for k in keys(2, 7))
    assert_held(holder, [0, 1], first, CPU_TIER)
    assert store.stats().device_snapshots == 0


class BufferReusingTransport(FakeTransport):
    """Hands every chunk to scatter in one buffer it overwrites for the next chunk,
    as the real transports do with their receive slabs."""

    def __init__(self, guards: bool) -> None:
        super().__init__(chunk_rows=2)
        self.guards_scatter_source = guards  # type: ignore[misc]

    async def load(
        self,
        holder: Any,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[bytes],
        scatter: Any,
        *,
        hint: TransportHint | None = None,
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        rows = await holder("rows", lease_id, list(keys))
        buffer = torch.empty_like(rows[: self.chunk_rows])
        for first in range(0, rows.shape[0], self.chunk_rows):
            chunk = rows[first : first + self.chunk_rows]
            buffer[: chunk.shape[0]].copy_(chunk)
            scatter(first, buffer[: chunk.shape[0]])


@pytest.mark.parametrize("guards", [True, False])
async def test_chunks_are_waited_for_only_where_the_transport_does_not_guard_them(
    guards: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transport that guards the buffer it hands to scatter (NIXL's slab) gets no
    wait per chunk; any other one a wait after every chunk. CPU-tier chunks (a
    fresh reply each) never wait. Either way the bytes land exactly."""
    waits: list[int] = []
    real_wait = DeviceWorkMark.wait

    def counting_wait(self: DeviceWorkMark) -> None:
        waits.append(1)
        real_wait(self)

    monkeypatch.setattr(DeviceWorkMark, "wait", counting_wait)
    holder, published = await staged_holder(4, device_slots=2)
    grant = holder.leases.grant(published, "lease-k", holder.engine.identity())
    transport = BufferReusingTransport(guards)
    runner, target, counters = runner_for(holder, transport)
    dst = [30, 2, 17, 9]
    await runner.start(request(grant, dst))
    result = await runner.wait("load-1", 10)
    assert result.ok, result.error
    for src_block, dst_block in enumerate(dst):
        assert torch.equal(
            target.read_block(dst_block), holder.engine.read_block(src_block)
        )
    device_chunks = 2 * SPEC.num_layers // transport.chunk_rows  # 2 device-tier keys
    assert len(waits) == (0 if guards else device_chunks)
    assert counters.device_tier_blocks_loaded == counters.cpu_tier_blocks_loaded == 2


class EnginePlacingTransport(FakeTransport):
    """Writes the rows into the destination engine blocks itself, as NIXL engine
    placement does, and never calls scatter; or fails, as a READ can."""

    guards_scatter_source = True

    def __init__(self, cache: Any, fail: bool) -> None:
        super().__init__()
        self.cache = cache
        self.fail = fail

    async def load(
        self,
        holder: Any,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[bytes],
        scatter: Any,
        *,
        hint: TransportHint | None = None,
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        assert dst_block_ids is not None
        if self.fail:
            raise RuntimeError("NIXL READ ended in state ERR")
        rows = await holder("rows", lease_id, list(keys))
        for layer in range(self.cache.num_layers):
            self.cache.scatter(
                layer,
                torch.tensor(list(dst_block_ids), dtype=torch.long),
                rows[layer :: self.cache.num_layers],
            )


@pytest.mark.parametrize("fail", [False, True])
async def test_a_load_the_transport_places_itself_needs_no_scatter(
    fail: bool,
) -> None:
    """Device-tier keys placed by the transport: no scatter, the load ends with
    them; a failing placement fails the load, frees its blocks and its lease."""
    holder, published = await staged_holder(2, device_slots=2)
    grant = holder.leases.grant(published, "lease-l", holder.engine.identity())
    transport = EnginePlacingTransport(None, fail)
    runner, target, counters = runner_for(holder, transport)
    transport.cache = target.cache  # the runner's engine cache
    dst = [11, 4]
    await runner.start(request(grant, dst))
    result = await runner.wait("load-1", 10)
    assert result.ok == (not fail)
    assert holder.released == ["lease-l"]
    assert runner.in_flight == 0
    if fail:
        assert "ERR" in (result.error or "")
        assert counters.loads_failed == 1
        return
    for src_block, dst_block in enumerate(dst):
        assert torch.equal(
            target.read_block(dst_block), holder.engine.read_block(src_block)
        )
