"""Shutting an engine down: a kill that races the engine core's own exit is not
an error (the CI run of stop 24 failed a terminate on exactly that race)."""

import psutil
import pytest

from xinference.core.vllm_engine import VLLMEngine


class _AsyncLLMStandIn:
    """What ``VLLMEngine.shutdown`` calls on vLLM's ``AsyncLLM``: ``shutdown``."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error
        self.calls = 0

    def shutdown(self) -> None:
        self.calls += 1
        if self.error is not None:
            raise self.error


def test_an_engine_process_gone_during_the_kill_is_a_finished_shutdown():
    inner = _AsyncLLMStandIn(psutil.NoSuchProcess(pid=8552))
    engine = VLLMEngine(inner)
    engine.shutdown()
    assert inner.calls == 1
    assert engine.dead
    engine.shutdown()  # the second call has no engine left to stop
    assert inner.calls == 1


def test_other_shutdown_failures_still_reach_the_caller():
    engine = VLLMEngine(_AsyncLLMStandIn(RuntimeError("engine core hung")))
    with pytest.raises(RuntimeError, match="engine core hung"):
        engine.shutdown()
    assert engine.dead
