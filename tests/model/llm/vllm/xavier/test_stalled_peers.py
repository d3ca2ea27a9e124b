"""Every wait on a peer ends at its deadline when the peer stops answering.

The peer is a real process, stopped with SIGSTOP (every thread of it, UCX's
progress thread included): it keeps its sockets open and never answers, the way a
wedged replica looks from outside. Each test bounds the failure by the deadline
under test plus ``MARGIN_S``, which is smaller than ``BackgroundLoop.run``'s
one-second backstop, so a missing deadline fails the test rather than hiding
behind another wait. Each test then lets the peer run again and checks that what
the wait held (destination blocks, the holder's lease, a receive slab) is free.

Deadlines covered here: a load's device-tier transfer (xoscar push, NIXL READ) and
its lease release, the CPU-tier read, the transfer actor's tracker calls, and the
holder's ``copy_to`` into a loader's slab. The tracker query and the reservation
are covered in ``connector/test_scheduler.py``, the mapping in
``connector/test_worker.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import pytest
import pytest_asyncio
import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor, tracker_uid
from xinference.model.llm.vllm.xavier.transports.xoscar.gpu_transfer import (
    GPUTransfer,
    PushRequest,
)
from xinference.model.llm.vllm.xavier.wire import KVGeometry, LoadRequest, StageItem

from ._support import (
    MODEL,
    Cluster,
    EngineSpec,
    SyntheticEngine,
    load_blocks,
    new_id,
    wait_until_stopped,
)

# One pool for the module: starting four sub-pool processes costs more than the
# tests themselves.
pytestmark = [
    pytest.mark.nixl,
    pytest.mark.timeout(180),
    pytest.mark.asyncio(loop_scope="module"),
]

# A deadline short enough for CI and long enough for a loaded 2-core machine to
# answer a live peer within it (a first NIXL registration takes about a second).
DEADLINE_S = 3.0
# What a wait may take beyond its deadline: scheduling and the actor call's own
# bookkeeping. Below BackgroundLoop.run's backstop (deadline + 1 s) on purpose.
MARGIN_S = 0.5
# A NIXL READ from a SIGSTOPped holder must need the holder: over TCP, UCX needs
# its threads to serve the READ (over shared memory it would not). Only that
# holder's process is TCP-only; the others keep UCX's defaults.
TCP_ONLY = {"UCX_TLS": "tcp"}
SPEC = EngineSpec("packed_kv", num_layers=2, num_blocks=32)


class ProcessProbe(xo.StatelessActor):
    """Says which process its pool runs in."""

    def pid(self) -> int:
        return os.getpid()


class PushEnd(xo.StatelessActor):
    """One end of the xoscar transport's row push, with a short copy deadline."""

    def __init__(self, geometry: KVGeometry, copy_timeout_s: float) -> None:
        super().__init__()
        self._geometry = geometry
        self._copy_timeout_s = copy_timeout_s
        rows = (4 * geometry.num_layers, geometry.layer_block_nbytes)
        gen = torch.Generator().manual_seed(5)
        self.source_rows = torch.randint(0, 256, rows, generator=gen).to(torch.uint8)

    async def __post_create__(self) -> None:
        self.transfer = GPUTransfer(
            self.address, "cpu", self._geometry, copy_timeout_s=self._copy_timeout_s
        )

    def small_dest(self) -> tuple[int, Any]:
        size = self.transfer.small_bytes
        return size, self.transfer.recv_refs[size]

    def received(self, num_rows: int) -> bytes:
        size = self.transfer.small_bytes
        view = self.transfer.recv_views[size][
            : num_rows * self._geometry.layer_block_nbytes
        ]
        return view.numpy().tobytes()

    def source(self, rows: list[int]) -> bytes:
        return self.source_rows[rows].numpy().tobytes()

    async def serve(self, req: PushRequest, rows: list[int]) -> None:
        await self.transfer.serve_push(req, self.source_rows, rows)


# The module pool's sub-pool processes, in order.
PROCESSES = ("holder", "loader", "tracker", "tcp-holder")


@dataclasses.dataclass
class World:
    """One sub-pool process per role in ``PROCESSES``; the tracker runs in its own
    so that it can be stopped."""

    main_address: str
    tracker: Any
    addresses: dict[str, str]
    pids: dict[str, int]

    def cluster(self, holder_process: str) -> Cluster:
        """Replica 0 in ``holder_process``, replica 1 in the loader's."""
        cluster = Cluster(
            [
                self.main_address,
                self.addresses[holder_process],
                self.addresses["loader"],
            ],
            self.tracker,
        )
        cluster.tracker_address = self.addresses["tracker"]
        return cluster


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world() -> AsyncIterator[World]:
    pool = await xo.create_actor_pool(
        "127.0.0.1",
        n_process=len(PROCESSES),
        external_address_schemes=["nixl"] * (len(PROCESSES) + 1),
        envs=[TCP_ONLY if name == "tcp-holder" else {} for name in PROCESSES],
        auto_recover=False,
    )
    async with pool:
        addresses = dict(zip(PROCESSES, pool.sub_processes, strict=True))
        pids = {}
        for name, address in addresses.items():
            probe = await xo.create_actor(ProcessProbe, address=address, uid="probe")
            pids[name] = await probe.pid()
        tracker = await xo.create_actor(
            BlockTrackerActor, address=addresses["tracker"], uid=tracker_uid(MODEL)
        )
        yield World(pool.external_address, tracker, addresses, pids)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process is stopped (every thread of it) inside the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until_stopped(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def ends_within(call: Awaitable[Any], bound_s: float) -> tuple[Any, float]:
    """(result or exception, seconds taken) of ``call``; fails the test if it is
    still waiting after ``bound_s`` (it is then cancelled)."""
    task = asyncio.ensure_future(call)
    started = time.monotonic()
    done, _ = await asyncio.wait({task}, timeout=bound_s)
    elapsed = time.monotonic() - started
    if not done:
        task.cancel()
        pytest.fail(f"still waiting on a stopped peer after {elapsed:.2f} s")
    exc = task.exception()
    return (exc if exc is not None else task.result()), elapsed


async def eventually(check: Any, bound_s: float) -> None:
    """Poll the coroutine function ``check`` until it returns True, at most
    ``bound_s`` seconds."""
    deadline = time.monotonic() + bound_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"{check.__name__} still false after {bound_s} s")
        await asyncio.sleep(0.05)


def prompt_keys(n: int, salt: int) -> list[bytes]:
    tokens = [salt * 100_000 + i for i in range(n * SPEC.block_size)]
    return hash_full_blocks(tokens, SPEC.block_size, f"stalled-peers-{salt}")


def stage_items(keys: list[bytes], blocks: list[int]) -> list[StageItem]:
    return [StageItem(k, b) for k, b in zip(keys, blocks, strict=True)]


@contextlib.asynccontextmanager
async def replicas(
    world: World, transport: str, holder_budget: int | None, holder_process: str
) -> AsyncIterator[tuple[list[SyntheticEngine], Any, Any]]:
    """Replica 0 (the holder) and 1 (the loader), destroyed on the way out so that
    the next test of the module can create its own."""
    engines = [SyntheticEngine(SPEC), SyntheticEngine(SPEC)]
    cluster = world.cluster(holder_process)
    refs = [
        await cluster.add_replica(
            rank,
            engines[rank],
            holder_budget if rank == 0 else None,
            32,
            rpc_timeout_s=DEADLINE_S,
            # A lease outlives one load's waits; expiry is not what frees it here.
            lease_ttl_s=60.0,
            transport=transport,
        )
        for rank in (0, 1)
    ]
    try:
        yield engines, refs[0], refs[1]
    finally:
        for ref in refs:
            await xo.destroy_actor(ref)


@pytest.mark.parametrize(
    "transport, device_tier_blocks, holder_process",
    [
        pytest.param("xoscar", 32, "holder", id="xoscar-push"),
        pytest.param("nixl", 32, "tcp-holder", id="nixl-read"),
        pytest.param("nixl", None, "holder", id="cpu-tier-read"),
    ],
)
async def test_a_load_from_a_stopped_holder_fails_in_time_and_frees_all(
    world, transport, device_tier_blocks, holder_process
):
    """The holder stops after granting: the transfer misses its deadline, the
    release misses its own, and the load fails after those two waits. Once the
    holder runs again its lease is gone and the same destination blocks take the
    same snapshots, bit-exact."""
    block_nbytes = SyntheticEngine(SPEC, share=False).geometry.block_nbytes
    budget = None if device_tier_blocks is None else device_tier_blocks * block_nbytes
    async with replicas(world, transport, budget, holder_process) as (
        (source, target),
        holder,
        loader,
    ):
        source.fill_random(range(8), seed=3)
        keys = prompt_keys(8, salt=3)
        assert await holder.stage(stage_items(keys, list(range(8)))) == 8

        # Loads that meet the holder (actor ref, NIXL agents and registrations)
        # while it answers; on a loaded machine the very first may miss the
        # deadline, which is not what this test is about.
        async def warm_load() -> bool:
            _, warm = await load_blocks(
                loader, holder, keys[:2], [30, 31], target.identity()
            )
            return bool(warm.ok)

        await eventually(warm_load, 60)
        await eventually(warm_load, 60)
        failures_before = (await loader.stats()).actor.lease_release_failures

        dst = [10, 11, 12, 13]
        grant = await holder.reserve(keys[4:], new_id("lease"), target.identity())
        assert len(grant.keys) == 4
        load_id = new_id("load")
        with stopped(world.pids[holder_process]):

            async def start_and_wait() -> Any:
                # timed from the start: the deadline runs from the READ's post,
                # inside start_load
                await loader.start_load(
                    LoadRequest(load_id, grant, holder.address, tuple(dst))
                )
                return await loader.wait_load(load_id, 60)

            # the transfer's deadline (the result is recorded before the release,
            # which is not awaited)
            result, elapsed = await ends_within(start_and_wait(), DEADLINE_S + MARGIN_S)
            assert not isinstance(result, BaseException), repr(result)
            assert not result.ok, "a load from a stopped holder cannot succeed"
            assert elapsed >= DEADLINE_S, f"failed after {elapsed:.2f} s"
            assert (await loader.stats()).in_flight_loads == 0

            async def release_failed() -> bool:
                # then the release's own deadline, the holder still stopped
                stats = await loader.stats()
                return stats.actor.lease_release_failures == failures_before + 1

            await eventually(release_failed, DEADLINE_S + MARGIN_S)

        async def lease_gone() -> bool:
            # The release that timed out was on the wire; the holder serves it now.
            return (await holder.stats()).store.active_leases == 0

        await eventually(lease_gone, 10)

        async def reloads_the_same_blocks() -> bool:
            # A NIXL READ that missed its deadline is parked until it ends; loads
            # from that holder are refused until then.
            _, again = await load_blocks(
                loader, holder, keys[4:], dst, target.identity()
            )
            return bool(again.ok)

        await eventually(reloads_the_same_blocks, 10)
        assert target.blocks_equal(source, dst, [4, 5, 6, 7])


async def test_staging_with_a_stopped_tracker_does_not_wait_for_it(world):
    """Staging returns once the blocks are copied: telling the tracker happens
    afterwards, in the background, and gives up at the actor's deadline (counted).
    Once the tracker runs again, the next staging reaches it."""
    async with replicas(world, "nixl", None, "holder") as ((source, _), holder, _):
        source.fill_random(range(4), seed=6)
        keys = prompt_keys(4, salt=6)
        failures_before = (await holder.stats()).actor.tracker_failures
        with stopped(world.pids["tracker"]):
            staged, _ = await ends_within(
                holder.stage(stage_items(keys[:2], [0, 1])), MARGIN_S
            )
            assert staged == 2, repr(staged)
            told, elapsed = await ends_within(
                holder.wait_tracker_updates(), DEADLINE_S + MARGIN_S
            )
            assert not isinstance(told, BaseException), repr(told)
            assert elapsed >= DEADLINE_S - MARGIN_S, f"gave up after {elapsed:.2f} s"
        assert (await holder.stats()).actor.tracker_failures == failures_before + 1
        # The tracker runs again and the replica keeps staging and telling it.
        assert await holder.stage(stage_items(keys[2:], [2, 3])) == 2
        await holder.wait_tracker_updates()
        assert (await holder.stats()).actor.tracker_failures == failures_before + 1


async def test_a_push_into_a_stopped_loader_times_out_and_recovers(world):
    """The holder's ``copy_to`` into the loader's slab gives up at its deadline;
    once the loader runs again, a push into the same slab lands bit-exact."""
    geometry = KVGeometry(
        num_layers=2, layer_block_nbytes=4096, logical_dtype="bfloat16"
    )
    holder, loader = [
        await xo.create_actor(
            PushEnd, geometry, DEADLINE_S, address=world.addresses[role], uid=role
        )
        for role in ("holder", "loader")
    ]
    try:
        size, dest = await loader.small_dest()
        rows = [7, 2, 5]  # rows of the holder's source, in the order asked
        req = PushRequest("lease-x", (b"k" * 16, b"l" * 16), 0, 3, size, dest)
        with stopped(world.pids["loader"]):
            outcome, _ = await ends_within(
                holder.serve(req, rows), DEADLINE_S + MARGIN_S
            )
        assert isinstance(outcome, TimeoutError), repr(outcome)
        await holder.serve(req, rows)
        assert await loader.received(3) == await holder.source(rows)
    finally:
        await xo.destroy_actor(holder)
        await xo.destroy_actor(loader)
