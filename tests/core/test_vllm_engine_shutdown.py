"""Shutting an engine down: a kill that races the engine core's own exit is not
an error (the CI run of stop 24 failed a terminate on exactly that race), and
a terminate stops a replica in the order that vLLM does not report as a crash
(no EngineDeadError at ERROR, no shared memory left to the resource tracker)."""

import asyncio
import logging
import os
from types import SimpleNamespace

import psutil
import pytest

from xinference.core.messages import GenerationRequest, ReplicaFailed, ReplicaSpec
from xinference.core.model import ReplicaModelActor
from xinference.core.options import EngineOptions
from xinference.core.vllm_engine import (
    ENGINE_EXIT_TIMEOUT_S,
    WORKER_EXIT_TIMEOUT_ENV,
    WORKER_EXIT_TIMEOUT_S,
    VLLMEngine,
)


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


# ---- the order of a stop: vLLM must not see a crash -----------------------------


class _EngineDead(Exception):
    """What vLLM's closed output queue hands its output handler."""


class _AsyncLLMWithHandler:
    """vLLM's ``AsyncLLM`` as far as stopping goes: an output handler task that
    logs at ERROR whatever error its output queue yields, and a ``shutdown``
    (run in a thread) that closes that queue from outside the loop, the way
    vLLM's engine-core client does, and only then cancels the handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Exception] = asyncio.Queue()
        self.output_handler = loop.create_task(self._handle())
        self.handler_done_at_shutdown: bool | None = None
        self.shutdown_timeout: float | None = None

    async def _handle(self) -> None:
        error = await self.queue.get()
        logging.getLogger("vllm.v1.engine.async_llm").error(
            "AsyncLLM output_handler failed: %r", error
        )

    def shutdown(self, timeout: float | None = None) -> None:
        self.handler_done_at_shutdown = self.output_handler.done()
        self.shutdown_timeout = timeout
        self.loop.call_soon_threadsafe(self.queue.put_nowait, _EngineDead())
        # the handler's cancellation comes after the error has reached it
        self.loop.call_soon_threadsafe(self.loop.call_soon, self.output_handler.cancel)


async def test_stop_ends_the_output_handler_before_the_engine(caplog):
    inner = _AsyncLLMWithHandler(asyncio.get_running_loop())
    engine = VLLMEngine(inner)
    await engine.stop()
    for _ in range(3):  # let what shutdown scheduled on the loop run
        await asyncio.sleep(0)
    assert inner.handler_done_at_shutdown is True
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert engine.dead


async def test_stop_gives_the_engine_core_longer_than_it_gives_its_workers():
    """vLLM kills an engine core that outlives the timeout, before it has
    unlinked the shared memory of its workers, whose exit it waits for."""
    inner = _AsyncLLMWithHandler(asyncio.get_running_loop())
    await VLLMEngine(inner).stop()
    assert inner.shutdown_timeout == ENGINE_EXIT_TIMEOUT_S
    # the engine core waits for its workers, then 4 s more after a SIGTERM
    assert ENGINE_EXIT_TIMEOUT_S > WORKER_EXIT_TIMEOUT_S + 4


@pytest.mark.parametrize("preset", [None, "7"])
def test_the_engine_core_gets_the_workers_exit_timeout(monkeypatch, preset):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.v1.engine.async_llm import AsyncLLM

    from xinference.core import vllm_engine

    seen = {}
    if preset is None:
        monkeypatch.delenv(WORKER_EXIT_TIMEOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(WORKER_EXIT_TIMEOUT_ENV, preset)

    def from_vllm_config(config, **_):
        # read when vLLM spawns the engine-core process, which inherits it
        seen["timeout"] = os.environ.get(WORKER_EXIT_TIMEOUT_ENV)
        return _AsyncLLMStandIn(None)

    args = SimpleNamespace(enable_log_requests=False, disable_log_stats=True)
    monkeypatch.setattr(vllm_engine, "build_engine_args", lambda spec: args)
    monkeypatch.setattr(vllm_engine, "engine_config", lambda args: None)
    monkeypatch.setattr(AsyncLLM, "from_vllm_config", from_vllm_config)
    VLLMEngine.start(None)  # type: ignore[arg-type]
    assert seen["timeout"] == (preset or str(WORKER_EXIT_TIMEOUT_S))


class _Blocking:
    """A ``VLLMEngine`` whose requests run until cancelled; records the order of
    what happens at shutdown."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.dead = False

    async def generate(self, request, *, stream):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.events.append(f"aborted {request.request_id}")
            raise
        yield  # pragma: no cover - never reached

    async def stop(self) -> None:
        self.events.append("stopped")


async def test_shutdown_aborts_the_requests_before_the_engine_stops():
    actor = ReplicaModelActor(ReplicaSpec("m", 0, 2, "/models/m", EngineOptions()))
    engine = _Blocking()
    actor._engine = engine  # type: ignore[assignment]
    waiting = asyncio.create_task(actor.generate(GenerationRequest("whole", (1, 2))))
    await actor.open_stream(GenerationRequest("streamed", (1, 2)))
    for _ in range(100):  # let both requests reach the engine
        if actor._generating and actor._in_flight == 2:
            break
        await asyncio.sleep(0)
    assert actor._generating and actor._in_flight == 2
    await actor.shutdown_engine()
    assert sorted(engine.events[:2]) == ["aborted streamed", "aborted whole"]
    assert engine.events[2:] == ["stopped"]
    with pytest.raises(ReplicaFailed, match="shut down while serving it"):
        await waiting
