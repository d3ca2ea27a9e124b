"""The synchronous fast path's bound in the load runner (``LoadRunner.wait_bounded``
and ``fence``): a holder that stalls costs the engine at most the bound, and no write
of the abandoned load lands in the engine blocks afterwards, whether the transport
scatters on the loop or from a worker thread. Same in-process parts as
``test_parts.py``: a real store, a synthetic engine cache, a fake transport."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch

from .test_parts import (
    FakeTransport,
    ThreadWriteTransport,
    request,
    runner_for,
    staged_holder,
)

BOUND_S = 0.010


async def test_a_stalled_holder_costs_the_bound_and_writes_nothing_afterwards():
    holder, published = await staged_holder(2, device_slots=2)
    grant = holder.leases.grant(published, "lease-s", holder.engine.identity())
    transport = FakeTransport(chunk_rows=1)
    stalled, go_on = asyncio.Event(), asyncio.Event()

    async def stall() -> None:  # the holder stops answering before any chunk
        stalled.set()
        await go_on.wait()

    transport.before_chunk = stall
    runner, target, counters = runner_for(holder, transport)
    before = [target.read_block(b).clone() for b in (3, 7)]
    await runner.start(request(grant, [3, 7]))
    began = time.perf_counter()
    # The test's own deadline: without the bound, the wait would never end.
    result = await asyncio.wait_for(runner.wait_bounded("load-1", BOUND_S), 5.0)
    waited = time.perf_counter() - began
    assert stalled.is_set()
    assert not result.ok and "bound" in (result.error or "")
    assert counters.loads_past_bound == 1
    # the bound plus scheduling noise of a loaded CI host, far below any stall
    assert waited < BOUND_S + 0.5, waited
    # The holder wakes up: the fenced load writes nothing into its blocks.
    go_on.set()
    (task,) = runner.tasks()
    await task
    for block, old in zip((3, 7), before, strict=True):
        assert torch.equal(target.read_block(block), old)
    # Its result is nobody's, its blocks are free and its lease goes back.
    assert runner.finished() == []
    await asyncio.gather(*runner.tasks())
    assert holder.released == ["lease-s"]
    grant2 = holder.leases.grant(published, "lease-t", holder.engine.identity())
    transport.before_chunk = None
    await runner.start(request(grant2, [3, 7], "load-2"))
    assert (await runner.wait_bounded("load-2", 5.0)).ok
    for src, dst in enumerate((3, 7)):
        assert torch.equal(target.read_block(dst), holder.engine.read_block(src))


async def test_a_load_within_its_bound_is_collected_whole():
    holder, published = await staged_holder(2, device_slots=2)
    grant = holder.leases.grant(published, "lease-w", holder.engine.identity())
    runner, target, counters = runner_for(holder, FakeTransport())
    await runner.start(request(grant, [5, 6]))
    result = await runner.wait_bounded("load-1", 5.0)
    # counted: the transport's one call on the holder; the release is not
    # awaited before the result any more
    assert result.ok and result.round_trips == 1
    assert counters.loads_past_bound == 0
    for src, dst in enumerate((5, 6)):
        assert torch.equal(target.read_block(dst), holder.engine.read_block(src))


async def test_the_fence_waits_for_a_write_in_flight_from_a_thread():
    """A copy into the engine blocks already running in a worker thread when the
    bound passes ends before ``fence`` returns, so it cannot overwrite what the
    engine recomputes afterwards; a write not yet begun never happens."""
    holder, published = await staged_holder(2, device_slots=2)
    grant = holder.leases.grant(published, "lease-x", holder.engine.identity())
    transport = ThreadWriteTransport()
    runner, target, _ = runner_for(holder, transport)
    copying, finish_copy = threading.Event(), threading.Event()
    scatter_rows = target.cache.scatter_rows

    def slow_scatter_rows(*args: Any) -> None:  # a long copy, in the thread
        copying.set()
        assert finish_copy.wait(30)
        scatter_rows(*args)

    target.cache.scatter_rows = slow_scatter_rows  # type: ignore[method-assign]
    await runner.start(request(grant, [2, 8]))
    await transport.in_write.wait()
    transport.go_on.set()
    await asyncio.to_thread(copying.wait, 30)
    fencing = asyncio.ensure_future(runner.wait_bounded("load-1", 0.001))
    await asyncio.sleep(0.05)
    assert not fencing.done(), "the fence returned with a write in flight"
    finish_copy.set()
    result = await asyncio.wait_for(fencing, 5.0)
    assert not result.ok
    # it landed before the fence returned
    for src, dst in enumerate((2, 8)):
        assert torch.equal(target.read_block(dst), holder.engine.read_block(src))


async def test_an_asynchronous_load_past_its_deadline_is_cancelled_and_answered():
    """``wait_or_cancel`` (the actor's ``run_load``): a load still running at its
    deadline is stopped at its next chunk, and answered failed once its writes
    are over; nothing lands in its blocks afterwards."""
    holder, published = await staged_holder(2, device_slots=2)
    grant = holder.leases.grant(published, "lease-d", holder.engine.identity())
    transport = FakeTransport(chunk_rows=1)
    go_on = asyncio.Event()

    async def stall() -> None:  # the holder is slow before every chunk
        await go_on.wait()

    transport.before_chunk = stall
    runner, target, counters = runner_for(holder, transport)
    before = [target.read_block(b).clone() for b in (4, 9)]
    await runner.start(request(grant, [4, 9]))
    answer = asyncio.ensure_future(runner.wait_or_cancel("load-1", 0.2))
    await asyncio.sleep(0.5)
    # past the deadline it was asked to stop; it ends at its next chunk
    assert not answer.done()
    go_on.set()
    result = await asyncio.wait_for(answer, 5.0)
    assert not result.ok and "cancelled" in (result.error or "")
    assert counters.loads_cancelled == 1
    for block, old in zip((4, 9), before, strict=True):
        assert torch.equal(target.read_block(block), old)
    assert runner.in_flight == 0 and runner.finished() == []
