"""Loads the worker half cannot finish, and how vLLM learns of them.

A load that never started fails its blocks (vLLM recomputes them); an
asynchronous one is also reported finished in ``get_finished``, or vLLM waits for
its request forever; a synchronous one is not (vLLM never waits for it there).
A synchronous load with no result by its deadline is cancelled on the actor
before its blocks are reported failed: the cancel returns once no write of it can
land any more, so no late write reaches the blocks vLLM recomputes.

The "actor" is in process: the real load runner behind ``start_load`` /
``wait_load`` / ``cancel_load``, with the fake transport of the actor part tests,
whose holder here answers one row at a time, slowly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector.step import RequestLoad, StepMetadata
from xinference.model.llm.vllm.xavier.connector.worker import WorkerSettings, WorkerSide
from xinference.model.llm.vllm.xavier.wire import LoadResult

from ..actor.test_parts import FakeTransport, request, runner_for, staged_holder

# The slow holder's time per row. The load has 4 keys of 3 layers, 12 rows: at
# least 1.2 s, far past the deadlines below (0.3 s, 0.6 s) however loaded the host.
ROW_S = 0.1
LOAD_TIMEOUT_S = 0.3  # the actor's wait for a load gives up after this


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-worker-unfinished-loads")
    yield background
    background.close()


def settings(load_timeout_s: float = 15.0, rpc_timeout_s: float = 5.0) -> Any:
    return WorkerSettings(
        model="m",
        num_blocks=32,
        block_size=16,
        load_async=True,
        rpc_timeout_s=rpc_timeout_s,
        load_timeout_s=load_timeout_s,
    )


def test_a_load_that_never_started_fails_and_only_an_async_one_is_finished(loop):
    """The caches are not mapped yet, so nothing starts: every block of the
    step's loads fails; the asynchronous requests (planned or not) are reported
    finished, the synchronous ones are not."""
    worker = WorkerSide(settings(), loop, actor_factory=lambda: None)  # type: ignore
    holder, published = loop.run(staged_holder(4, device_slots=4), 30)
    identity = holder.engine.identity()
    grants = [
        holder.leases.grant(published[i : i + 2], f"lease-{i}", identity)
        for i in (0, 2)
    ]
    step = StepMetadata(
        loads=(
            RequestLoad("async", request(grants[0], [1, 2], "load-a")),
            RequestLoad(
                "sync", request(grants[1], [3, 4], "load-s"), asynchronous=False
            ),
            RequestLoad("unplanned-async", None, (5,)),
            RequestLoad("unplanned-sync", None, (6,), asynchronous=False),
        ),
        load_async=True,
    )
    worker.start_load_kv(step)
    assert worker.get_block_ids_with_load_errors() == {1, 2, 3, 4, 5, 6}
    assert worker.get_finished(set()) == (None, {"async", "unplanned-async"})
    assert worker.get_finished(set()) == (None, None)  # reported once


class SlowActor:
    """The loader's transfer actor calls of a waited synchronous load.
    ``answers``: False, and ``wait_load`` never answers (the actor stopped)."""

    def __init__(self, runner: Any, answers: bool) -> None:
        self.runner = runner
        self.answers = answers
        self.calls: list[str] = []

    async def start_load(self, req: Any) -> None:
        self.calls.append("start_load")
        await self.runner.start(req)

    async def wait_load(self, load_id: str, timeout: float) -> LoadResult:
        self.calls.append("wait_load")
        if not self.answers:
            await asyncio.Event().wait()
        result: LoadResult = await self.runner.wait(load_id, timeout)
        return result

    async def cancel_load(self, load_id: str) -> None:
        self.calls.append("cancel_load")
        await self.runner.cancel(load_id)


@pytest.mark.parametrize(
    "answers, rpc_timeout_s",
    # the worker's own deadline: LOAD_TIMEOUT_S + rpc_timeout_s; generous where
    # the actor answers, below the load's 1.2 s where it does not
    [(True, 2.0), (False, 0.3)],
    ids=["actor-gives-up", "actor-stops-answering"],
)
def test_a_synchronous_load_past_its_deadline_is_cancelled_before_it_fails(
    loop, answers, rpc_timeout_s
):
    """The actor's wait gives up at the load deadline (TimeoutError), or the actor
    stops answering and the worker's own deadline passes: either way, by the
    time ``start_load_kv`` returns with the blocks failed, the load has been
    cancelled on the actor and no write of it is still running."""
    holder, published = loop.run(staged_holder(4, device_slots=4), 30)
    transport = FakeTransport(chunk_rows=1)

    async def slow_row() -> None:
        await asyncio.sleep(ROW_S)

    transport.before_chunk = slow_row
    runner, _, _ = runner_for(holder, transport)
    actor = SlowActor(runner, answers)
    worker = WorkerSide(
        settings(load_timeout_s=LOAD_TIMEOUT_S, rpc_timeout_s=rpc_timeout_s),
        loop,
        actor_factory=lambda: None,  # type: ignore
    )
    worker._identity = object()  # type: ignore[assignment]  # mapped
    worker._actor = actor
    grant = holder.leases.grant(published, "lease-slow", holder.engine.identity())
    blocks = [10, 11, 12, 13]
    waited = RequestLoad("r", request(grant, blocks, "load-slow"), asynchronous=False)
    worker.start_load_kv(StepMetadata(loads=(waited,), load_async=True))
    assert actor.calls == ["start_load", "wait_load", "cancel_load"]
    assert runner.in_flight == 0  # no write of it can land any more
    assert worker.get_block_ids_with_load_errors() == set(blocks)
    assert worker.get_finished(set()) == (None, None)  # synchronous
