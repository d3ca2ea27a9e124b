"""Pooling runs of ttft_remote_hit.py (benchmark/pool_ttft_runs.py): every request
of every run in one p50, the goal judged on the pooled p50s."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import pool_ttft_runs  # noqa: E402


def run(local, remote, load, phase_diff):
    """One run's JSON as ttft_remote_hit.py writes it: one length, one variant."""
    phases = {
        kind: {phase: 1.0 for phase in pool_ttft_runs.PHASES}
        for kind in ("local", "remote", "miss")
    }
    phases["remote"]["    forward rest"] = 1.0 + phase_diff
    row = {
        "prompt_tokens": 512,
        "local_all_ms": local,
        "remote_all_ms": remote,
        "load_all_ms": load,
        "goal_met": False,
        "phases": phases,
    }
    return {"on": {"env": {}, "rows": [row]}}


def test_requests_of_all_runs_make_one_p50_and_the_goal_is_judged_on_it(
    tmp_path, capsys
):
    runs = [
        run([10.0, 11.0, 30.0], [13.0, 14.0, 15.0], [2.0, 2.0, 9.0], 0.5),
        run([12.0, 12.0, 12.0], [14.0, 40.0, 14.0], [2.5, 2.5, 2.5], -0.1),
    ]
    (length, pooled), *_ = pool_ttft_runs.pool(runs).items()
    assert length == 512 and pooled["samples"] == 6
    # local: 10, 11, 12, 12, 12, 30 -> 12; remote: 13, 14, 14, 14, 15, 40 -> 14
    assert pooled["local_ms"] == 12.0 and pooled["remote_ms"] == 14.0
    assert pooled["load_ms"] == 2.5
    assert pooled["goal_met"] is True  # +2.0 <= 2.5 + 1
    assert pooled["runs_met"] == 0 and pooled["runs"] == 2
    assert pooled["phases"]["    forward rest"] == pytest.approx([0.5, -0.1])

    paths = []
    for index, one in enumerate(runs):
        path = tmp_path / f"run{index}.json"
        path.write_text(json.dumps(one))
        paths.append(str(path))
    pool_ttft_runs.main([f"after={','.join(paths)}"])
    table = capsys.readouterr().out
    assert "### after: 2 runs" in table
    assert "| 512 | 6 | 12.00 | 14.00 | 2.50 | +2.00 | met | 0 of 2 |" in table
    assert "- forward rest: +0.20 (+0.50, -0.10)" in table


def test_a_slower_remote_misses_the_goal():
    pooled = pool_ttft_runs.pool([run([10.0], [14.0], [2.0], 0.0)])[512]
    assert pooled["remote_minus_local_ms"] == 4.0 and pooled["goal_met"] is False
