"""A model's progress as the page and ``xinference launch`` show it: while it is
terminating, its elapsed time counts from the terminate (the page read
"terminating · 94 s" a second after a terminate, counted from the launch)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from xinference.core.deployment import Deployment
from xinference.core.heartbeat import HeartbeatSettings
from xinference.core.supervisor import SupervisorActor


def test_a_terminate_counts_its_own_time() -> None:
    record = Deployment(spec=SimpleNamespace(model_uid="m", replica=2), state="ready")
    record.started = time.monotonic() - 94  # launched 94 s ago
    assert record.progress().elapsed_s >= 94
    record.state = "terminating"
    record.terminating_since = time.monotonic() - 1.5
    terminating = record.progress()
    assert terminating.state == "terminating"
    assert 1.5 <= terminating.elapsed_s < 10


async def test_the_supervisor_counts_from_the_terminate() -> None:
    supervisor = SupervisorActor(HeartbeatSettings())
    record = Deployment(spec=SimpleNamespace(model_uid="m", replica=2), state="ready")
    record.started = time.monotonic() - 94
    supervisor._models["m"] = record
    seen = []

    async def teardown(torn_down: Deployment) -> dict[int, dict[str, Any]]:
        seen.append(await supervisor.progress("m"))  # while it tears down
        return {}

    supervisor._teardown = teardown  # type: ignore[method-assign]
    assert await supervisor.terminate_model("m") == {}
    (during,) = seen
    assert during.state == "terminating" and during.elapsed_s < 10
