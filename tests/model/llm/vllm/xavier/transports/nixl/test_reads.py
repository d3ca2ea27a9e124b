"""How ``ReadWaiter`` waits for a READ: spinning on the event loop for as long as
the READ's bytes should take, then polling with yields. A fake agent stands in for
NIXL: its READs finish a set time after they are posted."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from xinference.model.llm.vllm.xavier.transports.nixl import reads
from xinference.model.llm.vllm.xavier.transports.nixl.plan import ReadPlan
from xinference.model.llm.vllm.xavier.transports.nixl.reads import (
    DEST_SLAB,
    ReadWaiter,
)

MIB = 1024 * 1024


class TimedAgent:
    """NIXL's agent calls that ``ReadWaiter`` makes; a READ is DONE
    ``duration_s`` after ``transfer`` posted it."""

    def __init__(self, duration_s: float) -> None:
        self.duration_s = duration_s
        self.posted_at = 0.0
        self.released: list[Any] = []

    def get_xfer_descs(self, table: np.ndarray, mem_type: str) -> Any:
        return (mem_type, table.shape[0])

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str) -> Any:
        return object()

    def transfer(self, handle: Any) -> str:
        self.posted_at = time.perf_counter()
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        done = time.perf_counter() - self.posted_at >= self.duration_s
        return "DONE" if done else "PROC"

    def release_xfer_handle(self, handle: Any) -> None:
        self.released.append(handle)


def plan_of(nbytes: int) -> ReadPlan:
    one = np.array([[0, nbytes, 0]], dtype=np.uint64)
    return ReadPlan(local=one, remote=one.copy(), nbytes=nbytes)


async def polls_of_a_read(nbytes: int) -> list[str]:
    """READ ``nbytes`` from an agent that takes 20 ms; "polled" once if the READ
    outlasted its spin (``ReadWaiter._wait``), nothing if it ended within it."""
    agent = TimedAgent(duration_s=0.020)

    async def retire(destination: str) -> None:
        return None

    async def free(hold: Any) -> None:
        return None

    waiter = ReadWaiter(agent, (RuntimeError,), retire, free)
    original = waiter._wait
    polled: list[str] = []

    async def recording_wait(*args: Any, **kwargs: Any) -> None:
        polled.append("polled")
        await original(*args, **kwargs)

    waiter._wait = recording_wait  # type: ignore[method-assign]
    await waiter.read(
        "peer",
        plan_of(nbytes),
        local_mem_type="VRAM",
        remote_mem_type="VRAM",
        timeout_s=5.0,
        destination=DEST_SLAB,
    )
    assert len(agent.released) == 1  # ended either way, its handle released
    return polled


@pytest.fixture
def scaled_spin(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Spins scaled up to tens of milliseconds, so that a busy machine cannot blur
    them: no fixed part, and 12 MiB take 60 ms at the spin's rate."""
    monkeypatch.setattr(reads, "SPIN_POLL_S", 0.0)
    monkeypatch.setattr(reads, "SPIN_BYTES_PER_S", 12 * MIB / 0.060)
    monkeypatch.setattr(reads, "SPIN_MAX_S", 1.0)
    return monkeypatch


@pytest.mark.asyncio
async def test_a_large_read_ends_within_a_spin_as_long_as_its_bytes_take(
    scaled_spin: pytest.MonkeyPatch,
) -> None:
    assert await polls_of_a_read(12 * MIB) == []  # no task, no event loop turn


@pytest.mark.asyncio
async def test_a_small_read_that_outlasts_its_spin_is_polled_to_its_end(
    scaled_spin: pytest.MonkeyPatch,
) -> None:
    assert await polls_of_a_read(8 * 1024) == ["polled"]  # a spin of 40 us


@pytest.mark.asyncio
async def test_a_spin_never_outlasts_its_cap(scaled_spin: pytest.MonkeyPatch) -> None:
    scaled_spin.setattr(reads, "SPIN_MAX_S", 0.001)
    assert await polls_of_a_read(12 * MIB) == ["polled"]  # its bytes: 60 ms
