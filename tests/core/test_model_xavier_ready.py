"""Waiting for the Xavier mapping at launch: a refused mapping ends the wait with
its cause.

A user launched with a device budget the transfer actor could not allocate; the
launch waited the full two minutes and the CLI said only that the connector "did
not map the engine KV cache", while the cause sat in an engine log as
``RuntimeError()``. The transfer actor now keeps the cause of its last failed
mapping in its stats, and the wait reports it at once.
"""

from __future__ import annotations

import time

import pytest

from xinference.core.messages import ReplicaSpec
from xinference.core.model import ReplicaModelActor
from xinference.core.options import EngineOptions
from xinference.model.llm.vllm.xavier.stats import StoreStats, XavierStats

CAUSE = "RuntimeError: DefaultCPUAllocator: can't allocate memory"


class _Engine:
    def __init__(self) -> None:
        self.warm_ups = 0

    async def warm_up(self) -> None:
        self.warm_ups += 1


class _Transfer:
    """A transfer actor whose answers are scripted, one per ``stats`` call (the
    last one repeats)."""

    def __init__(self, *answers: XavierStats) -> None:
        self._answers = list(answers)

    async def stats(self) -> XavierStats:
        return self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]


def replica(transfer: _Transfer) -> ReplicaModelActor:
    actor = ReplicaModelActor(ReplicaSpec("m", 0, 2, "/models/m", EngineOptions()))
    actor._engine = _Engine()  # type: ignore[assignment]
    actor._transfer = transfer
    return actor


async def test_a_refused_mapping_ends_the_wait_with_its_cause():
    actor = replica(_Transfer(XavierStats(), XavierStats(mapping_error=CAUSE)))
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        await actor.wait_xavier_ready(timeout_s=30)
    assert time.monotonic() - started < 5  # not the whole timeout
    assert str(raised.value) == (
        "replica 0: the Xavier connector could not map the engine KV cache into "
        f"its transfer actor: {CAUSE}"
    )


async def test_a_mapping_that_succeeds_ends_the_wait():
    actor = replica(_Transfer(XavierStats(), XavierStats(store=StoreStats())))
    await actor.wait_xavier_ready(timeout_s=30)
