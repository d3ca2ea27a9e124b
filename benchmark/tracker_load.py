"""The block tracker at a whole fleet's message rate: N replicas' calls and N mirrors'
polls against the real ``BlockTrackerActor``, measured directly where
``index_scale.py`` has to extrapolate.

``index_scale.py`` runs real mirrors, and from N = 8 up this 2-core machine cannot
apply every change N times (each mirror applies every change of the fleet): its
mirror and driver processes starve long before the tracker. Here the tracker's side
is the same (its own xoscar sub-pool, ``update_blocks`` calls of packed keys, long
polls answered from the change log) but the other ends are thin: a replica sends a
chunk of fresh random keys each send interval and drops the chunk it sent a second
before (as many removals as registrations, a store of a second of traffic); a
mirror's loop polls ``mirror_changes`` with the version of its last answer and does
not apply it, only looks for the probe keys in it. So the tracker sees the fleet's
changes/s, calls/s and answers/s, and its process's CPU time per second is the
figure issue 33's target is about ("the tracker's work within one core").

Lag: every ``PROBE_EVERY_S`` one replica adds a probe key; from ``tell`` time (the
key handed to the sender) to the first answer holding it, per mirror: the replica's
send interval, the mirror's window and both messages (not a mirror's apply, which
``index_scale.py`` measures, 1-3 ms per answer).

Relays (``--hosts H``): each design runs again with the replicas spread over H
tracker relays (``tracker_relay.py``), each in its own process, as one per worker
host would be: replicas call their relay, mirrors poll it, and the tracker sees
each relay's batched ``update_blocks_batch`` calls and its one long poll. Its
calls/s and answers/s are then those (counted by the relays); "relays core" is
the relays' processes together, "max relay" the busiest one.

Usage: python benchmark/tracker_load.py [--replicas 64] [--rate 128000] [--compare]
    [--hosts 8]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import xoscar as xo
import xxhash

from xinference.model.llm.vllm.xavier.actor.tracker_updates import SEND_INTERVAL_S
from xinference.model.llm.vllm.xavier.tracker import MIRROR_BATCH_S
from xinference.model.llm.vllm.xavier.tracker_relay import TrackerRelayActor

_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)  # index_costs, here and in the spawned processes
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

from index_costs import (  # noqa: E402
    PROBE_UID,
    TRACKER_UID,
    Design,
    ProcessProbe,
    start_tracker,
)

RELAY_UID = "tracker-load-relay"

PROBE_EVERY_S = 0.02
KEEP_S = 1.0  # a replica drops what it sent this long ago
STEP_DESIGN = Design("per step", 0.02, 0.02)
INTERVAL_DESIGN = Design("interval", SEND_INTERVAL_S, MIRROR_BATCH_S)


def probe_key(seq: int) -> bytes:
    return xxhash.xxh3_128_digest(b"load-probe-%d" % seq)


async def replicas_loop(refs: dict[int, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Each replica: one ``update_blocks`` per send interval, a chunk of fresh keys
    in, the chunk of ``KEEP_S`` ago out; probes go to the first replica."""
    per_call = max(1, round(args["rate"] / 2 / args["n"] * args["send_s"]))
    kept = max(1, round(KEEP_S / args["send_s"]))
    sent_probes: list[tuple[int, float]] = []
    calls = 0

    async def one(rank: int, offset: float) -> None:
        nonlocal calls
        history: list[bytes] = []
        await asyncio.sleep(offset)
        tick = time.time()
        while tick < args["end"]:
            added = os.urandom(16 * per_call)
            if rank == 0:
                # probes handed over since the last send travel in this one
                while args["t0"] + len(sent_probes) * PROBE_EVERY_S <= tick:
                    seq = len(sent_probes)
                    sent_probes.append((seq, args["t0"] + seq * PROBE_EVERY_S))
                    added += probe_key(seq)
            history.append(added)
            dropped = history.pop(0) if len(history) > kept else b""
            await refs[rank].update_blocks(rank, dropped, added)
            calls += 1
            tick += args["send_s"]
            await asyncio.sleep(max(0.0, tick - time.time()))

    await asyncio.sleep(max(0.0, args["t0"] - time.time()))
    started = time.process_time()
    ranks = args["ranks"]
    await asyncio.gather(
        *(one(r, i * args["send_s"] / len(ranks)) for i, r in enumerate(ranks))
    )
    return {
        "calls": calls,
        "probes": sent_probes,
        "cpu": time.process_time() - started,
    }


async def mirrors_loop(refs: dict[int, Any], args: dict[str, Any]) -> dict[str, Any]:
    """Each mirror: long polls from the version of its last answer; notes when each
    probe first shows up in an answer."""
    seen: list[tuple[int, float]] = []
    answers = 0

    async def one(rank: int) -> None:
        nonlocal answers
        since, next_probe = -1, 0
        while time.time() < args["end"] + 0.5:
            changes = await refs[rank].mirror_changes(rank, since, 1.0)
            since = changes.version
            answers += 1
            now = time.time()
            while probe_key(next_probe) in changes.packed:
                seen.append((next_probe, now))
                next_probe += 1

    started = time.process_time()
    await asyncio.gather(*(one(r) for r in args["ranks"]))
    return {"answers": answers, "seen": seen, "cpu": time.process_time() - started}


async def side(kind: str, args: dict[str, Any], ready: Any, go: Any) -> Any:
    """Connects (a process's first xoscar call takes seconds here), then waits for
    the start time and runs one side."""
    refs = {}
    for rank in args["ranks"]:
        refs[rank] = await xo.actor_ref(*args["targets"][rank])
        await refs[rank].replicas()
    ready.put(kind)
    t0 = await asyncio.get_running_loop().run_in_executor(None, go.get)
    args = {**args, "t0": t0, "end": t0 + args["seconds"]}
    loop = replicas_loop if kind == "replicas" else mirrors_loop
    return await loop(refs, args)


def side_main(
    kind: str, args: dict[str, Any], ready: Any, go: Any, results: Any
) -> None:
    results.put((kind, asyncio.run(side(kind, args, ready, go))))


async def start_relays(tracker: str, hosts: int) -> tuple[Any, list[Any], list[Any]]:
    """(pool, relays, their processes' probes): one relay per sub-pool process."""
    pool = await xo.create_actor_pool("127.0.0.1", n_process=hosts)
    relays, probes = [], []
    for address in pool.sub_processes:
        relays.append(
            await xo.create_actor(
                TrackerRelayActor, tracker, TRACKER_UID, address=address, uid=RELAY_UID
            )
        )
        probes.append(
            await xo.create_actor(ProcessProbe, address=address, uid=PROBE_UID)
        )
    return pool, relays, probes


async def run(
    n: int, opts: argparse.Namespace, design: Design, hosts: int = 0
) -> dict[str, Any]:
    pool, sub, _, probe = await start_tracker(n, design.window_s)
    targets = {rank: (sub, TRACKER_UID) for rank in range(n)}
    relays: list[Any] = []
    relay_probes: list[Any] = []
    if hosts:
        relay_pool, relays, relay_probes = await start_relays(sub, hosts)
        addresses = list(relay_pool.sub_processes)
        targets = {rank: (addresses[rank % hosts], RELAY_UID) for rank in range(n)}
    common = {"targets": targets, "n": n, "rate": opts.rate, "seconds": opts.seconds}
    common["send_s"] = design.send_s
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = []
    for kind in ("replicas", "mirrors"):
        for part in range(opts.procs):
            args = {**common, "ranks": list(range(n))[part :: opts.procs]}
            procs.append(
                ctx.Process(target=side_main, args=(kind, args, ready, go, results))
            )
    for proc in procs:
        proc.start()
    loop = asyncio.get_running_loop()
    for _ in procs:
        await loop.run_in_executor(None, ready.get, True, 300)
    t0 = time.time() + opts.start_s
    end = t0 + opts.seconds
    for _ in procs:
        go.put(t0)
    # measured from a second into the run to its end: the ramp left out
    await asyncio.sleep(max(0.0, t0 + 1.0 - time.time()))
    cpu_from = await probe.cpu_s()
    relays_from = [await p.cpu_s() for p in relay_probes]
    await asyncio.sleep(max(0.0, end - time.time()))
    cpu = (await probe.cpu_s() - cpu_from) / (end - t0 - 1.0)
    relay_cores = [
        (await p.cpu_s() - start) / (end - t0 - 1.0)
        for p, start in zip(relay_probes, relays_from, strict=True)
    ]
    relay_stats = [await relay.stats() for relay in relays]
    got = [await loop.run_in_executor(None, results.get, True, 120) for _ in procs]
    for proc in procs:
        proc.join(30)
    if hosts:  # before the tracker: their polls would log it gone
        for relay in relays:
            await xo.destroy_actor(relay)
        await relay_pool.stop()
    await pool.stop()
    sides: dict[str, list[dict[str, Any]]] = {"replicas": [], "mirrors": []}
    for kind, result in got:
        sides[kind].append(result)
    sent = {seq: at for r in sides["replicas"] for seq, at in r["probes"]}
    lags = sorted(
        (at - sent[seq]) * 1e3
        for m in sides["mirrors"]
        for seq, at in m["seen"]
        if seq in sent
    )
    expected = len(sent) * n
    if hosts:  # what the tracker received and sent: the relays' forwards and polls
        calls = sum(stats["forwards"] for stats in relay_stats)
        answers = sum(stats["polls"] for stats in relay_stats)
    else:
        calls = sum(r["calls"] for r in sides["replicas"])
        answers = sum(m["answers"] for m in sides["mirrors"])
    return {
        "n": n,
        "design": design,
        "hosts": hosts,
        "trk_core": cpu,
        "relays_core": sum(relay_cores),
        "max_relay": max(relay_cores, default=0.0),
        "calls_s": calls / opts.seconds,
        "answers_s": answers / opts.seconds,
        "lag50": pct(lags, 0.5),
        "lag99": pct(lags, 0.99),
        "unseen": expected - len(lags),
        "sides_core": sum(s["cpu"] for v in sides.values() for s in v) / opts.seconds,
    }


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="64")
    parser.add_argument("--rate", type=float, default=128_000, help="changes/s")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--start-s", type=float, default=1.5)
    parser.add_argument("--procs", type=int, default=2, help="per side")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="also run each design through this many tracker relays (0: none)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also the pacing before: a call each 20 ms engine step, 20 ms window",
    )
    parser.add_argument(
        "--designs",
        default="",
        help="more designs, send_ms/window_ms each, comma-separated (e.g. 40/30)",
    )
    opts = parser.parse_args()
    designs = [STEP_DESIGN, INTERVAL_DESIGN] if opts.compare else [INTERVAL_DESIGN]
    for spec in filter(None, opts.designs.split(",")):
        send_ms, window_ms = (float(x) for x in spec.split("/"))
        designs.append(Design(spec, send_ms / 1e3, window_ms / 1e3))
    print(
        f"tracker_load: {opts.rate:.0f} changes/s, {opts.seconds:.0f} s per run, "
        f"{opts.procs}+{opts.procs} client processes, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'design':>11} {'N':>3} {'send ms':>7} {'win ms':>6} {'calls/s':>7} "
        f"{'answers/s':>9} {'trk core':>8} {'us/msg':>6} {'lag p50':>7} "
        f"{'lag p99':>7} {'unseen':>6} {'clients core':>12} {'relays core':>11} "
        f"{'max relay':>9}"
    )
    rows: dict[str, list[dict[str, Any]]] = {}
    for _ in range(opts.repeat):
        for n in [int(x) for x in opts.replicas.split(",")]:
            for design, hosts in [
                (d, h)
                for d in designs
                for h in ([0, opts.hosts] if opts.hosts else [0])
            ]:
                r = asyncio.run(run(n, opts, design, hosts))
                name = f"{design.name}/{hosts}h" if hosts else design.name
                rows.setdefault(name, []).append(r)
                messages = r["calls_s"] + r["answers_s"]
                print(
                    f"{name:>11} {n:>3} {design.send_s * 1e3:>7.0f} "
                    f"{design.window_s * 1e3:>6.0f} {r['calls_s']:>7.0f} "
                    f"{r['answers_s']:>9.0f} {r['trk_core']:>8.2f} "
                    f"{r['trk_core'] / max(messages, 1) * 1e6:>6.0f} "
                    f"{r['lag50']:>7.1f} {r['lag99']:>7.1f} {r['unseen']:>6} "
                    f"{r['sides_core']:>12.2f} {r['relays_core']:>11.2f} "
                    f"{r['max_relay']:>9.2f}"
                )
                sys.stdout.flush()
    if opts.repeat > 1:
        for name, runs in rows.items():
            print(
                f"median over {len(runs)} runs, {name}: tracker "
                f"{statistics.median(r['trk_core'] for r in runs):.2f} core, lag p99 "
                f"{statistics.median(r['lag99'] for r in runs):.1f} ms"
            )


if __name__ == "__main__":
    main()
