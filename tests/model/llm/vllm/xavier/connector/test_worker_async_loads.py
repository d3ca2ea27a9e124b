"""The worker half's asynchronous path: ``start_load_kv`` posts a load and returns
without waiting on the actor, and ``get_finished`` takes the pushed completions
without any actor call. A load that cannot start, or whose actor stops answering,
still ends as failed blocks reported through ``get_finished``. The "actor" is in
process: the real load runner behind ``run_load`` / ``cancel_load``, with the fake
transport of the actor part tests (the real actor's ``run_load`` is exercised by
``test_worker.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector.step import RequestLoad, StepMetadata
from xinference.model.llm.vllm.xavier.connector.worker import WorkerSettings, WorkerSide
from xinference.model.llm.vllm.xavier.wire import LoadResult

from ..actor.test_parts import request, runner_for, staged_holder
from .test_worker_fast_path import StallingTransport

# far below any stall in these tests, far above a post on a loaded CI host
POST_S = 0.2


class AsyncActor:
    """The loader's transfer actor calls the worker makes on the asynchronous
    path, counted. ``answer`` gates run_load's reply (the actor is slow)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.calls: list[str] = []
        self.answer = asyncio.Event()
        self.answer.set()
        self.refuse: Exception | None = None

    async def run_load(self, req: Any, timeout: float) -> LoadResult:
        self.calls.append("run_load")
        await self.answer.wait()
        if self.refuse is not None:
            raise self.refuse
        await self.runner.start(req)
        result: LoadResult = await self.runner.wait_or_cancel(req.load_id, timeout)
        return result

    async def cancel_load(self, load_id: str) -> None:
        self.calls.append("cancel_load")
        await self.runner.cancel(load_id)


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-worker-async-loads")
    yield background
    background.close()


def worker_with(
    loop: BackgroundLoop, actor: AsyncActor, load_timeout_s: float = 15.0
) -> WorkerSide:
    settings = WorkerSettings(
        model="m",
        num_blocks=32,
        block_size=16,
        load_async=True,
        rpc_timeout_s=0.5,
        load_timeout_s=load_timeout_s,
    )
    worker = WorkerSide(settings, loop, actor_factory=lambda: None)  # type: ignore
    worker._identity = object()  # type: ignore[assignment]  # mapped
    worker._actor = actor
    return worker


@dataclass
class Setup:
    """A holder with ``n`` published snapshots, a lease on them, and a worker
    whose in-process actor loads through ``transport``."""

    holder: Any
    target: Any  # the loader's engine cache
    actor: AsyncActor
    worker: WorkerSide
    grant: Any


def setup(
    loop: BackgroundLoop,
    n: int,
    lease_id: str,
    *,
    answer: bool = True,
    transport: StallingTransport | None = None,
    load_timeout_s: float = 15.0,
) -> Setup:
    holder, published = loop.run(staged_holder(n, device_slots=n), 30)
    runner, target, _ = runner_for(holder, transport or StallingTransport())
    actor = AsyncActor(runner)
    if not answer:
        actor.answer.clear()
    worker = worker_with(loop, actor, load_timeout_s)
    grant = holder.leases.grant(published, lease_id, holder.engine.identity())
    return Setup(holder, target, actor, worker, grant)


def async_step(*loads: tuple[str, Any]) -> StepMetadata:
    return StepMetadata(
        loads=tuple(RequestLoad(req_id, load) for req_id, load in loads),
        load_async=True,
    )


def finished_within(worker: WorkerSide, req_id: str, seconds: float) -> set[int]:
    """Step (``get_finished``) until ``req_id`` is reported; its failed blocks."""
    errors: set[int] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done = worker.get_finished(set())[1] or set()
        errors |= worker.get_block_ids_with_load_errors()
        if req_id in done:
            return errors
        time.sleep(0.01)
    raise AssertionError(f"{req_id} was not reported finished within {seconds} s")


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_start_load_kv_returns_before_the_actor_answers(loop):
    """The actor takes its time to answer: the engine's step is not held up, and
    the load is reported once its completion arrives, with its blocks loaded and
    one call on the actor (no start, no polls)."""
    one = setup(loop, 2, "lease-a", answer=False)
    holder, target, actor, worker, grant = (
        one.holder,
        one.target,
        one.actor,
        one.worker,
        one.grant,
    )
    began = time.perf_counter()
    worker.start_load_kv(async_step(("a", request(grant, [8, 9], "load-a"))))
    assert time.perf_counter() - began < POST_S
    # steps go on while the actor has not answered: nothing is reported yet
    for _ in range(3):
        began = time.perf_counter()
        assert worker.get_finished(set()) == (None, None)
        assert time.perf_counter() - began < POST_S
    loop.run(_set(actor.answer), 5)
    assert finished_within(worker, "a", 10) == set()
    for src, dst in zip((0, 1), (8, 9), strict=True):
        assert torch.equal(target.read_block(dst), holder.engine.read_block(src))
    assert actor.calls == ["run_load"]
    # run_load, and the holder's transport call (the release is not on the path)
    assert worker.take_ended_loads().round_trips == {"a": 2}


def test_a_loads_own_time_ends_when_the_actor_answered_not_when_drained(loop):
    """The benchmark compares remote - local against the load's own time: a
    load whose completion waits on the queue for the next get_finished must
    not count that wait as its own."""
    one = setup(loop, 2, "lease-t", answer=False)
    began = time.monotonic()
    one.worker.start_load_kv(async_step(("t", request(one.grant, [8, 9], "load-t"))))
    time.sleep(0.1)  # the actor is slow: this is the load's own time
    loop.run(_set(one.actor.answer), 5)
    while not one.worker._posted._completions:  # pushed, not drained yet
        time.sleep(0.005)
    answered = time.monotonic() - began
    time.sleep(0.5)  # no step drains it meanwhile
    assert finished_within(one.worker, "t", 10) == set()
    seconds = one.worker.take_ended_loads().seconds
    assert 0.1 <= seconds["t"] <= answered, (seconds, answered)


def test_a_load_the_actor_refuses_is_reported_failed(loop):
    one = setup(loop, 1, "lease-r")
    actor, worker, grant = one.actor, one.worker, one.grant
    actor.refuse = ValueError("conflicting destinations")
    worker.start_load_kv(async_step(("r", request(grant, [3], "load-r"))))
    assert finished_within(worker, "r", 10) == {3}
    # the refusal came from the actor's answer; the cancel is the worker's
    # guard against a start the failed call may have left running
    assert actor.calls == ["run_load", "cancel_load"]


def test_a_load_whose_actor_stops_answering_ends_failed(loop):
    """The actor never answers run_load: past the load deadline plus two RPC
    deadlines the load is cancelled (best effort) and reported failed."""
    one = setup(loop, 1, "lease-h", answer=False, load_timeout_s=0.5)
    actor, worker, grant = one.actor, one.worker, one.grant
    began = time.monotonic()
    worker.start_load_kv(async_step(("h", request(grant, [5], "load-h"))))
    assert finished_within(worker, "h", 10) == {5}
    assert time.monotonic() - began >= 0.5 + 2 * 0.5
    assert actor.calls == ["run_load", "cancel_load"]
    loop.run(_set(actor.answer), 5)


def test_an_aborted_load_is_cancelled_and_reported_once_its_writes_end(loop):
    """vLLM names the aborted request in finished_req_ids: a cancel is posted
    (not waited for), and the request is reported once the load ended; a
    stalled holder's later data lands nowhere."""
    transport = StallingTransport()
    transport.stalled_lease = "lease-x"
    one = setup(loop, 2, "lease-x", transport=transport)
    target, actor, worker, grant = one.target, one.actor, one.worker, one.grant
    before = [target.read_block(b).clone() for b in (6, 7)]
    worker.start_load_kv(async_step(("x", request(grant, [6, 7], "load-x"))))
    began = time.perf_counter()
    assert worker.get_finished({"x"}) == (None, None)  # the load is stalled
    assert time.perf_counter() - began < POST_S
    # Named again: no second cancel. The first may have ended the load by now
    # (nothing was being written), so this call may already report it.
    reported_now = "x" in (worker.get_finished({"x"})[1] or set())
    loop.run(_set(transport.go_on), 5)  # the holder answers; the load stops
    if reported_now:
        errors = worker.get_block_ids_with_load_errors()
    else:
        errors = finished_within(worker, "x", 10)
    assert errors == {6, 7}
    for _ in range(3):  # reported once
        assert worker.get_finished(set()) == (None, None)
    assert actor.calls == ["run_load", "cancel_load"]
    for block, old in zip((6, 7), before, strict=True):
        assert torch.equal(target.read_block(block), old)
    assert worker._loads.in_flight == {}


def test_a_load_posted_after_the_loop_closed_is_reported_failed(loop):
    one = setup(loop, 1, "lease-c")
    actor, worker, grant = one.actor, one.worker, one.grant
    loop.close()
    worker.start_load_kv(async_step(("c", request(grant, [2], "load-c"))))
    assert worker.get_finished(set()) == (None, {"c"})
    assert worker.get_block_ids_with_load_errors() == {2}
    assert actor.calls == []


def test_close_with_a_posted_load_in_flight_does_not_hang(loop):
    """The actor never answers run_load: close cancels the load through the actor
    (best effort, within its deadline) and the loop's close ends the call."""
    one = setup(loop, 1, "lease-z", answer=False)
    actor, worker, grant = one.actor, one.worker, one.grant
    worker.start_load_kv(async_step(("z", request(grant, [1], "load-z"))))
    began = time.monotonic()
    worker.close()
    loop.close(timeout=2.0)
    # two RPC deadlines for the cancel, the loop's own timeout, and slack
    assert time.monotonic() - began < 2 * 0.5 + 2.0 + 1.0
    assert actor.calls == ["run_load", "cancel_load"]
    assert worker._loads.in_flight == {}
