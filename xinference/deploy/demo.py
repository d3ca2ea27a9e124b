"""One command: Xavier on two CPU replicas against the same workload without it.

    python -m xinference.deploy.demo [--workdir .demo] [--groups 8] [--per-group 4]

Builds a small model offline (random weights, 8 layers of width 512: enough that
prefilling a long prompt costs more on CPU than loading its KV), starts a local
cluster (supervisor, worker, HTTP server) in this process, then twice launches two
replicas -- Xavier off, then Xavier on -- and sends the same shared-prefix workload
through the HTTP API (streamed, to time the first token). Prints one table and exits
0 only if every request succeeded, Xavier served remote hits, and both runs produced
the same text. Everything the engines, xoscar and UCX log goes to a file under
``$XINFERENCE_HOME/logs`` (its path is printed first); the terminal shows progress
and the table.

The workload: ``groups`` distinct long system prompts (about 1,500 tokens each),
each followed by ``per_group`` different questions, sent one at a time so that a
prefix is published before its next request arrives. Round-robin puts consecutive
requests on alternating replicas, so the second request of every group lands on the
replica that has not seen the prefix: with Xavier it loads the prefix from its peer
instead of computing it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..core.registry import xinference_home

MODEL_UID = "xavier-demo"
BLOCK_SIZE = 32  # vLLM's CPU backend needs a multiple of 32
# float32, not bfloat16: with bf16 on CPU, vLLM's greedy outputs change with the mere
# presence of a KV connector (a no-op one does it; its kernels take another path), so
# Xavier-on and Xavier-off outputs would differ after a few tokens for reasons that
# have nothing to do with the KV that Xavier moves. In float32 they are identical.
DTYPE = "float32"
LAUNCH_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 300.0
# The demo model: Qwen2 with random weights, built offline. Chosen by measuring on a
# 2-core machine: the 2-layer test model prefills 500 tokens in a few milliseconds,
# about what a remote load costs, so Xavier could show no saving; 8 layers of width
# 512 make a 1,500-token prefill cost far more than loading its KV (8 layers x 2 KV
# heads of 64 float32 values, K and V: 8 KiB per token), and a run still takes a
# few minutes.
DEMO_MODEL: dict[str, Any] = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    initializer_range=0.05,
)

logger = logging.getLogger("xinference.demo")


@dataclass(frozen=True, slots=True)
class Workload:
    groups: int = 8
    per_group: int = 4
    prefix_words: int = 700  # about 1,500 tokens with the demo tokenizer
    max_tokens: int = 16

    def prompts(self) -> list[str]:
        """Deterministic prompts: group g's shared prefix, then question q."""
        return [
            f"{system}\n{question}" for system, question in self._system_and_questions()
        ]

    def conversations(self) -> list[list[dict[str, str]]]:
        """The same workload as chats: group g's prefix as the system message,
        question q as the user's (the model's chat template renders them)."""
        return [
            [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            for system, question in self._system_and_questions()
        ]

    def _system_and_questions(self) -> list[tuple[str, str]]:
        pairs = []
        for group in range(self.groups):
            prefix = " ".join(_word(group * 7919 + i) for i in range(self.prefix_words))
            for question in range(self.per_group):
                tail = " ".join(
                    _word(group * 104729 + question * 31 + i) for i in range(6)
                )
                pairs.append(
                    (f"Context {group}: {prefix}", f"Question {question}: {tail}?")
                )
        return pairs


@dataclass(slots=True)
class RequestResult:
    text: str
    ttft_s: float
    replica: int
    ok: bool
    error: str = ""


@dataclass(slots=True)
class RunResult:
    xavier: bool
    launch_s: float
    requests: list[RequestResult] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # metric name -> sum
    counters_at_shutdown: dict[str, dict] = field(default_factory=dict)

    @property
    def succeeded(self) -> int:
        return sum(r.ok for r in self.requests)

    def ttft_p50_ms(self, indices: Sequence[int] | None = None) -> float:
        chosen = [
            r.ttft_s
            for i, r in enumerate(self.requests)
            if r.ok and (indices is None or i in indices)
        ]
        return 1000 * statistics.median(chosen) if chosen else float("nan")


def _word(seed: int) -> str:
    syllables = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "va", "qu", "en")
    state = (seed * 2654435761 + 12345) % (1 << 32)
    parts = []
    for _ in range(2 + state % 2):
        parts.append(syllables[state % len(syllables)])
        state //= len(syllables)
    return "".join(parts)


async def run(args: argparse.Namespace) -> int:
    from ..model.llm.tiny_model import build_tiny_qwen2
    from .local import start_local_cluster

    workload = Workload(groups=args.groups, per_group=args.per_group)
    prompts = workload.conversations()
    workdir = Path(args.workdir)  # made absolute in main()
    say(f"building the demo model in {workdir} (offline, random weights)")
    model_path = await asyncio.to_thread(
        build_tiny_qwen2, workdir / "demo-qwen2", **DEMO_MODEL
    )
    cluster = await start_local_cluster(port=0)
    say(f"cluster at {cluster.endpoint}")
    results: list[RunResult] = []
    try:
        async with httpx.AsyncClient(
            base_url=cluster.endpoint, timeout=REQUEST_TIMEOUT_S
        ) as http:
            for xavier in (False, True):
                results.append(
                    await _one_run(http, model_path, xavier, prompts, workload, args)
                )
    finally:
        await cluster.stop()
    off, on = results
    show(_table(off, on, workload))
    return _verdict(off, on, len(prompts))


async def _one_run(
    http: httpx.AsyncClient,
    model_path: Path,
    xavier: bool,
    prompts: list[list[dict[str, str]]],
    workload: Workload,
    args: argparse.Namespace,
) -> RunResult:
    options: dict = dict(
        model_uid=MODEL_UID,
        model_path=str(model_path),
        replica=2,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        enforce_eager=True,
        dtype=DTYPE,
    )
    if xavier:
        options |= dict(enable_xavier=True, xavier_gpu_cache_bytes=args.gpu_cache_bytes)
    label = "on" if xavier else "off"
    say(f"launching 2 CPU replicas, Xavier {label} (engines load in about a minute)")
    started = time.monotonic()
    response = await http.post("/v1/models", json=options, timeout=LAUNCH_TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"launch failed: {response.text}")
    deployment = response.json()
    result = RunResult(xavier=xavier, launch_s=time.monotonic() - started)
    say(f"ready in {result.launch_s:.0f} s; {deployment['xavier']}")
    try:
        for index, prompt in enumerate(prompts):
            result.requests.append(await _request(http, prompt, workload.max_tokens))
            if not result.requests[-1].ok:
                say(f"request {index} failed: {result.requests[-1].error}")
            if (index + 1) % workload.per_group == 0:
                say(
                    f"  {index + 1}/{len(prompts)} requests, TTFT p50 so far "
                    f"{result.ttft_p50_ms():.0f} ms"
                )
        result.metrics = _scrape((await http.get("/metrics")).text)
    finally:
        response = await http.delete(f"/v1/models/{MODEL_UID}")
        if response.status_code == 200:
            result.counters_at_shutdown = response.json()["xavier_counters"]
        else:
            say(f"terminate failed: {response.text}")
    say(
        f"Xavier {label}: {result.succeeded}/{len(prompts)} requests ok, "
        f"TTFT p50 {result.ttft_p50_ms():.1f} ms"
    )
    return result


async def _request(
    http: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int
) -> RequestResult:
    body = dict(
        model=MODEL_UID,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
    )
    started = time.monotonic()
    ttft = None
    pieces: list[str] = []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestResult("", 0.0, -1, False, response.text)
            replica = int(response.headers.get("x-xinference-replica", -1))
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                payload = json.loads(line[5:])
                if "error" in payload:
                    return RequestResult("", 0.0, replica, False, str(payload["error"]))
                for choice in payload.get("choices", []):
                    # The first chunk carries the first token (its text may still be
                    # empty: a partial UTF-8 sequence).
                    if ttft is None:
                        ttft = time.monotonic() - started
                    pieces.append(choice["delta"].get("content") or "")
    except httpx.HTTPError as error:
        return RequestResult("", 0.0, -1, False, repr(error))
    return RequestResult("".join(pieces), ttft or 0.0, replica, ttft is not None)


def _scrape(text: str) -> dict[str, float]:
    """Metric sample name (+ tier) -> sum over replicas."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if "tier" in sample.labels:
                name += f"{{tier={sample.labels['tier']}}}"
            totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def _cross_replica_first_touch(workload: Workload) -> list[int]:
    """Indices of each group's second request: the first on the other replica."""
    return [g * workload.per_group + 1 for g in range(workload.groups)]


def _table(off: RunResult, on: RunResult, workload: Workload) -> str:
    first_touch = _cross_replica_first_touch(workload)

    def metric(run: RunResult, name: str) -> str:
        return f"{int(run.metrics.get(name, 0)):,}"

    rows = [
        (
            "requests (ok / sent)",
            *(f"{r.succeeded} / {len(r.requests)}" for r in (off, on)),
        ),
        (
            "remote-hit tokens",
            *(metric(r, "xavier_external_tokens_loaded_total") for r in (off, on)),
        ),
        (
            "remote hits, device / cpu tier (blocks)",
            *(
                f"{metric(r, 'xavier_remote_hits_total{tier=device}')} / "
                f"{metric(r, 'xavier_remote_hits_total{tier=cpu}')}"
                for r in (off, on)
            ),
        ),
        (
            "wire bytes received",
            *(metric(r, "xavier_received_wire_bytes_total") for r in (off, on)),
        ),
        (
            "useful bytes received",
            *(metric(r, "xavier_received_useful_bytes_total") for r in (off, on)),
        ),
        ("TTFT p50, all requests (ms)", *(f"{r.ttft_p50_ms():.1f}" for r in (off, on))),
        (
            "TTFT p50, prefix new to the replica (ms)",
            *(f"{r.ttft_p50_ms(first_touch):.1f}" for r in (off, on)),
        ),
        ("launch (s)", *(f"{r.launch_s:.0f}" for r in (off, on))),
    ]
    same = sum(
        a.ok and b.ok and a.text == b.text
        for a, b in zip(off.requests, on.requests, strict=True)
    )
    width = max(len(row[0]) for row in rows)
    lines = [
        "",
        f"Shared-prefix workload: {workload.groups} system prompts of "
        f"{workload.prefix_words} words x {workload.per_group} requests, 2 CPU "
        f"replicas of a {DEMO_MODEL['num_hidden_layers']}-layer model, {DTYPE}, "
        f"block size {BLOCK_SIZE}, greedy, {workload.max_tokens} new tokens",
        f"{'':<{width}}  {'Xavier off':>14}  {'Xavier on':>14}",
    ]
    lines += [f"{name:<{width}}  {a:>14}  {b:>14}" for name, a, b in rows]
    lines.append(f"identical outputs: {same} / {len(off.requests)}")
    return "\n".join(lines)


def _verdict(off: RunResult, on: RunResult, expected: int) -> int:
    problems = []
    for run in (off, on):
        if run.succeeded != expected:
            label = "on" if run.xavier else "off"
            problems.append(
                f"Xavier {label}: {expected - run.succeeded} requests failed"
            )
    if on.metrics.get("xavier_external_tokens_loaded_total", 0) <= 0:
        problems.append("Xavier on served no remote hits")
    differing = [
        i
        for i, (a, b) in enumerate(zip(off.requests, on.requests, strict=True))
        if a.text != b.text
    ]
    if differing:
        problems.append(f"outputs differ between the runs at requests {differing}")
    for problem in problems:
        show(f"FAILED: {problem}")
    if not problems:
        show("OK: every request succeeded, Xavier shared prefixes, outputs identical")
    return 1 if problems else 0


# Where the demo's own lines go: the terminal, once everything else goes to the log.
_terminal: TextIO = sys.stdout


def show(text: str) -> None:
    print(text, file=_terminal, flush=True)


def say(message: str) -> None:
    show(f"[demo] {message}")


def send_output_to(log_path: Path) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2, so the
    engine and pool processes it starts inherit them, and C libraries such as UCX
    write there too) at ``log_path``; ``say`` and ``show`` keep writing to the
    terminal."""
    global _terminal
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
    finally:
        os.close(log)
    _terminal = terminal


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=".demo", help="where the model is built")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument(
        "--gpu-cache-bytes",
        default="64MiB",
        help="Xavier's device-tier budget (on CPU replicas the device is host memory)",
    )
    args = parser.parse_args(argv)
    args.workdir = os.path.abspath(args.workdir)
    log_path = xinference_home() / "logs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}.log"
    say(f"engine, pool and UCX logs: {log_path}")
    send_output_to(log_path)
    # CPU engines: 1 GiB of KV cache each, nothing downloaded, quiet vLLM logs.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
