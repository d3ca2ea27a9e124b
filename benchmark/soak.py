"""Soak: thousands of shared-prefix requests over two Xavier replicas, a tenth of
them cancelled by the client mid-stream; then leases, file descriptors and memory.

    python benchmark/soak.py                       # 2,000 requests, 16 in flight
    python benchmark/soak.py --requests 300        # a shorter run

It starts its own local cluster (``xinference local`` in a subprocess, home in
``--home``) with the offline test model on the CPU, and:

1. computes the reference: every distinct prompt once on a fresh Xavier-off
   deployment (one replica, greedy, ``--max-tokens``, ``--reference-concurrency``
   in flight);
2. launches two replicas with Xavier (round robin, so a prefix computed on one
   replica is loaded by the other) and sends ``--warmup`` requests;
3. counts the open file descriptors and resident memory of the server and of
   every process under it (replica sub-pools, vLLM engine cores and workers);
4. sends ``--requests`` requests, ``--concurrency`` in flight, each a prompt drawn
   (seeded) from ``--groups`` shared prefixes x ``--questions`` questions: half
   streamed, half not, and ``--cancel`` of them streamed and dropped by the client
   after the first chunk (the connection is closed mid-stream);
5. requires every completed output to equal the reference, every request that was
   not cancelled to succeed, and, once the replicas are idle, zero Xavier leases,
   zero loads and requests in flight; then counts descriptors and memory again and
   requires growth within ``--fd-bound`` descriptors and ``--rss-bound`` of
   resident memory per process (a replica sub-pool may also grow by what its
   Xavier snapshot store gained: the store fills as prefixes are published);
6. terminates the model and stops the server, which must leave no process.

It prints one table and exits 0 only if every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xinference.deploy.demo import Workload  # noqa: E402

ENDPOINT = re.compile(r"Xinference serving at (http://\S+)")
MODEL = "tiny-qwen2"
LAUNCH = dict(
    model_name=MODEL,
    block_size=32,
    max_model_len=2048,
    enforce_eager=True,
    dtype="float32",  # bf16 CPU outputs change with a KV connector configured
)


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    mismatched: int = 0
    bytes_checked: int = 0
    streamed: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: list[tuple[str, str, str]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


# ---- the server ------------------------------------------------------------------


class Server:
    def __init__(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.log = home / f"soak-server-{time.strftime('%Y%m%d-%H%M%S')}.log"
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_LOGGING_LEVEL="WARNING",
            XINFERENCE_HOME=str(home),
            PYTHONPATH=os.pathsep.join(
                [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xinference.deploy.cmdline", "local", "-p", "0"],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
        deadline = time.monotonic() + 120
        while True:
            found = ENDPOINT.search(self.log.read_text(errors="replace"))
            if found:
                self.endpoint = found.group(1)
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; see {self.log}")
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]

    def stop(self) -> list[int]:
        """SIGTERM, then the pids that had to be killed (none when clean)."""
        tree = self.processes()
        self.process.send_signal(signal.SIGTERM)
        killed = []
        try:
            self.process.wait(180)
        except subprocess.TimeoutExpired:
            self.process.kill()
            killed.append(self.process.pid)
        _, alive = psutil.wait_procs(tree[1:], timeout=15)
        for process in alive:
            process.kill()
            killed.append(process.pid)
        return killed


def footprint(server: Server) -> dict[int, tuple[str, int, int]]:
    """pid -> (what it is, open descriptors, resident bytes) of every process."""
    found = {}
    for process in server.processes():
        try:
            command = " ".join(process.cmdline())
            if process.pid == server.process.pid:
                name = "server (supervisor, worker, HTTP)"
            elif "start_sub_pool" in command:
                name = "replica sub-pool"
            elif "resource_tracker" in command:
                name = "multiprocessing resource tracker"
            else:
                name = command.split()[0] if command else process.name()
            found[process.pid] = (name, process.num_fds(), process.memory_info().rss)
        except psutil.NoSuchProcess:
            pass
    return found


# ---- requests --------------------------------------------------------------------


async def complete(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> str:
    response = await http.post(
        "/v1/completions",
        json=dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0),
    )
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
    return str(response.json()["choices"][0]["text"])


async def stream(
    http: httpx.AsyncClient, prompt: str, max_tokens: int, cancel: bool
) -> str | None:
    """The streamed text; None when ``cancel`` dropped the connection after the
    first chunk."""
    text = []
    body = dict(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"in-band error: {event['error']}")
            text.extend(choice["text"] for choice in event["choices"])
            if cancel:
                return None  # leaving the block closes the connection mid-stream
    return "".join(text)


async def reference_outputs(
    endpoint: str, prompts: list[str], max_tokens: int, concurrency: int
) -> dict[str, str]:
    """Each prompt's output on a fresh Xavier-off deployment (one replica)."""
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=endpoint, timeout=900, limits=limits) as http:
        response = await http.post("/v1/models", json=dict(LAUNCH, replica=1))
        response.raise_for_status()
        texts: dict[str, str] = {}
        queue = list(prompts)

        async def client() -> None:
            while queue:
                prompt = queue.pop()
                texts[prompt] = await complete(http, prompt, max_tokens)

        try:
            await asyncio.gather(*(client() for _ in range(concurrency)))
        finally:
            (await http.delete(f"/v1/models/{MODEL}")).raise_for_status()
        return texts


async def soak(
    endpoint: str,
    prompts: list[str],
    reference: dict[str, str],
    args: argparse.Namespace,
    count: int,
    seed: int,
    tally: Tally,
) -> None:
    rng = random.Random(seed)
    plan = [
        (rng.choice(prompts), rng.random() < args.cancel, rng.random() < 0.5)
        for _ in range(count)
    ]
    queue: asyncio.Queue[tuple[str, bool, bool]] = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    started = time.monotonic()

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt, cancel, streamed = queue.get_nowait()
            tally.sent += 1
            begun = time.monotonic()
            try:
                if cancel:
                    await stream(http, prompt, args.max_tokens, cancel=True)
                    tally.cancelled += 1
                    continue
                if streamed:
                    tally.streamed += 1
                    text = await stream(http, prompt, args.max_tokens, cancel=False)
                else:
                    text = await complete(http, prompt, args.max_tokens)
            except Exception as error:  # counted, reported, the soak goes on
                tally.failed += 1
                tally.errors.append(repr(error)[:300])
                continue
            tally.seconds.append(time.monotonic() - begun)
            tally.completed += 1
            assert text is not None
            tally.bytes_checked += len(text.encode())
            if text != reference[prompt]:
                tally.mismatched += 1
                tally.mismatches.append((prompt[:60], text, reference[prompt]))
            finished = tally.completed + tally.cancelled + tally.failed
            if finished % 200 == 0:
                print(
                    f"  {finished} done: {tally.completed} completed, "
                    f"{tally.cancelled} cancelled, {tally.failed} failed, "
                    f"{tally.mismatched} mismatched "
                    f"({time.monotonic() - started:.0f} s)",
                    flush=True,
                )

    async with httpx.AsyncClient(base_url=endpoint, timeout=600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))


async def idle_state(endpoint: str, bound_s: float) -> list[dict[str, Any]]:
    """Each replica's stats once nothing is in flight (or at ``bound_s``)."""
    deadline = time.monotonic() + bound_s
    async with httpx.AsyncClient(base_url=endpoint, timeout=60) as http:
        while True:
            stats = (await http.get(f"/v1/models/{MODEL}/stats")).json()
            busy = sum(
                s["requests_in_flight"]
                + s["xavier"]["store"]["active_leases"]
                + s["xavier"]["in_flight_loads"]
                for s in stats
            )
            if busy == 0 or time.monotonic() > deadline:
                return list(stats)
            await asyncio.sleep(0.5)


# ---- main ------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cancel", type=float, default=0.1)
    # Many prefixes, few questions each: a prefix is often new to the replica a
    # request lands on, so Xavier loads it (with 16 prefixes both replicas soon
    # hold every one and nearly every request is a local prefix-cache hit).
    parser.add_argument("--groups", type=int, default=250)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument(
        "--reference-concurrency",
        type=int,
        default=16,
        help="1: one prompt at a time (slower; batching did not change outputs "
        "in our runs)",
    )
    parser.add_argument("--prefix-words", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--fd-bound", type=int, default=16, help="per process")
    parser.add_argument(
        "--rss-bound", type=float, default=0.10, help="fraction, per process"
    )
    parser.add_argument("--rss-floor-mib", type=float, default=32.0)
    parser.add_argument("--home", type=Path, default=REPO / ".soak")
    args = parser.parse_args()

    workload = Workload(
        groups=args.groups,
        per_group=args.questions,
        max_tokens=args.max_tokens,
        prefix_words=args.prefix_words,
    )
    prompts = workload.prompts()
    began = time.monotonic()
    server = Server(args.home)
    print(f"server at {server.endpoint}, log {server.log}", flush=True)
    checks: dict[str, bool] = {}
    rows: list[tuple[str, str]] = []
    try:
        print(
            f"reference: {len(prompts)} prompts on a Xavier-off engine, "
            f"{args.reference_concurrency} in flight",
            flush=True,
        )
        reference = asyncio.run(
            reference_outputs(
                server.endpoint, prompts, args.max_tokens, args.reference_concurrency
            )
        )
        with httpx.Client(base_url=server.endpoint, timeout=900) as http:
            response = http.post(
                "/v1/models",
                json=dict(
                    LAUNCH,
                    replica=2,
                    enable_xavier=True,
                    xavier_gpu_cache_bytes="64MiB",
                ),
            )
            response.raise_for_status()
        warm = Tally()
        asyncio.run(
            soak(server.endpoint, prompts, reference, args, args.warmup, -1, warm)
        )
        stats_before = asyncio.run(idle_state(server.endpoint, 60))
        with httpx.Client(base_url=server.endpoint, timeout=60) as http:
            described = http.get(f"/v1/models/{MODEL}").json()
        rank_of = {r["pid"]: r["rank"] for r in described["replicas"]}
        before = footprint(server)
        tally = Tally()
        print(
            f"soak: {args.requests} requests, {args.concurrency} in flight", flush=True
        )
        soak_began = time.monotonic()
        asyncio.run(
            soak(
                server.endpoint,
                prompts,
                reference,
                args,
                args.requests,
                args.seed,
                tally,
            )
        )
        soak_s = time.monotonic() - soak_began
        stats = asyncio.run(idle_state(server.endpoint, 60))
        after = footprint(server)
        with httpx.Client(base_url=server.endpoint, timeout=900) as http:
            (http.delete(f"/v1/models/{MODEL}")).raise_for_status()
    finally:
        leftovers = server.stop()

    leases = sum(s["xavier"]["store"]["active_leases"] for s in stats)
    loads = sum(s["xavier"]["in_flight_loads"] for s in stats)
    in_flight = sum(s["requests_in_flight"] for s in stats)
    hits = sum(
        s["xavier"]["store"]["device_hits"] + s["xavier"]["store"]["cpu_hits"]
        for s in stats
    )
    moved = sum(s["xavier"]["transport"]["received_useful_bytes"] for s in stats)
    loaded = sum(s["xavier"]["actor"]["loads_ok"] for s in stats)
    load_failures = sum(s["xavier"]["actor"]["loads_failed"] for s in stats)
    expired = sum(s["xavier"]["actor"]["leases_expired"] for s in stats)
    warm_ok = warm.failed == 0 and warm.mismatched == 0
    checks["warm-up: no failure, outputs equal"] = warm_ok
    checks["every request not cancelled succeeded"] = tally.failed == 0
    checks["every completed output equals the Xavier-off reference"] = (
        tally.mismatched == 0
    )
    checks["completed + cancelled + failed = sent"] = (
        tally.completed + tally.cancelled + tally.failed == tally.sent == args.requests
    )
    checks["Xavier loaded prefixes across replicas"] = loaded > 0
    checks["zero active leases, loads and requests in flight after"] = (
        leases == loads == in_flight == 0
    )

    def store_bytes(replicas: list[dict[str, Any]]) -> dict[int, int]:
        return {
            s["rank"]: s["xavier"]["store"]["device_bytes"]
            + s["xavier"]["store"]["cpu_bytes"]
            for s in replicas
        }

    # A replica sub-pool holds its transfer actor's snapshot store, which fills
    # as prefixes are published (up to its budget and the engine's block count):
    # that growth is allowed on top of the bound.
    store_before, store_after = store_bytes(stats_before), store_bytes(stats)
    growth_ok = True
    for pid, (name, fds, rss) in sorted(before.items()):
        if pid not in after:
            growth_ok = False
            rows.append((f"{name} ({pid})", "exited during the soak"))
            continue
        _, fds2, rss2 = after[pid]
        rss_limit = max(rss * args.rss_bound, args.rss_floor_mib * 2**20)
        store_note = ""
        if pid in rank_of:
            rank = rank_of[pid]
            grown = store_after[rank] - store_before[rank]
            rss_limit += max(grown, 0)
            store_note = (
                f" (store {store_before[rank] / 2**20:.0f} -> "
                f"{store_after[rank] / 2**20:.0f} MiB)"
            )
        ok = fds2 - fds <= args.fd_bound and rss2 - rss <= rss_limit
        growth_ok = growth_ok and ok
        rows.append(
            (
                f"{name} ({pid})",
                f"fds {fds} -> {fds2}, RSS {rss / 2**20:.0f} -> {rss2 / 2**20:.0f} MiB"
                + store_note
                + ("" if ok else "  OVER BOUND"),
            )
        )
    checks[
        f"growth per process <= {args.fd_bound} fds and "
        f"<= max({args.rss_bound:.0%}, {args.rss_floor_mib:.0f} MiB) RSS "
        "(+ the snapshot store's growth for a replica sub-pool)"
    ] = growth_ok
    checks["the server stopped cleanly, no process left"] = leftovers == []

    seconds = sorted(tally.seconds)
    print()
    print(f"| soak ({time.strftime('%Y-%m-%d')}) | |")
    print("| --- | --- |")
    table = [
        ("requests sent", f"{tally.sent} ({args.concurrency} in flight)"),
        ("completed (streamed)", f"{tally.completed} ({tally.streamed})"),
        ("cancelled mid-stream by the client", str(tally.cancelled)),
        ("failed", str(tally.failed)),
        (
            "distinct prompts (groups x questions)",
            f"{len(prompts)} ({args.groups} x {args.questions})",
        ),
        ("outputs compared / mismatched", f"{tally.completed} / {tally.mismatched}"),
        ("output bytes compared", f"{tally.bytes_checked:,}"),
        ("Xavier loads ok / failed", f"{loaded} / {load_failures}"),
        ("Xavier blocks served from snapshots", f"{hits:,}"),
        ("Xavier bytes loaded", f"{moved:,}"),
        ("leases expired (forgotten by a loader)", str(expired)),
        (
            "after: active leases / loads / requests",
            f"{leases} / {loads} / {in_flight}",
        ),
        (
            "request seconds p50 / p99",
            (
                f"{seconds[len(seconds) // 2]:.2f} / "
                f"{seconds[int(len(seconds) * 0.99)]:.2f}"
                if seconds
                else "-"
            ),
        ),
        (
            "soak duration",
            f"{soak_s:.0f} s (whole run {time.monotonic() - began:.0f} s)",
        ),
        *rows,
    ]
    for name, value in table:
        print(f"| {name} | {value} |")
    print()
    for name, ok in checks.items():
        print(f"{'OK  ' if ok else 'FAIL'} {name}")
    for error in tally.errors[:5]:
        print("  error:", error)
    for prompt, got, want in tally.mismatches[:5]:
        print(f"  mismatch on {prompt!r}: {got!r} != {want!r}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
