"""What Xavier's write path costs when nothing is shared, and what sharing gains,
against Xavier off, through the HTTP API (issue 44).

``run`` drives one deployment already launched (two replicas, round robin: the
replica of each request is its turn, so which replica serves what is known and
counted) and writes one JSON; ``report`` lays the runs of two deployments side
by side, pair by pair (labels ``NAME#k``, the k-th run of deployment NAME), with
the ratios of Xavier on against Xavier off. ``benchmark/run_write_path.sh``
launches the deployments one at a time and calls both.

Phases (``--phases``, in this order):

  unique  ``--unique-requests`` fresh prompts of ``--unique-tokens`` tokens at each
          of ``--concurrencies``: nothing is shared, every block is computed and
          (Xavier on) staged, so this is what the write path costs.
  docqa   Long-document QA: ``--docs`` documents of ``--doc-tokens`` tokens, each
          asked ``--questions`` times in rounds (question k of every document,
          then k+1), ``--doc-concurrency`` in flight. Round 1 is cold everywhere
          (the cold prefills of the write path's goal); with an odd number of
          documents round robin puts each document's next question on the other
          replica, so from round 2 its KV must move (or be recomputed).
  seed    The seed pull request's workload: 12 prefixes of 1,536 tokens, one cold
          request each, then 600 warm requests over them at concurrency 16,
          64 output tokens (``serving_benchmark.py shared``).

Per phase (per concurrency for ``unique``, per round for ``docqa``): wall time,
requests/s, output tokens/s, TTFT p50/p90 and requests per replica; and from
``/metrics`` before and after the phase (each read once the connector's totals
have reached its actors, ``REPORTED_WITHIN_S``), per replica: remote hits and
tokens loaded (was the case really what it claims?), blocks staged and skipped,
and the seconds Xavier spent on the engine's thread, as a share of the phase's
wall time (the engine is busy for all of it under these loads).

    python benchmark/write_path.py run --endpoint URL --model on --label on#1 \\
        --json on-1.json
    python benchmark/write_path.py report --off off --on on DIR/*.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_benchmark import (  # noqa: E402
    TIMEOUT_S,
    Client,
    Sample,
    WorkloadShape,
    phase_workload,
    scrape,
    tokens,
)

from xinference.model.llm.vllm.xavier.connector.totals_report import (  # noqa: E402
    REPORTED_WITHIN_S,
)

REPLICAS = (0, 1)
# Per replica, the /metrics series a phase is judged by: name -> label filter.
COUNTED = {
    "remote_hit_blocks": ("xavier_remote_hits_total", ""),
    "tokens_loaded": ("xavier_external_tokens_loaded_total", ""),
    "staged_blocks": ("xavier_staged_blocks_total", ""),
    "skipped_blocks": ("xavier_stage_skipped_blocks_total", ""),
    "demotions": ("xavier_demotions_total", ""),
    "store_skips": ("xavier_skips_total", ""),
    "engine_seconds": ("xavier_engine_thread_seconds_total", ""),
}


def summary(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """Throughput and TTFT of ``samples``, served in ``wall_s``."""
    ttfts = sorted(s.ttft_s * 1e3 for s in samples)
    return {
        "requests": len(samples),
        "wall_s": wall_s,
        "requests_per_s": len(samples) / wall_s,
        "output_tokens_per_s": sum(s.completion_tokens for s in samples) / wall_s,
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))],
        "cached_tokens": sum(s.cached_tokens for s in samples),
        "prompt_tokens": sum(s.prompt_tokens for s in samples),
        "per_replica": {str(r): sum(s.replica == r for s in samples) for r in REPLICAS},
    }


def counted(metrics: dict[str, float], model: str) -> dict[str, dict[str, float]]:
    """``COUNTED`` per replica from one scrape (series summed over other labels)."""
    out: dict[str, dict[str, float]] = {str(r): {} for r in REPLICAS}
    for key, (series, _) in COUNTED.items():
        for rank in REPLICAS:
            labels = f'model_uid="{model}",rank="{rank}"'
            out[str(rank)][key] = sum(
                value
                for name, value in metrics.items()
                if name.startswith(series + "{") and labels in name
            )
    return out


class Counts:
    """The ``COUNTED`` series around a phase, read once the totals settled."""

    def __init__(self, client: Client) -> None:
        self._client = client

    async def read(self) -> dict[str, dict[str, float]]:
        # the connector reports its totals once they stood still for a look
        await asyncio.sleep(REPORTED_WITHIN_S + 0.5)
        return counted(await scrape(self._client.http), self._client.model)

    @staticmethod
    def moved(
        before: dict[str, dict[str, float]],
        after: dict[str, dict[str, float]],
        wall_s: float,
    ) -> dict[str, dict[str, float]]:
        """Per replica, what the phase added, and Xavier's share of the engine's
        thread over the phase (its seconds there against the wall time)."""
        out = {}
        for rank, values in after.items():
            moved = {
                key: value - before[rank].get(key, 0.0) for key, value in values.items()
            }
            moved["engine_share"] = moved["engine_seconds"] / wall_s
            out[rank] = moved
        return out


async def phase_unique(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(4401)
    rows = []
    counts = Counts(client)
    for concurrency in args.concurrencies:
        prompts = [tokens(rng, args.unique_tokens) for _ in range(args.unique_requests)]

        async def one(prompt: list[int], gate: asyncio.Semaphore) -> Sample:
            async with gate:
                return await client.complete(prompt, args.output_tokens)

        before = await counts.read()
        started = time.perf_counter()
        gate = asyncio.Semaphore(concurrency)
        samples = await asyncio.gather(*(one(p, gate) for p in prompts))
        wall = time.perf_counter() - started
        row = {"concurrency": concurrency, **summary(list(samples), wall)}
        row["counts"] = Counts.moved(before, await counts.read(), wall)
        rows.append(row)
        print(
            f"  unique c{concurrency}: {row['requests_per_s']:.2f} req/s, TTFT p50 "
            f"{row['ttft_p50_ms']:.1f} p90 {row['ttft_p90_ms']:.1f} ms, "
            f"{_hits(row['counts'])} remote hit blocks, engine share "
            f"{_share(row['counts'])}",
            flush=True,
        )
    return {
        "shape": {
            "prompt_tokens": args.unique_tokens,
            "requests": args.unique_requests,
            "output_tokens": args.output_tokens,
        },
        "rows": rows,
    }


async def phase_docqa(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(4402)
    documents = [tokens(rng, args.doc_tokens) for _ in range(args.docs)]
    gate = asyncio.Semaphore(args.doc_concurrency)

    async def ask(document: list[int]) -> Sample:
        async with gate:
            return await client.complete(
                document + tokens(rng, args.question_tokens), args.output_tokens
            )

    counts = Counts(client)
    before = await counts.read()
    rounds: list[list[Sample]] = []
    walls: list[float] = []
    started = time.perf_counter()
    for _ in range(args.questions):
        began = time.perf_counter()
        rounds.append(list(await asyncio.gather(*(ask(d) for d in documents))))
        walls.append(time.perf_counter() - began)
    wall = time.perf_counter() - started
    every = [s for r in rounds for s in r]
    # which replica asked each document in each round: did its KV have to move?
    moved_questions = sum(
        rounds[k][d].replica != rounds[k - 1][d].replica
        for k in range(1, len(rounds))
        for d in range(len(documents))
    )
    result = {
        "shape": {
            "docs": args.docs,
            "doc_tokens": args.doc_tokens,
            "questions": args.questions,
            "question_tokens": args.question_tokens,
            "output_tokens": args.output_tokens,
            "concurrency": args.doc_concurrency,
        },
        "all": summary(every, wall),
        "cold": summary(rounds[0], walls[0]),
        "later": summary([s for r in rounds[1:] for s in r], wall - walls[0]),
        "questions_on_another_replica": moved_questions,
        "counts": Counts.moved(before, await counts.read(), wall),
    }
    print(
        f"  docqa: cold TTFT p50 {result['cold']['ttft_p50_ms']:.1f} p90 "
        f"{result['cold']['ttft_p90_ms']:.1f} ms; all TTFT p50 "
        f"{result['all']['ttft_p50_ms']:.1f} p90 {result['all']['ttft_p90_ms']:.1f} "
        f"ms, {result['all']['requests_per_s']:.2f} req/s; {moved_questions} "
        f"questions on another replica, {_hits(result['counts'])} remote hit "
        f"blocks, engine share {_share(result['counts'])}",
        flush=True,
    )
    return result


async def phase_seed(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    shape = WorkloadShape(
        groups=12,
        warm=args.seed_warm,
        concurrency=16,
        prefix_tokens=args.seed_prefix_tokens,
        max_tokens=64,
    )
    counts = Counts(client)
    before = await counts.read()
    started = time.perf_counter()
    data = await phase_workload(client, shape, shared=True, seed=2026)
    # the share over the whole phase, cold requests included
    data["counts"] = Counts.moved(
        before, await counts.read(), time.perf_counter() - started
    )
    print(
        f"  seed: {_hits(data['counts'])} remote hit blocks, engine share "
        f"{_share(data['counts'])}",
        flush=True,
    )
    return data


def _hits(counts: dict[str, dict[str, float]]) -> str:
    return "+".join(f"{counts[str(r)]['remote_hit_blocks']:.0f}" for r in REPLICAS)


def _share(counts: dict[str, dict[str, float]]) -> str:
    return "/".join(f"{counts[str(r)]['engine_share']:.2%}" for r in REPLICAS)


PHASES = {"unique": phase_unique, "docqa": phase_docqa, "seed": phase_seed}


async def run(args: argparse.Namespace) -> None:
    result: dict[str, Any] = {"label": args.label, "model": args.model, "phases": {}}
    async with httpx.AsyncClient(base_url=args.endpoint, timeout=TIMEOUT_S) as http:
        client = Client(http, args.model)
        result["deployment"] = (await http.get(f"/v1/models/{args.model}")).json()
        # A few requests on each replica first: the first forwards of a fresh
        # engine are slow, and should count against neither deployment.
        rng = random.Random(4400)
        for _ in range(2 * len(REPLICAS)):
            await client.complete(tokens(rng, 256), 8)
        for phase in [p for p in args.phases.split(",") if p]:
            if phase not in PHASES:
                raise SystemExit(f"unknown phase {phase!r}; known: {', '.join(PHASES)}")
            print(f"[{args.label}] {phase}", flush=True)
            started = time.monotonic()
            data = await PHASES[phase](client, args)
            data["seconds"] = time.monotonic() - started
            result["phases"][phase] = data
            args.json.write_text(json.dumps(result, indent=1))


# ---- report --------------------------------------------------------------------


def rows_of(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One run's comparable rows: row name -> summary with its counts."""
    phases = data["phases"]
    out: dict[str, dict[str, Any]] = {}
    for row in phases.get("unique", {}).get("rows", []):
        shape = phases["unique"]["shape"]
        out[f"no sharing, {shape['prompt_tokens']} tokens, c{row['concurrency']}"] = row
    docqa = phases.get("docqa")
    if docqa:
        shape = docqa["shape"]
        what = f"docqa {shape['docs']} x {shape['doc_tokens']}"
        out[f"{what}, round 1 (cold)"] = {**docqa["cold"], "counts": docqa["counts"]}
        out[f"{what}, all rounds"] = {**docqa["all"], "counts": docqa["counts"]}
    seed = phases.get("seed")
    if seed:
        out["seed (12 x 1,536, 600 warm, c16)"] = {
            "requests_per_s": seed["warm_requests_per_s"],
            "output_tokens_per_s": seed["warm_output_tokens_per_s"],
            "ttft_p50_ms": seed["warm_ttft_p50_ms"],
            "ttft_p90_ms": seed["warm_ttft_p95_ms"],  # the seed reported p95
            "counts": seed["counts"],
        }
    return out


def report(paths: list[Path], off: str, on: str) -> str:
    """Each row of each pair: off, on, and on/off for throughput and TTFT; with
    Xavier on, what moved and Xavier's largest share of an engine's thread."""
    runs: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)  # k -> name -> rows
    for path in paths:
        data = json.loads(path.read_text())
        name, _, k = data["label"].partition("#")
        runs[k or "1"][name] = rows_of(data)
    out = [
        f"`{on}` against `{off}`, each pair on one warm machine (ratios on/off; "
        "TTFT of the seed's row is p95, as the seed reported it)",
        "| pair | workload | req/s off | req/s on | ratio | TTFT p50 off | on | ratio "
        "| TTFT p90 off | on | ratio | remote hit blocks (on) | engine share (on) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    for k in sorted(runs):
        a, b = runs[k].get(off), runs[k].get(on)
        if not (a and b):
            continue
        for name, row_off in a.items():
            row_on = b.get(name)
            if row_on is None:
                continue
            counts = row_on["counts"]
            hits = sum(c["remote_hit_blocks"] for c in counts.values())
            share = max(c["engine_share"] for c in counts.values())
            out.append(
                f"| {k} | {name} | {row_off['requests_per_s']:.2f} | "
                f"{row_on['requests_per_s']:.2f} | "
                f"{row_on['requests_per_s'] / row_off['requests_per_s']:.3f} | "
                f"{row_off['ttft_p50_ms']:.1f} | {row_on['ttft_p50_ms']:.1f} | "
                f"{row_on['ttft_p50_ms'] / row_off['ttft_p50_ms']:.3f} | "
                f"{row_off['ttft_p90_ms']:.1f} | {row_on['ttft_p90_ms']:.1f} | "
                f"{row_on['ttft_p90_ms'] / row_off['ttft_p90_ms']:.3f} | "
                f"{hits:.0f} | {share:.2%} |"
            )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run")
    one.add_argument("--endpoint", required=True)
    one.add_argument("--model", required=True)
    one.add_argument("--label", required=True)
    one.add_argument("--json", type=Path, required=True)
    one.add_argument("--phases", default="unique,docqa,seed")
    one.add_argument("--output-tokens", type=int, default=32)
    one.add_argument("--unique-tokens", type=int, default=8192)
    one.add_argument("--unique-requests", type=int, default=32)
    one.add_argument("--concurrencies", type=int, nargs="+", default=[8, 16])
    one.add_argument("--docs", type=int, default=15)
    one.add_argument("--doc-tokens", type=int, default=8192)
    one.add_argument("--questions", type=int, default=4)
    one.add_argument("--question-tokens", type=int, default=32)
    one.add_argument("--doc-concurrency", type=int, default=8)
    one.add_argument("--seed-warm", type=int, default=600)
    one.add_argument("--seed-prefix-tokens", type=int, default=1536)
    rep = sub.add_parser("report")
    rep.add_argument("--off", default="off")
    rep.add_argument("--on", default="on")
    rep.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        asyncio.run(run(args))
    else:
        print(report(args.files, args.off, args.on))


if __name__ == "__main__":
    main()
