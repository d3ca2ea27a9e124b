"""The worker half's mapping of the engine caches when the transfer actor never
answers: each attempt ends at its deadline and the next one starts.

No pool: the actor is an in-process object with the mapping call, which never
answers (the factory may return "a test object with the same coroutine methods").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector.worker import WorkerSettings, WorkerSide

MAP_DEADLINE_S = 0.3
# What an attempt may take beyond its deadline on a loaded machine.
MARGIN_S = 0.5
# The deadline starts when the attempt is scheduled on the loop; the actor's call
# is made in the attempt's first step, a loop iteration later, so the time the
# actor sees can fall short of the deadline by that iteration (CI saw 0.2977 s
# for 0.3 s on a loaded machine).
LOOP_STEP_S = 0.05


class SilentActor:
    """Takes every mapping call and never answers; records what happened to it."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.cancelled: list[float] = []

    async def map_engine_caches(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(time.monotonic())
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(time.monotonic())
            raise
        raise AssertionError("never set")


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-worker-mapping")
    yield background
    background.close()


def test_a_mapping_that_never_answers_is_given_up_at_its_deadline(loop):
    actor = SilentActor()

    async def factory() -> SilentActor:
        return actor

    settings = WorkerSettings(
        model="worker-mapping-test",
        num_blocks=4,
        block_size=16,
        load_async=False,
        rpc_timeout_s=MAP_DEADLINE_S,
        load_timeout_s=1.0,
        map_timeout_s=MAP_DEADLINE_S,
        map_retry_s=0.05,
        layout_hint="packed_kv",
    )
    worker = WorkerSide(settings, loop, factory)
    try:
        caches = torch.zeros(2, 4, 2, 16, 64, dtype=torch.bfloat16)
        worker.register_kv_caches([caches[0], caches[1]])
        with pytest.raises(TimeoutError, match="not mapped"):
            worker.wait_mapped(MAP_DEADLINE_S + MARGIN_S)
        assert worker.identity is None
        # The first attempt was cancelled at its deadline and a second one began.
        assert len(actor.calls) >= 2, "the first mapping attempt never ended"
        first_gave_up = actor.cancelled[0] - actor.calls[0]
        assert MAP_DEADLINE_S - LOOP_STEP_S <= first_gave_up
        assert first_gave_up < MAP_DEADLINE_S + MARGIN_S
    finally:
        worker.close()
