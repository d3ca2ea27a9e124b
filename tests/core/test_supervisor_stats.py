"""``collect_stats`` (``/stats``, ``/metrics``) with a replica that does not answer:
the others' figures come back within the stats deadline, the silent one is left
out and logged, whether it hangs (a stopped process) or fails."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from xinference.core import supervisor as supervisor_module
from xinference.core.deployment import Deployment
from xinference.core.heartbeat import HeartbeatSettings
from xinference.core.messages import ReplicaStats
from xinference.core.supervisor import SupervisorActor


def counters(rank: int) -> ReplicaStats:
    return ReplicaStats(
        model_uid="m",
        rank=rank,
        block_size=16,
        requests_total=rank + 1,
        requests_in_flight=0,
        prompt_tokens_total=0,
        cached_prompt_tokens_total=0,
        generated_tokens_total=0,
    )


class Answers:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    async def stats(self) -> ReplicaStats:
        return counters(self.rank)


class Stopped:
    """Like an actor call to a SIGSTOPped process: no answer, and a cancellation
    that ends the call only once the peer takes it (here: 2 s later)."""

    async def stats(self) -> ReplicaStats:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(2)
            raise
        raise AssertionError("never answers")


class Fails:
    async def stats(self) -> ReplicaStats:
        raise ConnectionResetError("the sub-pool went away")


async def test_a_silent_or_failing_replica_is_left_out_of_the_stats(
    monkeypatch, caplog
) -> None:
    monkeypatch.setattr(supervisor_module, "STATS_TIMEOUT_S", 0.3)
    supervisor = SupervisorActor(HeartbeatSettings())
    supervisor._models["m"] = Deployment(
        spec=SimpleNamespace(model_uid="m"),
        state="ready",
        models={0: Answers(0), 1: Stopped(), 2: Fails(), 3: Answers(3)},
    )
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        stats = await supervisor.collect_stats("m")
    assert time.monotonic() - started < 0.3 + 1.0
    assert [s.rank for s in stats] == [0, 3]
    assert stats[1].requests_total == 4
    assert "m replica 1: no stats (TimeoutError" in caplog.text
    assert "m replica 2: no stats (ConnectionResetError" in caplog.text


async def test_stats_of_a_model_that_is_not_ready_are_empty() -> None:
    supervisor = SupervisorActor(HeartbeatSettings())
    supervisor._models["m"] = Deployment(
        spec=SimpleNamespace(model_uid="m"), models={0: Stopped()}
    )
    assert await supervisor.collect_stats("m") == []
    with pytest.raises(LookupError, match="not launched"):
        await supervisor.collect_stats("other")
