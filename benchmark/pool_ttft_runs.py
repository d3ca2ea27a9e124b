"""Pool several runs of ``ttft_remote_hit.py`` (their ``--json`` files) into one
verdict per code tree and prompt length.

On a shared machine the p50 of one run moves by a few milliseconds between runs
of the same code, as much as the changes it is meant to show. Run the trees to
compare alternately, several times each, and pool: every timed request of every
run counts in one p50 of local hits, remote hits and loads, and each phase of
the step timeline shows the median over runs of its remote − local p50, with
the runs' own values beside it.

  python benchmark/pool_ttft_runs.py before=a1.json,a2.json after=b1.json,b2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PHASES = (
    "front: generate to first step, last step to return",
    "    start_load_kv (the load)",
    "    forward rest",
    "  step rest (hops to workers, waits for the batch)",
    "  Scheduler.schedule",
)


def pool(runs: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per prompt length: the pooled p50s, whether the goal holds on them (remote
    − local <= load + 1 ms), the runs that met it on their own, and per phase the
    runs' remote − local p50s. Every run's every variant counts."""
    samples: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    phases: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    met: dict[int, list[bool]] = defaultdict(list)
    for run in runs:
        for variant in run.values():
            for row in variant["rows"]:
                length = row["prompt_tokens"]
                for kind in ("local", "remote", "load"):
                    samples[length][kind] += row[f"{kind}_all_ms"]
                met[length].append(bool(row["goal_met"]))
                for phase in PHASES if "phases" in row else ():
                    split = row["phases"]
                    phases[length][phase].append(
                        split["remote"][phase] - split["local"][phase]
                    )
    pooled = {}
    for length, kinds in sorted(samples.items()):
        local, remote, load = (
            statistics.median(kinds[k]) for k in ("local", "remote", "load")
        )
        pooled[length] = {
            "samples": len(kinds["remote"]),
            "local_ms": local,
            "remote_ms": remote,
            "load_ms": load,
            "remote_minus_local_ms": remote - local,
            "goal_met": remote - local <= load + 1.0,
            "runs_met": sum(met[length]),
            "runs": len(met[length]),
            "phases": dict(phases[length]),
        }
    return pooled


def table(label: str, pooled: dict[int, dict[str, Any]]) -> str:
    lines = [
        f"### {label}",
        "",
        "| tokens | requests | local | remote | load | remote − local | goal "
        "(≤ load + 1) | runs meeting it |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for length, row in pooled.items():
        lines.append(
            f"| {length} | {row['samples']} | {row['local_ms']:.2f} | "
            f"{row['remote_ms']:.2f} | {row['load_ms']:.2f} | "
            f"{row['remote_minus_local_ms']:+.2f} | "
            f"{'met' if row['goal_met'] else 'missed'} | "
            f"{row['runs_met']} of {row['runs']} |"
        )
    for length, row in pooled.items():
        if not row["phases"]:
            continue
        lines += [
            "",
            f"Remote − local by phase at {length} tokens, ms: median of the runs' "
            "p50s (each run's)",
            "",
        ]
        for phase, values in row["phases"].items():
            each = ", ".join(f"{v:+.2f}" for v in values)
            lines.append(
                f"- {phase.strip()}: {statistics.median(values):+.2f} ({each})"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "trees", nargs="+", help="LABEL=run1.json,run2.json,... (one per code tree)"
    )
    args = parser.parse_args(argv)
    for spec in args.trees:
        label, _, files = spec.partition("=")
        if not files:
            parser.error(f"{spec!r}: expected LABEL=run1.json,run2.json")
        runs = [json.loads(Path(f).read_text()) for f in files.split(",")]
        print(table(f"{label}: {len(runs)} runs", pool(runs)))
        print()


if __name__ == "__main__":
    main()
