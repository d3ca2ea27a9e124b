"""The worker half's synchronous fast path: one step carries two bounded loads, one
from a holder that stalls. ``start_load_kv`` returns within the bound, reports only
the stalled load's blocks as failed (vLLM recomputes them), and the other request's
blocks are loaded for this step's forward. The "actor" is in process: the real load
runner behind ``load_now`` / ``fence_load``, with the fake transport of the actor
part tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector.step import RequestLoad, StepMetadata
from xinference.model.llm.vllm.xavier.connector.worker import WorkerSettings, WorkerSide
from xinference.model.llm.vllm.xavier.wire import LoadResult

from ..actor.test_parts import FakeTransport, request, runner_for, staged_holder

BOUND_S = 0.010


class StallingTransport(FakeTransport):
    """The fake transport, except that a load under lease ``stalled_lease`` waits
    for ``go_on`` (its holder stopped answering)."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled_lease = ""
        self.go_on = asyncio.Event()

    async def load(
        self, holder: Any, holder_rank: int, lease_id: str, *args: Any, **kwargs: Any
    ) -> None:
        if lease_id == self.stalled_lease:
            await self.go_on.wait()
        await super().load(holder, holder_rank, lease_id, *args, **kwargs)


class InProcessActor:
    """The loader's transfer actor calls the worker makes on the fast path."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.calls: list[str] = []

    async def load_now(self, req: Any, wait_s: float) -> LoadResult:
        self.calls.append("load_now")
        await self.runner.start(req)
        result: LoadResult = await self.runner.wait_bounded(req.load_id, wait_s)
        return result

    async def fence_load(self, load_id: str) -> None:
        self.calls.append("fence_load")
        await self.runner.fence(load_id)


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-worker-fast-path")
    yield background
    background.close()


def worker_with(loop: BackgroundLoop, actor: InProcessActor) -> WorkerSide:
    settings = WorkerSettings(
        model="m",
        num_blocks=32,
        block_size=16,
        load_async=True,
        rpc_timeout_s=5.0,
        load_timeout_s=15.0,
    )
    worker = WorkerSide(settings, loop, actor_factory=lambda: None)  # type: ignore
    worker._identity = object()  # type: ignore[assignment]  # mapped
    worker._actor = actor
    return worker


def bounded(req_id: str, load: Any, bound_s: float) -> RequestLoad:
    return RequestLoad(req_id, load, asynchronous=False, bound_s=bound_s)


def blocks_of(target: Any, blocks: Sequence[int]) -> list[torch.Tensor]:
    return [target.read_block(b).clone() for b in blocks]


def test_a_stalled_holder_costs_the_step_its_bound_and_only_its_own_blocks(loop):
    holder, published = loop.run(staged_holder(4, device_slots=4), 30)
    transport = StallingTransport()
    runner, target, counters = runner_for(holder, transport)
    actor = InProcessActor(runner)
    worker = worker_with(loop, actor)
    identity = holder.engine.identity()
    stalled = holder.leases.grant(published[:2], "lease-stalled", identity)
    good = holder.leases.grant(published[2:], "lease-good", identity)
    transport.stalled_lease = "lease-stalled"
    before = blocks_of(target, [10, 11])
    step = StepMetadata(
        loads=(
            bounded("stuck", request(stalled, [10, 11], "load-stuck"), BOUND_S),
            # generous, so that a loaded CI host cannot make it miss
            bounded("fine", request(good, [20, 21], "load-fine"), 2.0),
        ),
        load_async=True,
    )
    began = time.perf_counter()
    worker.start_load_kv(step)
    took = time.perf_counter() - began
    # the bound plus scheduling noise of a loaded CI host, far below the stall
    assert took < BOUND_S + 0.5, took
    assert worker.get_block_ids_with_load_errors() == {10, 11}
    # the other request's blocks are there for this step's forward
    for src, dst in zip((2, 3), (20, 21), strict=True):
        assert torch.equal(target.read_block(dst), holder.engine.read_block(src))
    # synchronous loads are not reported to vLLM as finished receives
    assert worker.get_finished(set()) == (None, None)
    # counted: one load_now call each, no fence needed (the actor answered)
    assert actor.calls == ["load_now", "load_now"]
    assert worker.take_ended_loads().round_trips == {"stuck": 1, "fine": 2}
    assert counters.loads_past_bound == 1
    # The holder wakes: nothing lands in the failed request's blocks.
    loop.run(_set(transport.go_on), 5)
    loop.run(asyncio.sleep(0.2), 5)
    for block, old in zip((10, 11), before, strict=True):
        assert torch.equal(target.read_block(block), old)


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_a_bounded_load_whose_call_failed_is_fenced_and_recomputed(loop):
    """The call may fail after the actor started the load: the worker fences it
    before it reports the blocks failed (a refused start is fenced harmlessly)."""
    holder, published = loop.run(staged_holder(2, device_slots=2), 30)
    transport = StallingTransport()
    runner, _, _ = runner_for(holder, transport)
    actor = InProcessActor(runner)
    worker = worker_with(loop, actor)
    identity = holder.engine.identity()
    transport.stalled_lease = "lease-busy"
    busy = holder.leases.grant(published, "lease-busy", identity)
    loop.run(runner.start(request(busy, [4, 5], "load-busy")), 5)  # blocks 4, 5
    again = holder.leases.grant(published, "lease-again", identity)
    worker.start_load_kv(
        StepMetadata(
            loads=(bounded("again", request(again, [5, 6], "load-again"), 2.0),),
            load_async=True,
        )
    )
    assert actor.calls == ["load_now", "fence_load"]
    assert worker.get_block_ids_with_load_errors() == {5, 6}
    assert worker.get_finished(set()) == (None, None)
    loop.run(_set(transport.go_on), 5)


def test_a_lease_free_load_never_goes_to_the_actor(loop):
    """A lease-free grant pins nothing on its holder and only the engine
    process's reader checks its generations: with no reader it is reported
    failed (vLLM recomputes it), without an actor call, counted 0 round trips;
    the leased load of the same step still goes through the actor."""
    import dataclasses

    holder, published = loop.run(staged_holder(4, device_slots=4), 30)
    runner, target, _ = runner_for(holder, FakeTransport())
    actor = InProcessActor(runner)
    worker = worker_with(loop, actor)
    identity = holder.engine.identity()
    leased = holder.leases.grant(published[2:], "lease-leased", identity)
    unpinned = dataclasses.replace(
        holder.leases.grant(published[:2], "lease-free-x", identity),
        generations=(2, 2),
    )
    holder.leases.release("lease-free-x")  # nothing stays pinned
    step = StepMetadata(
        loads=(
            bounded("free", request(unpinned, [10, 11], "load-free"), 2.0),
            bounded("leased", request(leased, [20, 21], "load-leased"), 2.0),
        ),
        load_async=True,
    )
    worker.start_load_kv(step)
    assert worker.get_block_ids_with_load_errors() == {10, 11}
    assert actor.calls == ["load_now"]  # the leased one only
    assert worker.take_ended_loads().round_trips == {"free": 0, "leased": 2}
    # and the actor refuses one outright, should it ever be handed one
    with pytest.raises(ValueError, match="lease-free"):
        loop.run(runner.start(request(unpinned, [12, 13], "load-direct")), 5)


class StaleReads:
    """The engine process's reader, as the worker sees it: every lease-free
    load it is handed ends with the outcome scripted for its id."""

    def __init__(self, outcomes: dict[str, Any]) -> None:
        self.outcomes = outcomes

    def prepare(self, holder_rank: int, holder_address: str) -> None:
        pass

    def load_now(self, requests: Sequence[Any], bound_s: float) -> dict[str, Any]:
        return {req.load_id: self.outcomes[req.load_id] for req in requests}


def test_a_stale_lease_free_load_fails_only_from_its_first_stale_block(loop):
    """Block 1 of 4 was found stale (and block 3; block 2 matched): vLLM is told
    blocks 1, 2 and 3 failed, block 0 stays loaded, and the scheduler half gets
    the report with the step's worker metadata; a load that timed out fails
    every block and makes no report (its holder is at fault)."""
    import dataclasses

    from xinference.model.llm.vllm.xavier.connector.stale_loads import StaleLoad

    holder, published = loop.run(staged_holder(6, device_slots=6), 30)
    identity = holder.engine.identity()
    grants = [
        dataclasses.replace(
            holder.leases.grant(keys, f"lease-free-{name}", identity),
            generations=(2,) * len(keys),
        )
        for name, keys in (("stale", published[:4]), ("late", published[4:]))
    ]
    report = StaleLoad.of(grants[0], [3, 1])
    assert report.first == 1 and len(report.stale) == 2
    actor = InProcessActor(runner_for(holder, FakeTransport())[0])
    worker = worker_with(loop, actor)
    worker._direct = StaleReads(  # type: ignore[assignment]
        {"load-stale": report, "load-late": "no result within the bound"}
    )
    step = StepMetadata(
        loads=(
            bounded("stale", request(grants[0], [10, 11, 12, 13], "load-stale"), 2.0),
            bounded("late", request(grants[1], [20, 21], "load-late"), 2.0),
        ),
        load_async=True,
    )
    worker.start_load_kv(step)
    assert worker.get_block_ids_with_load_errors() == {11, 12, 13, 20, 21}
    assert worker.take_stale_loads() == {"stale": report}
    assert worker.take_stale_loads() == {}
    assert actor.calls == []
