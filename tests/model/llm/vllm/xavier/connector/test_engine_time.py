"""EngineTime: what the connector costs the engine's thread, per method."""

from __future__ import annotations

import logging

from xinference.model.llm.vllm.xavier.connector import engine_time
from xinference.model.llm.vllm.xavier.connector.engine_time import EngineTime, timed


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_totals_add_up_per_method_busiest_first():
    clock = FakeClock()
    account = EngineTime("worker of replica 3", clock)
    account.add("wait_for_save", 0.002)
    account.add("start_load_kv", 0.001)
    account.add("wait_for_save", 0.004)
    assert account.totals() == {
        "wait_for_save": (2, 0.006),
        "start_load_kv": (1, 0.001),
    }
    clock.now += 10.0
    summary = account.summary()
    assert summary.startswith(
        "Xavier worker of replica 3: 0.007 s of 10.0 s on the engine's thread (0.07%)"
    )
    assert "wait_for_save 2 calls 0.006 s (3000 us each)" in summary


def test_logs_at_most_once_per_interval(caplog, monkeypatch):
    monkeypatch.setattr(engine_time, "LOG_EVERY_S", 5.0)
    clock = FakeClock()
    account = EngineTime("scheduler of replica 0", clock)
    with caplog.at_level(logging.INFO, logger=engine_time.__name__):
        account.add("build_connector_meta", 0.001)  # before the first interval
        clock.now += 6.0
        account.add("build_connector_meta", 0.001)
        account.add("build_connector_meta", 0.001)  # same interval: no new line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert "build_connector_meta 2 calls" in lines[0]


def test_timed_counts_a_method_even_when_it_raises():
    class Half:
        def __init__(self) -> None:
            self._engine_time = EngineTime("test half")

        @timed
        def step(self, fail: bool) -> str:
            if fail:
                raise RuntimeError("boom")
            return "ok"

    half = Half()
    assert half.step(False) == "ok"
    try:
        half.step(True)
    except RuntimeError:
        pass
    calls, seconds = half._engine_time.totals()["step"]
    assert calls == 2 and seconds >= 0.0
