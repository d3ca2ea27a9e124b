"""benchmark/write_path.py's bookkeeping: the series a phase is judged by, read per
replica from a scrape, what a phase moved, and the pairs of the report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import write_path  # noqa: E402


def scrape(model: str, rank: int, **values: float) -> dict[str, float]:
    """/metrics samples as serving_benchmark.scrape returns them."""
    labels = f'model_uid="{model}",rank="{rank}"'
    names = {
        "remote_hit_blocks": f'xavier_remote_hits_total{{{labels},tier="device"}}',
        "staged_blocks": f"xavier_staged_blocks_total{{{labels}}}",
        "skipped_blocks": (
            f'xavier_stage_skipped_blocks_total{{{labels},reason="ring_full"}}'
        ),
        "engine_seconds": (
            f'xavier_engine_thread_seconds_total{{{labels},half="worker"}}'
        ),
    }
    return {names[key]: value for key, value in values.items()}


def test_counts_are_read_per_replica_and_summed_over_other_labels():
    metrics = {
        **scrape("on", 0, remote_hit_blocks=3, staged_blocks=10, engine_seconds=0.5),
        **scrape("on", 1, skipped_blocks=4),
        # the scheduler half's seconds add to the worker's
        'xavier_engine_thread_seconds_total{model_uid="on",rank="0",half="scheduler"}': (
            0.25
        ),
        # another model's series are not this one's
        **scrape("other", 0, staged_blocks=99),
    }
    counts = write_path.counted(metrics, "on")
    assert counts["0"]["staged_blocks"] == 10
    assert counts["0"]["engine_seconds"] == 0.75
    assert counts["0"]["remote_hit_blocks"] == 3
    assert counts["1"]["skipped_blocks"] == 4
    assert counts["1"]["staged_blocks"] == 0


def test_a_phase_is_what_moved_and_the_share_is_per_second_of_wall_time():
    before = write_path.counted(scrape("on", 0, engine_seconds=1.0), "on")
    after = write_path.counted(
        scrape("on", 0, engine_seconds=1.5, staged_blocks=20), "on"
    )
    moved = write_path.Counts.moved(before, after, wall_s=50.0)
    assert moved["0"]["staged_blocks"] == 20
    assert moved["0"]["engine_share"] == 0.5 / 50.0


def run_json(tmp_path: Path, label: str, req_s: float, p50: float) -> Path:
    counts = {
        str(r): {"remote_hit_blocks": 2.0, "engine_share": 0.004 * (r + 1)}
        for r in (0, 1)
    }
    row = {
        "concurrency": 8,
        "requests_per_s": req_s,
        "ttft_p50_ms": p50,
        "ttft_p90_ms": 2 * p50,
        "counts": counts,
    }
    data = {
        "label": label,
        "phases": {"unique": {"shape": {"prompt_tokens": 8192}, "rows": [row]}},
    }
    path = tmp_path / f"{label.replace('#', '-')}.json"
    path.write_text(json.dumps(data))
    return path


def test_the_report_pairs_runs_by_their_number(tmp_path):
    paths = [
        run_json(tmp_path, "off#1", 4.0, 100.0),
        run_json(tmp_path, "on#1", 3.0, 150.0),
        run_json(tmp_path, "off#2", 5.0, 100.0),  # no on#2: no row for pair 2
    ]
    table = write_path.report(paths, "off", "on")
    rows = [line for line in table.splitlines() if line.startswith("| 1 ")]
    assert rows == [
        "| 1 | no sharing, 8192 tokens, c8 | 4.00 | 3.00 | 0.750 | 100.0 | 150.0 "
        "| 1.500 | 200.0 | 300.0 | 1.500 | 4 | 0.80% |"
    ]
    assert not any(line.startswith("| 2 ") for line in table.splitlines())
