"""What a user gets from Xavier, measured through the HTTP API of a running cluster.

Runs against a model already launched with two replicas (``xinference launch ...
--replica 2``, round robin unless said otherwise) and writes one JSON file per
deployment; ``report`` turns the files of several deployments into the tables of
``benchmark/results/h200.md``. ``benchmark/run_h200_vllm.sh`` drives it on the GPU.

Phases (``--phases``, in this order):

  correctness  For each of a few prompt pairs (P, Q) sharing a prefix of full
               blocks: P on replica A, Q on replica B (a remote hit with Xavier),
               then Q again on A (a local prefix-cache hit on A's own KV). Records
               B's cached tokens and both greedy outputs of Q.
  ttft         Per prompt length, ``--runs`` times after one warm-up: a fresh
               prompt on A, the same prompt on B (hit), a fresh one on A, a fresh
               one on B (miss). TTFT is the time to the first streamed chunk.
  shared       The seed's workload: 12 cold requests (one per shared prefix, one
               at a time), then 600 warm requests over those prefixes with
               distinct tails, 16 in flight.
  unique       The same shape with no shared prefixes (Xavier's miss tax).
  multiturn    ``--conversations`` chats of ``--turns`` turns through the chat API,
               one request at a time, conversation after conversation: under round
               robin (an even number of turns) each turn lands on the other
               replica than the one before, so with Xavier a turn loads the
               history, the previous answer included, instead of computing it.
               TTFT per turn (turn 1 is cold everywhere).

Round robin alternates the replicas; every request reads the replica that served
it from the ``X-Xinference-Replica`` header, and the phases that need a given
replica send a filler request when the turn is wrong.

    python benchmark/serving_benchmark.py run --endpoint URL --model UID \\
        --label on --phases correctness,ttft,shared,unique --json on.json
    python benchmark/serving_benchmark.py report off.json on.json on-ca.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

REPLICA_HEADER = "X-Xinference-Replica"
VOCAB = 1000  # token ids 1..999: the offline models' tokenizer vocabulary
TIMEOUT_S = 300.0


@dataclass(slots=True)
class Sample:
    """One streamed request as the client saw it."""

    replica: int
    ttft_s: float
    total_s: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    groups: int = 12  # shared prefixes (cold requests)
    warm: int = 600
    concurrency: int = 16
    prefix_tokens: int = 1536
    tail_tokens: tuple[int, int] = (32, 160)
    max_tokens: int = 64


@dataclass(frozen=True, slots=True)
class ConversationShape:
    conversations: int = 32
    turns: int = 4  # even: under round robin every turn changes replica
    system_words: int = 400
    user_words: int = 40
    max_tokens: int = 64  # each answer

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ConversationShape:
        return cls(
            conversations=args.conversations,
            turns=args.turns,
            system_words=args.system_words,
            user_words=args.user_words,
            max_tokens=args.max_tokens,
        )

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        defaults = ConversationShape()
        parser.add_argument("--conversations", type=int, default=defaults.conversations)
        parser.add_argument("--turns", type=int, default=defaults.turns)
        parser.add_argument("--system-words", type=int, default=defaults.system_words)
        parser.add_argument("--user-words", type=int, default=defaults.user_words)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


class Client:
    def __init__(self, http: httpx.AsyncClient, model: str) -> None:
        self.http = http
        self.model = model

    async def complete(self, prompt: list[int], max_tokens: int) -> Sample:
        sample = await self._stream(
            "/v1/completions",
            dict(prompt=prompt, max_tokens=max_tokens),
            lambda choice: choice.get("text", ""),
        )
        sample.prompt_tokens = sample.prompt_tokens or len(prompt)
        return sample

    async def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Sample:
        """One streamed chat turn; ``text`` is the answer."""
        return await self._stream(
            "/v1/chat/completions",
            dict(messages=messages, max_tokens=max_tokens),
            lambda choice: choice.get("delta", {}).get("content", ""),
        )

    async def _stream(
        self, url: str, fields: dict[str, Any], text_of: Callable[[dict], str]
    ) -> Sample:
        """A greedy streamed request; ``text_of`` reads a choice's new text."""
        body = dict(
            model=self.model,
            temperature=0.0,
            ignore_eos=True,
            stream=True,
            stream_options={"include_usage": True},
            **fields,
        )
        started = time.perf_counter()
        first: float | None = None
        text: list[str] = []
        usage: dict[str, Any] = {}
        async with self.http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text}")
            replica = int(response.headers[REPLICA_HEADER])
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    if first is None:
                        first = time.perf_counter()
                    text.append(text_of(choice))
        done = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        return Sample(
            replica=replica,
            ttft_s=(first or done) - started,
            total_s=done - started,
            text="".join(text),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
        )

    async def on_replica(
        self, replica: int, prompt: list[int], max_tokens: int, filler: list[int]
    ) -> Sample:
        """``prompt`` on ``replica`` under round robin: a filler request first when
        the next turn is the other replica's (checked after the fact)."""
        for _ in range(3):
            probe = await self.complete(filler, 1)
            if probe.replica != replica:
                break  # the next turn is ours
        sample = await self.complete(prompt, max_tokens)
        if sample.replica != replica:
            raise RuntimeError(
                f"round robin sent the request to replica {sample.replica}, not "
                f"{replica}: is the router round-robin and the server otherwise idle?"
            )
        return sample


async def phase_correctness(client: Client, block_size: int) -> dict[str, Any]:
    rng = random.Random(19)
    filler = tokens(rng, 8)
    pairs = []
    for index, (prefix_tokens, tail) in enumerate(
        [(128, 5), (512, 17), (2048, 3), (1024, 40), (256, 1), (4096, 9)]
    ):
        prefix_blocks = prefix_tokens // block_size
        prefix = tokens(rng, prefix_blocks * block_size)
        p = prefix + tokens(rng, tail + 7)
        q = prefix + tokens(rng, tail)
        on_a = await client.on_replica(0, p, 32, filler)
        on_b = await client.on_replica(1, q, 32, filler)
        again_on_a = await client.on_replica(0, q, 32, filler)
        loadable = (len(q) - 1) // block_size * block_size
        shared = min(prefix_blocks * block_size, loadable)
        pairs.append(
            {
                "pair": index,
                "prompt_tokens": len(q),
                "shared_full_block_tokens": shared,
                "b_cached_tokens": on_b.cached_tokens,
                "a_cached_tokens_second_time": again_on_a.cached_tokens,
                "b_text": on_b.text,
                "a_text_second_time": again_on_a.text,
                "b_equals_a_second_time": on_b.text == again_on_a.text,
                "p_on_a_ttft_ms": on_a.ttft_s * 1e3,
                "q_on_b_ttft_ms": on_b.ttft_s * 1e3,
            }
        )
    return {"pairs": pairs}


async def phase_ttft(
    client: Client, lengths: list[int], runs: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    filler = tokens(rng, 8)
    rows = []
    for length in lengths:
        hits: list[Sample] = []
        misses: list[Sample] = []
        for run in range(runs + 1):  # run 0 warms up this length
            prompt = tokens(rng, length)
            await client.on_replica(0, prompt, 1, filler)
            hit = await client.on_replica(1, prompt, 8, filler)
            await client.on_replica(0, tokens(rng, length), 1, filler)
            miss = await client.on_replica(1, tokens(rng, length), 8, filler)
            if run:
                hits.append(hit)
                misses.append(miss)
        row = {
            "prompt_tokens": length,
            "hit_ttft_ms": [s.ttft_s * 1e3 for s in hits],
            "miss_ttft_ms": [s.ttft_s * 1e3 for s in misses],
            "hit_cached_tokens": [s.cached_tokens for s in hits],
            "miss_cached_tokens": [s.cached_tokens for s in misses],
        }
        row["hit_p50_ms"] = statistics.median(row["hit_ttft_ms"])
        row["miss_p50_ms"] = statistics.median(row["miss_ttft_ms"])
        row["hit_over_miss"] = row["hit_p50_ms"] / row["miss_p50_ms"]
        rows.append(row)
        print(
            f"  ttft {length:>5} tokens: hit {row['hit_p50_ms']:7.1f} ms, miss "
            f"{row['miss_p50_ms']:7.1f} ms, ratio {row['hit_over_miss']:.2f}",
            flush=True,
        )
    return {"rows": rows}


async def phase_workload(
    client: Client, shape: WorkloadShape, shared: bool, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    prefixes = [tokens(rng, shape.prefix_tokens) for _ in range(shape.groups)]

    def tail() -> list[int]:
        return tokens(rng, rng.randint(*shape.tail_tokens))

    cold: list[Sample] = []
    for prefix in prefixes:
        cold.append(await client.complete(prefix + tail(), shape.max_tokens))
    if shared:
        prompts = [
            prefixes[rng.randrange(shape.groups)] + tail() for _ in range(shape.warm)
        ]
    else:
        prompts = [tokens(rng, shape.prefix_tokens) + tail() for _ in range(shape.warm)]
    gate = asyncio.Semaphore(shape.concurrency)

    async def one(prompt: list[int]) -> Sample:
        async with gate:
            return await client.complete(prompt, shape.max_tokens)

    started = time.perf_counter()
    warm = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - started
    ttfts = sorted(s.ttft_s * 1e3 for s in warm)
    out_tokens = sum(s.completion_tokens for s in warm)
    result = {
        "shared": shared,
        "shape": asdict(shape),
        "cold_ttft_mean_ms": statistics.fmean(s.ttft_s * 1e3 for s in cold),
        "warm_wall_s": wall,
        "warm_requests_per_s": len(warm) / wall,
        "warm_output_tokens_per_s": out_tokens / wall,
        "warm_ttft_p50_ms": statistics.median(ttfts),
        "warm_ttft_p95_ms": ttfts[int(0.95 * (len(ttfts) - 1))],
        "warm_cached_prompt_tokens": sum(s.cached_tokens for s in warm),
        "warm_prompt_tokens": sum(s.prompt_tokens for s in warm),
        "warm_per_replica": {
            str(r): sum(1 for s in warm if s.replica == r) for r in (0, 1)
        },
    }
    print(
        f"  {'shared' if shared else 'unique'}: {result['warm_requests_per_s']:.2f} "
        f"req/s, {result['warm_output_tokens_per_s']:.0f} tok/s, TTFT p50 "
        f"{result['warm_ttft_p50_ms']:.1f} ms p95 {result['warm_ttft_p95_ms']:.1f} ms",
        flush=True,
    )
    return result


def words(rng: random.Random, n: int) -> str:
    """``n`` pseudo-words: chat text the offline tokenizers split into tokens."""
    syllables = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "va")
    return " ".join(
        "".join(rng.choice(syllables) for _ in range(rng.randint(2, 3)))
        for _ in range(n)
    )


async def phase_multiturn(
    client: Client, shape: ConversationShape, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    per_turn: list[list[Sample]] = [[] for _ in range(shape.turns)]
    for _ in range(shape.conversations):
        messages = [{"role": "system", "content": words(rng, shape.system_words)}]
        for turn in range(shape.turns):
            messages.append({"role": "user", "content": words(rng, shape.user_words)})
            sample = await client.chat(messages, shape.max_tokens)
            messages.append({"role": "assistant", "content": sample.text})
            per_turn[turn].append(sample)
    rows = []
    for turn, samples in enumerate(per_turn, start=1):
        rows.append(
            {
                "turn": turn,
                "ttft_ms": [s.ttft_s * 1e3 for s in samples],
                "ttft_p50_ms": statistics.median(s.ttft_s * 1e3 for s in samples),
                "prompt_tokens_p50": statistics.median(
                    s.prompt_tokens for s in samples
                ),
                "cached_tokens_p50": statistics.median(
                    s.cached_tokens for s in samples
                ),
                # a turn on the replica that served the previous one reuses its
                # own cache: the workload is meant to alternate
                "same_replica_as_previous": sum(
                    1
                    for before, now in zip(
                        per_turn[turn - 2] if turn > 1 else [],
                        samples,
                        strict=False,
                    )
                    if before.replica == now.replica
                ),
            }
        )
        row = rows[-1]
        print(
            f"  turn {turn}: TTFT p50 {row['ttft_p50_ms']:.1f} ms, prompt "
            f"{row['prompt_tokens_p50']:.0f} tokens, cached {row['cached_tokens_p50']:.0f}",
            flush=True,
        )
    return asdict(shape) | {"rows": rows}


async def scrape(http: httpx.AsyncClient) -> dict[str, float]:
    """Every sample of /metrics, ``name{labels}`` -> value."""
    text = (await http.get("/metrics")).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def run(args: argparse.Namespace) -> None:
    phases = [p for p in args.phases.split(",") if p]
    result: dict[str, Any] = {"label": args.label, "model": args.model, "phases": {}}
    async with httpx.AsyncClient(base_url=args.endpoint, timeout=TIMEOUT_S) as http:
        client = Client(http, args.model)
        described = (await http.get(f"/v1/models/{args.model}")).json()
        result["deployment"] = described
        block_size = int(described["replicas"][0]["block_size"])
        for phase in phases:
            print(f"[{args.label}] {phase}", flush=True)
            started = time.monotonic()
            if phase == "correctness":
                data = await phase_correctness(client, block_size)
            elif phase == "ttft":
                data = await phase_ttft(client, args.lengths, args.runs, seed=7)
            elif phase == "multiturn":
                data = await phase_multiturn(
                    client, ConversationShape.from_args(args), seed=2028
                )
            elif phase in ("shared", "unique"):
                shape = WorkloadShape(
                    groups=args.groups,
                    warm=args.warm,
                    concurrency=args.concurrency,
                    prefix_tokens=args.prefix_tokens,
                    max_tokens=args.max_tokens,
                )
                shared = phase == "shared"
                data = await phase_workload(
                    client, shape, shared, seed=2026 if shared else 2027
                )
            else:
                raise SystemExit(f"unknown phase {phase!r}")
            data["seconds"] = time.monotonic() - started
            result["phases"][phase] = data
            args.json.write_text(json.dumps(result, indent=1))
        result["metrics"] = await scrape(http)
        if args.terminate:
            response = await http.delete(f"/v1/models/{args.model}")
            result["counters"] = response.json().get("xavier_counters")
        args.json.write_text(json.dumps(result, indent=1))


# ---- report --------------------------------------------------------------------


def report(paths: list[Path]) -> str:
    loaded = [json.loads(p.read_text()) for p in paths]
    runs = {data["label"]: data for data in loaded}
    out: list[str] = []
    for label, data in runs.items():
        rows = data["phases"].get("ttft", {}).get("rows")
        if rows:
            out += [
                f"\nTTFT on replica B, `{label}`, median of {len(rows[0]['hit_ttft_ms'])}",
                "| prompt tokens | hit (ms) | miss (ms) | hit/miss | cached on hit |",
                "| ---: | ---: | ---: | ---: | ---: |",
            ]
            for row in rows:
                out.append(
                    f"| {row['prompt_tokens']} | {row['hit_p50_ms']:.1f} | "
                    f"{row['miss_p50_ms']:.1f} | {row['hit_over_miss']:.2f} | "
                    f"{statistics.median(row['hit_cached_tokens']):.0f} |"
                )
    out += [
        "\nWorkloads (warm requests after one cold request per prefix; see shape)",
        "| deployment | workload | req/s | output tok/s | TTFT p50 (ms) | TTFT p95 (ms) "
        "| cold TTFT mean (ms) | cached/prompt tokens |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, data in runs.items():
        for kind in ("shared", "unique"):
            w = data["phases"].get(kind)
            if not w:
                continue
            out.append(
                f"| {label} | {kind} | {w['warm_requests_per_s']:.2f} | "
                f"{w['warm_output_tokens_per_s']:.0f} | {w['warm_ttft_p50_ms']:.1f} | "
                f"{w['warm_ttft_p95_ms']:.1f} | {w['cold_ttft_mean_ms']:.1f} | "
                f"{w['warm_cached_prompt_tokens'] / w['warm_prompt_tokens']:.3f} |"
            )
    base = runs.get("off", {}).get("phases", {})
    for label, data in runs.items():
        for kind in ("shared", "unique"):
            w, b = data["phases"].get(kind), base.get(kind)
            if label != "off" and w and b:
                out.append(
                    f"- {label}/{kind}: throughput x"
                    f"{w['warm_output_tokens_per_s'] / b['warm_output_tokens_per_s']:.3f} "
                    f"of off, TTFT p50 x{w['warm_ttft_p50_ms'] / b['warm_ttft_p50_ms']:.3f}"
                )
    out += multiturn_report(runs)
    out.append("\nCorrectness (greedy, 32 tokens)")
    out.append(
        "| deployment | pair | prompt | shared full-block tokens | B cached | "
        "B == A (local hit) | B == off |"
    )
    out.append("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    off_pairs = {
        p["pair"]: p
        for p in runs.get("off", {})
        .get("phases", {})
        .get("correctness", {})
        .get("pairs", [])
    }
    for label, data in runs.items():
        for p in data["phases"].get("correctness", {}).get("pairs", []):
            off = off_pairs.get(p["pair"])
            same_as_off = "-" if off is None else str(off["b_text"] == p["b_text"])
            out.append(
                f"| {label} | {p['pair']} | {p['prompt_tokens']} | "
                f"{p['shared_full_block_tokens']} | {p['b_cached_tokens']} | "
                f"{p['b_equals_a_second_time']} | {same_as_off} |"
            )
    out.append("\nLoads as served (transfer actor counters at terminate)")
    for label, data in runs.items():
        for rank, stats in sorted((data.get("counters") or {}).items()):
            latency = stats.get("load_latency") or {}
            transport = stats.get("transport") or {}
            wire = transport.get("received_wire_bytes", 0)
            useful = transport.get("received_useful_bytes", 0)
            if not latency.get("count"):
                continue
            engine = stats.get("engine") or {}
            out.append(
                f"- {label} rank {rank} ({engine.get('layers')} layers on "
                f"{engine.get('device')}, scatter path {engine.get('scatter_path')}): "
                f"{latency['count']} loads, p50 "
                f"{latency['p50_s'] * 1e3:.2f} ms, p95 {latency['p95_s'] * 1e3:.2f} ms "
                f"(last {latency['window']}); wire/useful "
                f"{wire / useful if useful else float('nan'):.3f} ({useful} useful "
                f"bytes); faults contained {stats['actor'].get('connector_faults')}"
            )
    return "\n".join(out)


def multiturn_report(runs: dict[str, Any]) -> list[str]:
    """TTFT per turn of the multi-turn phase, each deployment against ``off``."""
    with_phase = {
        label: data["phases"]["multiturn"]
        for label, data in runs.items()
        if "multiturn" in data["phases"]
    }
    if not with_phase:
        return []
    base = with_phase.get("off")
    first = next(iter(with_phase.values()))
    out = [
        f"\nMulti-turn chat: {first['conversations']} conversations x "
        f"{first['turns']} turns, round robin (each turn on the other replica), "
        f"TTFT p50 per turn (ms)",
        "| deployment | "
        + " | ".join(f"turn {r['turn']}" for r in first["rows"])
        + " |",
        "| --- |" + " ---: |" * len(first["rows"]),
    ]
    for label, phase in with_phase.items():
        cells = []
        for turn, row in enumerate(phase["rows"]):
            cell = f"{row['ttft_p50_ms']:.1f}"
            if base is not None and label != "off":
                cell += (
                    f" (x{row['ttft_p50_ms'] / base['rows'][turn]['ttft_p50_ms']:.2f})"
                )
            cells.append(cell)
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    if base is not None:
        out.append("(xN: this deployment's p50 over off's, same turn)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run")
    one.add_argument("--endpoint", required=True)
    one.add_argument("--model", required=True)
    one.add_argument("--label", required=True)
    one.add_argument("--phases", default="correctness,ttft,shared,unique")
    one.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    one.add_argument("--runs", type=int, default=5)
    one.add_argument("--json", type=Path, required=True)
    defaults = WorkloadShape()
    one.add_argument("--groups", type=int, default=defaults.groups)
    one.add_argument("--warm", type=int, default=defaults.warm)
    one.add_argument("--concurrency", type=int, default=defaults.concurrency)
    one.add_argument("--prefix-tokens", type=int, default=defaults.prefix_tokens)
    one.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    one.add_argument("--terminate", action="store_true")
    ConversationShape.add_arguments(one)
    rep = sub.add_parser("report")
    rep.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    if args.command == "run":
        asyncio.run(run(args))
    else:
        print(report(args.files))


if __name__ == "__main__":
    sys.exit(main())
