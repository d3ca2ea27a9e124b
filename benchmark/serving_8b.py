"""Issue 29's workloads on a running deployment, and the tables of one device call.

Companion of ``serving_benchmark.py`` (which runs the seed's shared-prefix workload
and its no-shared-prefix twin, the miss tax): this script adds the two workloads
that need more than that one's phases, through the same OpenAI API, and writes the
same JSON shape (``{"label", "phases": {...}}``) so that ``report`` can put every
file of a call side by side. ``benchmark/run_h200_8b.sh`` drives both.

Phases (``--phases``):

  docqa  Long-document QA (the shape of LMCache's P2P benchmark, scaled): ``--docs``
         documents of ``--doc-tokens`` tokens, each asked ``--questions`` short
         questions. Questions go in rounds (question k of every document, then
         k+1), ``--concurrency`` in flight, the deployment's router choosing the
         replica (round robin spreads a document's questions over the replicas).
         Round 1 is cold everywhere; the later rounds are what sharing serves.
  ttft3  TTFT on replica B under round robin, per prompt length, median of
         ``--runs``: a *remote* hit (A served the prompt; B asks for it once the
         tracker lists it), a *local* hit (B asks for the same prompt again: its
         own prefix cache) and a *miss* (a fresh prompt on B). Around each remote
         hit B's metrics are read: the load's own time where its transfer actor
         measured one (``xavier_load_seconds``: asynchronous and leased loads),
         or where B's engine READ it itself (``xavier_direct_reads_total`` and
         ``xavier_direct_read_seconds_total``: the fast path's lease-free loads).

``--scale`` multiplies every token count (dry runs on a CPU with a small model).

    python benchmark/serving_8b.py run --endpoint URL --model UID --label on-ca \\
        --phases docqa --json on-ca-docqa.json
    python benchmark/serving_8b.py report --base off-rr DIR/*.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_benchmark import TIMEOUT_S, Client, Sample, scrape, tokens  # noqa: E402

from xinference.model.llm.vllm.xavier.connector.totals_report import (  # noqa: E402
    REPORTED_WITHIN_S,
)

PUBLISH_WAIT_S = 2.0  # how long ttft3 waits for A's blocks to reach the tracker


def scaled(value: int, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(value * scale))


def summary(samples: list[Sample]) -> dict[str, Any]:
    ttfts = sorted(s.ttft_s * 1e3 for s in samples)
    return {
        "requests": len(samples),
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))],
        "cached_tokens": sum(s.cached_tokens for s in samples),
        "prompt_tokens": sum(s.prompt_tokens for s in samples),
        "per_replica": {
            str(r): sum(1 for s in samples if s.replica == r) for r in (0, 1)
        },
    }


async def phase_docqa(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    import random

    rng = random.Random(2029)
    doc_tokens = scaled(args.doc_tokens, args.scale, minimum=64)
    question_tokens = scaled(args.question_tokens, args.scale, minimum=4)
    documents = [tokens(rng, doc_tokens) for _ in range(args.docs)]
    gate = asyncio.Semaphore(args.concurrency)

    async def ask(document: list[int]) -> Sample:
        async with gate:
            return await client.complete(
                document + tokens(rng, question_tokens), args.answer_tokens
            )

    rounds: list[list[Sample]] = []
    started = time.perf_counter()
    for _ in range(args.questions):
        rounds.append(list(await asyncio.gather(*(ask(d) for d in documents))))
    wall = time.perf_counter() - started
    every = [s for r in rounds for s in r]
    result = {
        "shape": {
            "docs": args.docs,
            "doc_tokens": doc_tokens,
            "questions": args.questions,
            "question_tokens": question_tokens,
            "answer_tokens": args.answer_tokens,
            "concurrency": args.concurrency,
        },
        "wall_s": wall,
        "requests_per_s": len(every) / wall,
        "all": summary(every),
        "cold": summary(rounds[0]),
        "later": summary([s for r in rounds[1:] for s in r]) if len(rounds) > 1 else {},
        "ttft_ms": [round(s.ttft_s * 1e3, 2) for s in every],
    }
    print(
        f"  docqa: TTFT p50 {result['all']['ttft_p50_ms']:.1f} ms (later rounds "
        f"{result['later'].get('ttft_p50_ms', float('nan')):.1f} ms), "
        f"{result['requests_per_s']:.2f} req/s",
        flush=True,
    )
    return result


async def wait_listed(
    http: httpx.AsyncClient, model: str, prompt: list[int], blocks: int
) -> bool:
    """Whether the tracker lists ``blocks`` blocks of ``prompt`` within the wait
    (False at once for a deployment without Xavier)."""
    deadline = time.monotonic() + PUBLISH_WAIT_S
    while time.monotonic() < deadline:
        response = await http.post(
            f"/v1/models/{model}/prefix", json={"prompt": prompt}
        )
        if response.status_code != 200:
            return False
        if response.json()["prefix_blocks"] >= blocks:
            return True
        await asyncio.sleep(0.01)
    return False


async def loads_on_b(http: httpx.AsyncClient, model: str) -> tuple[float, ...]:
    """Replica B's (rank 1) loads so far, from /metrics: the actor-timed ones
    (count, seconds) and the lease-free ones its engine READ itself (count,
    seconds)."""
    samples = await scrape(http)
    labels = f'{{model_uid="{model}",rank="1"}}'
    return tuple(
        samples.get(f"{name}{labels}", 0.0)
        for name in (
            "xavier_load_seconds_count",
            "xavier_load_seconds_sum",
            "xavier_direct_reads_total",
            "xavier_direct_read_seconds_total",
        )
    )


async def phase_ttft3(
    client: Client, args: argparse.Namespace, block_size: int
) -> dict[str, Any]:
    import random

    rng = random.Random(29)
    filler = tokens(rng, 8)
    rows = []
    for length in (scaled(n, args.scale, minimum=2 * block_size) for n in args.lengths):
        kinds: dict[str, list[Sample]] = defaultdict(list)
        load_ms: list[float] = []  # per remote hit, as its actor or B's engine timed it
        direct = 0  # remote hits B's engine READ itself
        listed = 0
        for run in range(args.runs + 1):  # run 0 warms this length up
            prompt = tokens(rng, length)
            await client.on_replica(0, prompt, 1, filler)
            found = await wait_listed(
                client.http, client.model, prompt, (length - 1) // block_size
            )
            listed += bool(run) and found
            before = await loads_on_b(client.http, client.model)
            remote = await client.on_replica(1, prompt, 8, filler)
            local = await client.on_replica(1, prompt, 8, filler)
            # read after the local hit (which loads nothing) and the delay with
            # which the engine reports its direct reads to its actor
            await asyncio.sleep(REPORTED_WITHIN_S + 0.2)
            after = await loads_on_b(client.http, client.model)
            timed, seconds, reads, read_s = (
                a - b for a, b in zip(after, before, strict=True)
            )
            if run and timed:
                load_ms.append(seconds / timed * 1e3)
            elif run and reads:
                load_ms.append(read_s / reads * 1e3)
            direct += bool(run) and reads > 0
            miss = await client.on_replica(1, tokens(rng, length), 8, filler)
            if run:
                for kind, sample in (
                    ("remote", remote),
                    ("local", local),
                    ("miss", miss),
                ):
                    kinds[kind].append(sample)
        row: dict[str, Any] = {
            "prompt_tokens": length,
            "listed_before_remote": listed,
            "load_ms": [round(ms, 3) for ms in load_ms],
            "load_p50_ms": statistics.median(load_ms) if load_ms else None,
            "direct_reads": direct,
        }
        for kind, samples in kinds.items():
            row[f"{kind}_ms"] = [round(s.ttft_s * 1e3, 2) for s in samples]
            row[f"{kind}_p50_ms"] = statistics.median(s.ttft_s * 1e3 for s in samples)
            row[f"{kind}_cached"] = statistics.median(s.cached_tokens for s in samples)
        rows.append(row)
        print(
            f"  ttft3 {length:>6} tokens: remote {row['remote_p50_ms']:8.1f} ms, local "
            f"{row['local_p50_ms']:8.1f} ms, miss {row['miss_p50_ms']:8.1f} ms, "
            f"load {_ms(row['load_p50_ms'])} ms, {direct} READ by B's engine",
            flush=True,
        )
    return {"rows": rows, "runs": args.runs}


async def run(args: argparse.Namespace) -> None:
    result: dict[str, Any] = {
        "label": args.label,
        "model": args.model,
        "scale": args.scale,
        "phases": {},
    }
    async with httpx.AsyncClient(base_url=args.endpoint, timeout=TIMEOUT_S) as http:
        client = Client(http, args.model)
        described = (await http.get(f"/v1/models/{args.model}")).json()
        result["deployment"] = described
        block_size = int(described["replicas"][0]["block_size"])
        for phase in [p for p in args.phases.split(",") if p]:
            print(f"[{args.label}] {phase}", flush=True)
            started = time.monotonic()
            if phase == "docqa":
                data = await phase_docqa(client, args)
            elif phase == "ttft3":
                data = await phase_ttft3(client, args, block_size)
            else:
                raise SystemExit(f"unknown phase {phase!r}")
            data["seconds"] = time.monotonic() - started
            result["phases"][phase] = data
            args.json.write_text(json.dumps(result, indent=1))
        result["metrics"] = {
            name: value
            for name, value in (await scrape(http)).items()
            if name.startswith("xavier_")
        }
    args.json.write_text(json.dumps(result, indent=1))


# ---- report --------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(value: float, base: float | None) -> str:
    return "-" if not base else f"x{value / base:.3f}"


def report(paths: list[Path], base: str) -> str:
    """Every table of one call; ratios against deployment ``base`` of the call.

    Files of ``serving_benchmark.py`` (shared, unique) and of this script (docqa,
    ttft3) mix; a label ``NAME#k`` is the k-th miss-tax run of deployment NAME.
    """
    runs: dict[str, dict[str, Any]] = defaultdict(dict)  # label -> phase -> data
    for path in paths:
        data = json.loads(path.read_text())
        for phase, value in data.get("phases", {}).items():
            runs[data["label"]][phase] = value
    out: list[str] = []
    # the base first, then the others in file order
    plain = {
        label: phases
        for label, phases in sorted(runs.items(), key=lambda item: item[0] != base)
        if "#" not in label
    }
    base_phases = plain.get(base, {})
    if any("shared" in p for p in plain.values()):
        b = base_phases.get("shared")
        shape = next(p["shared"]["shape"] for p in plain.values() if "shared" in p)
        out += [
            f"\nShared prefixes ({shape['groups']} x {shape['prefix_tokens']} tokens "
            f"cold, {shape['warm']} warm at concurrency {shape['concurrency']}, "
            f"{shape['max_tokens']} output tokens); ratios against `{base}`",
            "| deployment | output tok/s | ratio | TTFT p50 (ms) | ratio | TTFT p95 (ms) "
            "| cached/prompt |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for label, phases in plain.items():
            w = phases.get("shared")
            if w:
                out.append(
                    f"| {label} | {w['warm_output_tokens_per_s']:.0f} | "
                    f"{_ratio(w['warm_output_tokens_per_s'], b and b['warm_output_tokens_per_s'])} | "
                    f"{w['warm_ttft_p50_ms']:.1f} | "
                    f"{_ratio(w['warm_ttft_p50_ms'], b and b['warm_ttft_p50_ms'])} | "
                    f"{w['warm_ttft_p95_ms']:.1f} | "
                    f"{w['warm_cached_prompt_tokens'] / w['warm_prompt_tokens']:.3f} |"
                )
    if any("docqa" in p for p in plain.values()):
        b = base_phases.get("docqa")
        shape = next(p["docqa"]["shape"] for p in plain.values() if "docqa" in p)
        out += [
            f"\nLong-document QA ({shape['docs']} documents x {shape['doc_tokens']} "
            f"tokens, {shape['questions']} questions each, concurrency "
            f"{shape['concurrency']}); ratios against `{base}`",
            "| deployment | TTFT p50 (ms) | ratio | later rounds p50 (ms) | ratio "
            "| TTFT p90 (ms) | req/s | cached/prompt |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for label, phases in plain.items():
            d = phases.get("docqa")
            if not d:
                continue
            later = d["later"].get("ttft_p50_ms", float("nan"))
            base_later = b and b["later"].get("ttft_p50_ms")
            out.append(
                f"| {label} | {d['all']['ttft_p50_ms']:.1f} | "
                f"{_ratio(d['all']['ttft_p50_ms'], b and b['all']['ttft_p50_ms'])} | "
                f"{later:.1f} | {_ratio(later, base_later)} | "
                f"{d['all']['ttft_p90_ms']:.1f} | {d['requests_per_s']:.2f} | "
                f"{d['all']['cached_tokens'] / d['all']['prompt_tokens']:.3f} |"
            )
    out += misstax_report(runs)
    for label, phases in plain.items():
        rows = phases.get("ttft3", {}).get("rows")
        if not rows:
            continue
        out += [
            f"\nTTFT on replica B, `{label}`, median of {phases['ttft3']['runs']} runs "
            "(load: p50 of the loads' own time, as B's transfer actor timed them or, "
            "where B's engine READ them itself on the fast path, as the engine did; "
            "`-` where no load was timed)",
            "| prompt tokens | local hit (ms) | remote hit (ms) | miss (ms) "
            "| remote/miss | remote - local (ms) | load (ms) | READ by B's engine "
            "| cached on remote | listed first |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in rows:
            out.append(
                f"| {row['prompt_tokens']} | {row['local_p50_ms']:.1f} | "
                f"{row['remote_p50_ms']:.1f} | {row['miss_p50_ms']:.1f} | "
                f"{row['remote_p50_ms'] / row['miss_p50_ms']:.2f} | "
                f"{row['remote_p50_ms'] - row['local_p50_ms']:+.1f} | "
                f"{_ms(row.get('load_p50_ms'))} | {row.get('direct_reads', '-')} | "
                f"{row['remote_cached']:.0f} | {row['listed_before_remote']} |"
            )
    return "\n".join(out)


def misstax_report(runs: dict[str, dict[str, Any]]) -> list[str]:
    """The no-shared-prefix runs ``NAME#k``: each pair k side by side."""
    pairs: dict[str, dict[str, Any]] = defaultdict(dict)  # k -> name -> unique
    for label, phases in runs.items():
        if "#" in label and "unique" in phases:
            name, k = label.split("#", 1)
            pairs[k][name] = phases["unique"]
    if not pairs:
        return []
    names = sorted({name for pair in pairs.values() for name in pair})
    if len(names) != 2:
        return [f"\nMiss tax: expected two deployments, got {names}"]
    off, on = sorted(names, key=lambda n: "off" not in n)
    out = [
        f"\nMiss tax (no shared prefixes), `{on}` against `{off}`, pairs run back to "
        "back",
        "| pair | off tok/s | on tok/s | throughput on/off | off TTFT p50 (ms) "
        "| on TTFT p50 (ms) | TTFT on/off |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for k in sorted(pairs):
        a, b = pairs[k].get(off), pairs[k].get(on)
        if not (a and b):
            continue
        out.append(
            f"| {k} | {a['warm_output_tokens_per_s']:.0f} | "
            f"{b['warm_output_tokens_per_s']:.0f} | "
            f"{b['warm_output_tokens_per_s'] / a['warm_output_tokens_per_s']:.4f} | "
            f"{a['warm_ttft_p50_ms']:.1f} | {b['warm_ttft_p50_ms']:.1f} | "
            f"{b['warm_ttft_p50_ms'] / a['warm_ttft_p50_ms']:.4f} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run")
    one.add_argument("--endpoint", required=True)
    one.add_argument("--model", required=True)
    one.add_argument("--label", required=True)
    one.add_argument("--phases", default="docqa")
    one.add_argument("--json", type=Path, required=True)
    one.add_argument("--scale", type=float, default=1.0)
    one.add_argument("--docs", type=int, default=16)
    one.add_argument("--doc-tokens", type=int, default=8192)
    one.add_argument("--questions", type=int, default=4)
    one.add_argument("--question-tokens", type=int, default=32)
    one.add_argument("--answer-tokens", type=int, default=32)
    one.add_argument("--concurrency", type=int, default=8)
    one.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    one.add_argument("--runs", type=int, default=5)
    rep = sub.add_parser("report")
    rep.add_argument("--base", default="off-rr")
    rep.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        asyncio.run(run(args))
    else:
        print(report(args.files, args.base))


if __name__ == "__main__":
    main()
