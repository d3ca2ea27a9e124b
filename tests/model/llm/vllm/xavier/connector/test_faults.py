"""``ConnectorFaults``: counting, logging and reporting a contained fault, and
running a fallback, must never raise themselves: they run inside vLLM's calls."""

from __future__ import annotations

import logging

from xinference.model.llm.vllm.xavier.connector import faults as faults_module
from xinference.model.llm.vllm.xavier.connector.faults import ConnectorFaults


def test_a_report_that_raises_still_counts_and_logs_the_fault(caplog):
    reported = []

    def report(where: str) -> None:
        reported.append(where)
        raise ConnectionError("the transfer actor is gone")

    faults = ConnectorFaults("scheduler of replica 0", report)
    with caplog.at_level(logging.ERROR, logger=faults_module.__name__):
        faults.record("build_connector_meta", RuntimeError("broken"))
        faults.record("build_connector_meta", RuntimeError("broken"))
    assert reported == ["build_connector_meta"] * 2
    assert faults.counts["build_connector_meta"] == 2 and faults.total == 2
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1  # the first time; then every LOG_EVERY-th
    assert "build_connector_meta failed (1 so far)" in logged[0].getMessage()


def test_repeated_faults_are_logged_every_log_every_th_time(caplog, monkeypatch):
    monkeypatch.setattr(faults_module, "LOG_EVERY", 3)
    faults = ConnectorFaults("worker of replica 1")
    with caplog.at_level(logging.ERROR, logger=faults_module.__name__):
        for _ in range(7):
            faults.record("wait_for_save", RuntimeError("broken"))
    counts = [r.getMessage().split("(")[1].split(" ")[0] for r in caplog.records]
    assert counts == ["1", "3", "6"]


def test_a_fallback_that_raises_is_contained_counted_and_logged(caplog):
    def fallback(req_id: str) -> None:
        raise KeyError(req_id)

    faults = ConnectorFaults("scheduler of replica 0")
    with caplog.at_level(logging.CRITICAL, logger=faults_module.__name__):
        assert faults.attempt("abandoning a load", fallback, "r") is False
    assert faults.counts["abandoning a load"] == 1
    assert "abandoning a load after a fault failed as well" in caplog.text
    assert faults.attempt("abandoning a load", lambda req_id: None, "r") is True
    assert faults.counts["abandoning a load"] == 1
