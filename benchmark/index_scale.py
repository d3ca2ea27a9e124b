"""The block index at cluster scale: N replicas feeding one tracker, N mirrors following it.

Everything on the index's path is the real code: the ``BlockTrackerActor`` in its own
xoscar sub-pool (the supervisor's role), simulated replicas that send their
registrations and removals through the real ``TrackerUpdates`` from driver
processes (the transfer actors' role), and one real ``TrackerMirror`` per replica,
following the tracker by its long poll from mirror processes (the schedulers'
role; several mirrors share a process, each with its own actor ref and poll, since
this machine cannot host 64 scheduler processes).

A simulated replica serves requests whose prompts are chains of block keys: a head
shared by many requests (one of ``HEADS`` system prompts) and a tail of its own. Each
engine step (``STEP_S``) it stages the blocks it computed and has not staged yet
(registrations); its store holds ``--capacity`` blocks and drops the least recently
used ones to make room (removals), so once full a replica sends as many removals as
registrations, as serving does once the tiers are full. A demotion (device tier to
CPU tier) keeps a block's key and sends nothing; a dropped shared head is staged
again when the next request computes it.

Replicas send through ``TrackerUpdates`` as this tree configures it (one call per
``SEND_INTERVAL_S`` at most) to a tracker with this tree's mirror window; with
``--compare`` each fleet also runs first with the pacing before (each engine step's
update sent at once, a 20 ms window), in the same run.

The offered rate climbs in ``--rates`` steps of ``--level-s`` seconds each (total
registrations per second over all replicas; removals come on top once stores are
full). Per level it reports:

  changes/s   registrations + removals the tracker acknowledged per second
  trk us/chg  the tracker process's CPU time per acknowledged change
  lag p50/p99 from a probe key handed to ``TrackerUpdates.tell`` to the moment a
              mirror's ``query`` finds it (every mirror, every probe)
  polls/s     answers per mirror per second
A level is sustained when the acknowledged rate is at least 90% of the offered rate
and the lag p99 stays under a second. At the end: a mirror's lookup cost (a
100-block prompt, hits and misses, after the run) and memory per indexed block
(process RSS growth over the indexed blocks) in the tracker and in a mirror; then
the unit costs and the model of ``index_costs.py``.

Usage: python benchmark/index_scale.py [--replicas 2,8,16,32,64] [--compare] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import xoscar as xo
import xxhash

from xinference.model.llm.vllm.xavier.actor.tracker_updates import (
    SEND_INTERVAL_S,
    TrackerUpdates,
)
from xinference.model.llm.vllm.xavier.stats import ActorCounters
from xinference.model.llm.vllm.xavier.tracker import MIRROR_BATCH_S
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror

# index_costs travels by name to the tracker's pool process (its ProcessProbe):
# that process, spawned, finds it on its PYTHONPATH
_HERE = str(Path(__file__).resolve().parent)
sys.path.insert(0, _HERE)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

from index_costs import (  # noqa: E402
    HEAD_BLOCKS,
    HEAD_CHAINS,
    HEADS,
    TAIL_BLOCKS,
    TRACKER_UID,
    Design,
    answer_encoding,
    chain,
    ingest_us,
    memory_per_block,
    message_us,
    model,
    rss_bytes,
    start_tracker,
)

STEP_S = 0.02  # one engine step
# a replica's send interval and a mirror's window: each engine step and 20 ms (the
# pacing before round 3 of benchmark/results/index-scale.md), and this tree's
STEP_DESIGN = Design("per step", STEP_S, 0.02)
INTERVAL_DESIGN = Design("interval", SEND_INTERVAL_S, MIRROR_BATCH_S)
PROBE_EVERY_S = 0.05  # per driver
PROMPT_BLOCKS = 100  # a lookup's prompt
NO_RANK = -2  # a lookup on behalf of nobody: every holder counts
DRAIN_S = 3.0  # mirrors keep following this long after the last level
IDLE_S = 2.0  # the tracker process's CPU is read this long before any traffic


def probe_key(driver: int, seq: int) -> bytes:
    return xxhash.xxh3_128_digest(b"probe-%d-%d" % (driver, seq))


# ---- replicas (driver processes) ---------------------------------------------------


class SimReplica:
    """One replica's staged blocks: an LRU store of ``capacity`` keys."""

    def __init__(self, rank: int, capacity: int, updates: TrackerUpdates) -> None:
        self.rank = rank
        self.capacity = capacity
        self.updates = updates
        self.rng = random.Random(rank)
        self.held: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.pending: list[bytes] = []  # the current request's blocks not staged yet
        self.requests = 0
        self.carry = 0.0

    def _next_request(self) -> None:
        # a skewed choice of head: a few system prompts are most of the traffic
        head = HEAD_CHAINS[min(int(self.rng.expovariate(0.4)), HEADS - 1)]
        depth = self.rng.randrange(HEAD_BLOCKS // 2, HEAD_BLOCKS + 1)
        tail = chain(b"r%d-q%d" % (self.rank, self.requests), TAIL_BLOCKS)
        self.requests += 1
        self.pending = head[:depth] + tail[: self.rng.randrange(8, TAIL_BLOCKS + 1)]

    def step(self, blocks: int, extra: list[bytes]) -> int:
        """Compute ``blocks`` more blocks; stage those not held; evict to fit."""
        added: list[bytes] = []
        while blocks > 0:
            if not self.pending:
                self._next_request()
            key = self.pending.pop(0)
            blocks -= 1
            if key in self.held:
                self.held.move_to_end(key)  # a prefix hit: used again, not staged
            else:
                self.held[key] = None
                added.append(key)
        dropped = []
        while len(self.held) > self.capacity:
            dropped.append(self.held.popitem(last=False)[0])
        # probe keys are registered like any block but never held (never evicted)
        self.updates.tell(added + extra, dropped)
        return len(added) + len(extra) + len(dropped)


class CountingTracker:
    """The tracker's ref, counting acknowledged changes (by second of the ack)."""

    def __init__(self, ref: Any, acked: collections.Counter[int]) -> None:
        self._ref, self._acked = ref, acked
        self.calls: collections.Counter[int] = collections.Counter()

    async def register_blocks(self, rank: int, keys: Any) -> None:
        await self._ref.register_blocks(rank, keys)
        self._count(keys)

    async def update_blocks(
        self, rank: int, dropped: Any, added: Any, located: bytes = b""
    ) -> None:
        # ``located``: what TrackerUpdates sends since the lease-free reads (empty
        # here: the simulated replicas have no device tier)
        await self._ref.update_blocks(rank, dropped, added, located)
        self._count(dropped + added)

    async def unregister_blocks(self, rank: int, keys: Any) -> None:
        await self._ref.unregister_blocks(rank, keys)
        self._count(keys)

    def _count(self, keys: Any) -> None:
        # keys travel as a list of 16-byte keys, or packed into one bytes object
        count = len(keys) // 16 if isinstance(keys, bytes) else len(keys)
        tick = int(time.time() * 10)
        self._acked[tick] += count
        self.calls[tick] += 1


async def drive(args: dict[str, Any], ready: Any, go: Any, results: Any) -> None:
    ref = await xo.actor_ref(args["tracker"], TRACKER_UID)
    acked: collections.Counter[int] = collections.Counter()
    counting = CountingTracker(ref, acked)

    async def deadline(call: Any) -> Any:
        return await asyncio.wait_for(call, 30)

    replicas = []
    for rank in args["ranks"]:
        # "per step": no interval; each engine step's tell goes at once
        send_s = 0.0 if args["send_s"] <= STEP_S else args["send_s"]
        updates = TrackerUpdates(rank, ActorCounters(), deadline, interval_s=send_s)
        updates.tracker = counting
        replicas.append(SimReplica(rank, args["capacity"], updates))
    for replica in replicas:  # a warm fleet: every store full before timing
        replica.step(replica.capacity, [])
    for replica in replicas:
        await replica.updates.wait()
    ready.put(("driver", args["driver"]))
    t0 = await asyncio.get_running_loop().run_in_executor(None, go.get)
    probes: list[tuple[int, float]] = []  # (seq, sent at)
    handed: collections.Counter[int] = collections.Counter()  # by 0.1 s tick
    per_replica = [rate / len(args["all_ranks"]) for rate in args["rates"]]
    end = t0 + len(per_replica) * args["level_s"]
    next_probe = t0
    step = 0
    await asyncio.sleep(max(0.0, t0 - time.time()))
    while (now := time.time()) < end:
        level = int((now - t0) // args["level_s"])
        for i, replica in enumerate(replicas):
            replica.carry += per_replica[level] * STEP_S
            blocks = int(replica.carry)
            replica.carry -= blocks
            extra = []
            if i == step % len(replicas) and now >= next_probe:
                extra = [probe_key(args["driver"], len(probes))]
                probes.append((len(probes), time.time()))
                next_probe += PROBE_EVERY_S
            if blocks or extra:
                handed[int(time.time() * 10)] += replica.step(blocks, extra)
        step += 1
        await asyncio.sleep(max(0.0, t0 + step * STEP_S - time.time()))
    for replica in replicas:
        await replica.updates.wait()
    calls = dict(counting.calls)
    results.put(("driver", args["driver"], dict(acked), probes, dict(handed), calls))


def driver_main(args: dict[str, Any], ready: Any, go: Any, results: Any) -> None:
    asyncio.run(drive(args, ready, go, results))


# ---- mirrors (mirror processes) ----------------------------------------------------


class ProbedMirror(TrackerMirror):
    """A mirror that notes when each driver's next probe key becomes visible."""

    def __init__(self, drivers: int, seen: list[tuple[int, int, float]], **kw: Any):
        super().__init__(**kw)
        self._next = [0] * drivers
        self._seen = seen
        self.busy_s = 0.0

    def apply(self, changes: Any) -> None:
        started = time.process_time()
        super().apply(changes)
        self.busy_s += time.process_time() - started
        now = time.time()
        for driver, seq in enumerate(self._next):
            while self.query(NO_RANK, [probe_key(driver, seq)]) is not None:
                self._seen.append((driver, seq, now))
                seq += 1
            self._next[driver] = seq


async def follow(args: dict[str, Any], ready: Any, go: Any, results: Any) -> None:
    base_rss = rss_bytes()
    seen: list[tuple[int, int, float]] = []
    mirrors, tasks = [], []
    for rank in args["ranks"]:
        ref = await xo.actor_ref(args["tracker"], TRACKER_UID)

        def fetch(since: int, wait_s: float, ref: Any = ref, rank: int = rank) -> Any:
            return ref.mirror_changes(rank, since, wait_s)

        mirror = ProbedMirror(args["drivers"], seen, fetch=fetch, rpc_timeout_s=30)
        mirrors.append(mirror)
        tasks.append(asyncio.create_task(mirror.run()))
    while not all(mirror.ready for mirror in mirrors):
        await asyncio.sleep(0.05)
    ready.put(("mirror", args["proc"]))
    t0 = await asyncio.get_running_loop().run_in_executor(None, go.get)
    # (answers, seconds applying them, this process's CPU seconds: receiving and
    # applying) over all mirrors here, at each level's start
    marks = []
    for level in range(len(args["rates"]) + 1):
        await asyncio.sleep(max(0.0, t0 + level * args["level_s"] - time.time()))
        marks.append(
            (
                sum(m.polls for m in mirrors),
                sum(m.busy_s for m in mirrors),
                time.process_time(),
            )
        )
    end = t0 + len(args["rates"]) * args["level_s"] + DRAIN_S
    await asyncio.sleep(max(0.0, end - time.time()))
    grown = rss_bytes() - base_rss
    for mirror in mirrors:
        mirror.stop()
    await (await xo.actor_ref(args["tracker"], TRACKER_UID)).wake_mirrors()
    await asyncio.wait(tasks, timeout=10)
    results.put(
        (
            "mirror",
            args["proc"],
            seen,
            marks,
            len(mirrors),
            grown,
            lookup_cost(mirrors[0]),
            sum(mirrors[0]._index.num_blocks(r) for r in args["all_ranks"]),
        )
    )


def lookup_cost(mirror: TrackerMirror) -> tuple[float, float]:
    """Median microseconds of one ``query`` of a 100-block prompt: (hit, miss)."""
    rng = random.Random(7)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(400):
        hit = i % 2 == 0
        head = HEAD_CHAINS[rng.randrange(3)] if hit else []
        keys = head + chain(b"lookup-%d" % i, PROMPT_BLOCKS - len(head))
        started = time.perf_counter()
        mirror.query(NO_RANK, keys)
        times[hit].append((time.perf_counter() - started) * 1e6)
    return statistics.median(times[True]), statistics.median(times[False])


def mirror_main(args: dict[str, Any], ready: Any, go: Any, results: Any) -> None:
    asyncio.run(follow(args, ready, go, results))


# ---- one fleet size ----------------------------------------------------------------


def split(items: list[int], parts: int) -> list[list[int]]:
    return [items[i::parts] for i in range(parts) if items[i::parts]]


async def run_fleet(n: int, opts: argparse.Namespace, design: Design) -> dict[str, Any]:
    pool, sub, tracker, probe = await start_tracker(n, design.window_s)
    tracker_rss0 = await probe.rss()
    ranks = list(range(n))
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    gos, procs = [], []
    common = {
        "tracker": sub,
        "rates": opts.rates,
        "level_s": opts.level_s,
        "capacity": opts.capacity,
        "all_ranks": ranks,
        "send_s": design.send_s,
    }
    driver_ranks = split(ranks, opts.drivers)
    mirror_ranks = split(ranks, min(n, opts.mirror_procs)) if opts.mirrors else []
    for d, part in enumerate(driver_ranks):
        go = ctx.Queue()
        args = {**common, "driver": d, "ranks": part}
        procs.append(ctx.Process(target=driver_main, args=(args, ready, go, results)))
        gos.append(go)
    for p, part in enumerate(mirror_ranks):
        go = ctx.Queue()
        args = {**common, "proc": p, "ranks": part, "drivers": len(driver_ranks)}
        procs.append(ctx.Process(target=mirror_main, args=(args, ready, go, results)))
        gos.append(go)
    for proc in procs:
        proc.start()
    loop = asyncio.get_running_loop()
    for _ in procs:
        await loop.run_in_executor(None, ready.get, True, 300)
    # the tracker process's CPU with every process started and no traffic: the
    # pool's own upkeep, which the model keeps apart from the per-message cost
    idle_from = await probe.cpu_s()
    await asyncio.sleep(IDLE_S)
    idle = (await probe.cpu_s() - idle_from) / IDLE_S
    t0 = time.time() + 1.0
    for go in gos:
        go.put(t0)
    cpu_marks = []
    for level in range(len(opts.rates) + 1):
        await asyncio.sleep(max(0.0, t0 + level * opts.level_s - time.time()))
        cpu_marks.append(await probe.cpu_s())
    blocks = sum([await tracker.num_blocks(rank) for rank in ranks])
    tracker_rss = await probe.rss()
    got = [await loop.run_in_executor(None, results.get, True, 300) for _ in procs]
    for proc in procs:
        proc.join(30)
    await pool.stop()
    result = summarize(n, opts, got, cpu_marks, t0, blocks, tracker_rss - tracker_rss0)
    return {**result, "design": design, "trk_idle": idle}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rate_in(ticks: collections.Counter[int], start: float, stop: float) -> float:
    """Per second, of what was counted by 0.1 s ticks from ``start`` to ``stop``."""
    in_span = (c for tick, c in ticks.items() if start * 10 <= tick < stop * 10)
    return sum(in_span) / (stop - start)


def summarize(n, opts, got, cpu_marks, t0, blocks, tracker_grown) -> dict[str, Any]:
    acked: collections.Counter[int] = collections.Counter()
    handed: collections.Counter[int] = collections.Counter()
    calls: collections.Counter[int] = collections.Counter()
    sent: dict[tuple[int, int], float] = {}
    mirrors = [g for g in got if g[0] == "mirror"]
    for g in got:
        if g[0] == "driver":
            acked.update(g[2])
            handed.update(g[4])
            calls.update(g[5])
            for seq, at in g[3]:
                sent[(g[1], seq)] = at
    n_mirrors = sum(m[4] for m in mirrors)
    levels = []
    for level, rate in enumerate(opts.rates):
        start, stop = t0 + level * opts.level_s, t0 + (level + 1) * opts.level_s
        # the first tenth of a level is its ramp: count the rest
        lo = start + 0.1 * opts.level_s
        changes = rate_in(acked, lo, stop)
        offered = rate_in(handed, lo, stop)
        lags = [
            (at - sent[(d, s)]) * 1e3
            for m in mirrors
            for d, s, at in m[2]
            if (d, s) in sent and start <= sent[(d, s)] < stop
        ]
        probes = sum(1 for at in sent.values() if start <= at < stop)
        missing = probes * n_mirrors - len(lags)
        cpu = cpu_marks[level + 1] - cpu_marks[level]
        answers = sum(m[3][level + 1][0] - m[3][level][0] for m in mirrors)
        applying = sum(m[3][level + 1][1] - m[3][level][1] for m in mirrors)
        receiving = sum(m[3][level + 1][2] - m[3][level][2] for m in mirrors)
        all_acked = sum(c for t, c in acked.items() if start * 10 <= t < stop * 10)
        levels.append(
            {
                "computed": rate,
                "offered": offered,
                "changes_s": changes,
                "sustained": changes >= 0.9 * offered and pct(lags, 0.99) < 1000,
                "trk_us": cpu / max(all_acked, 1) * 1e6,
                "trk_core": cpu / opts.level_s,
                "changes": all_acked / opts.level_s,
                "calls": rate_in(calls, start, stop),
                "answers": answers / opts.level_s,
                "polls": answers / opts.level_s / max(n_mirrors, 1),
                # a mirror's CPU time applying, per change it applied
                "apply_us": applying / max(n_mirrors, 1) / max(all_acked, 1) * 1e6,
                # and its process's CPU time (receiving too), per mirror and change
                "mirror_us": receiving / max(n_mirrors, 1) / max(all_acked, 1) * 1e6,
                "lag50": pct(lags, 0.5),
                "lag99": pct(lags, 0.99),
                "unseen": missing,
            }
        )
    return {
        "n": n,
        "mirrors": n_mirrors,
        "levels": levels,
        "lookup_hit_us": statistics.median([m[6][0] for m in mirrors] or [0]),
        "lookup_miss_us": statistics.median([m[6][1] for m in mirrors] or [0]),
        "blocks": blocks,
        "trk_b_per_block": tracker_grown / max(blocks, 1),
        "mirror_b_per_block": statistics.median(
            [m[5] / max(m[4] * m[7], 1) for m in mirrors] or [0]
        ),
        "mirror_procs": len(mirrors),
    }


def print_fleet(r: dict[str, Any]) -> None:
    d = r["design"]
    print(
        f"\nN={r['n']} replicas, {r['mirrors']} mirrors in {r['mirror_procs']} "
        f"processes; {r['blocks']} blocks indexed at the end; {d.name}: send "
        f"interval {d.send_s * 1e3:.0f} ms, mirror window {d.window_s * 1e3:.0f} ms"
    )
    print(
        f"{'blocks/s':>8} {'offered':>8} {'changes/s':>9} {'trk us/chg':>10} "
        f"{'trk core':>8} {'calls/s':>7} {'polls/s':>7} {'apply us':>8} {'mir us':>6} {'lag p50':>8} "
        f"{'lag p99':>8} {'unseen':>6}  sustained"
    )
    for lv in r["levels"]:
        print(
            f"{lv['computed']:>8.0f} {lv['offered']:>8.0f} {lv['changes_s']:>9.0f} "
            f"{lv['trk_us']:>10.1f} {lv['trk_core']:>8.2f} {lv['calls']:>7.0f} "
            f"{lv['polls']:>7.1f} "
            f"{lv['apply_us']:>8.2f} {lv['mirror_us']:>6.2f} {lv['lag50']:>8.1f} "
            f"{lv['lag99']:>8.1f} "
            f"{lv['unseen']:>6}  {'yes' if lv['sustained'] else 'NO'}"
        )
    print(
        f"(lag in ms; polls/s, apply and mirror-process CPU us/change per mirror) "
        f"lookup of 100 blocks "
        f"in a mirror after the run: hit {r['lookup_hit_us']:.1f} us, miss "
        f"{r['lookup_miss_us']:.1f} us; the tracker idle {r['trk_idle']:.3f} core; "
        f"RSS growth per indexed block: tracker "
        f"{r['trk_b_per_block']:.0f} B, mirror {r['mirror_b_per_block']:.0f} B"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="2,8,16,32,64")
    parser.add_argument(
        "--rates",
        default="8000,32000,64000",
        help="blocks computed per second over all replicas, one level each; the"
        " offered changes are those not held yet, plus the removals",
    )
    parser.add_argument("--level-s", type=float, default=5.0)
    parser.add_argument("--capacity", type=int, default=2000, help="blocks/replica")
    parser.add_argument("--drivers", type=int, default=2)
    parser.add_argument("--mirror-procs", type=int, default=4)
    parser.add_argument("--no-mirrors", dest="mirrors", action="store_false")
    parser.add_argument(
        "--target",
        type=float,
        default=128_000,
        help="changes/s the model is evaluated at (64 replicas x 1000 registrations"
        " + as many removals)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run each fleet twice: sending each engine step with a 20 ms mirror "
        "window (the pacing before), then this tree's send interval and window",
    )
    parser.add_argument("--quick", action="store_true", help="N=2; one short level")
    opts = parser.parse_args()
    if opts.quick:
        opts.replicas, opts.rates, opts.level_s = "2", "4000", 2
        opts.capacity, opts.mirror_procs = 500, 2
    opts.rates = [float(r) for r in opts.rates.split(",")]
    sizes = [int(n) for n in opts.replicas.split(",")]
    print(
        f"index_scale: replicas {sizes}, computed blocks/s {opts.rates}, "
        f"{opts.level_s:.0f} s per level, {opts.capacity} blocks per replica, "
        f"{opts.drivers} driver processes, mirrors in up to {opts.mirror_procs} "
        f"processes, {os.cpu_count()} cores"
    )
    designs = [STEP_DESIGN, INTERVAL_DESIGN] if opts.compare else [INTERVAL_DESIGN]
    results = []
    for n in sizes:
        for design in designs:
            result = asyncio.run(run_fleet(n, opts, design))
            print_fleet(result)
            sys.stdout.flush()
            results.append(result)
    costs = {
        "ingest": ingest_us(),
        "fanout": answer_encoding(),
        "message": asyncio.run(message_us()),
        "idle": statistics.median(r["trk_idle"] for r in results),
    }
    print(f"the tracker's own work per change, in process: {costs['ingest']:.2f} us")
    print(
        f"the tracker process's CPU per call carrying nothing: {costs['message']:.0f} us"
    )
    model(results, opts.target, [STEP_DESIGN, INTERVAL_DESIGN], costs)
    tracker_b, mirror_b = memory_per_block()
    print(
        f"\nmemory per indexed block (tracemalloc; 64 ranks x 2000 blocks, log "
        f"included): tracker {tracker_b:.0f} B, mirror {mirror_b:.0f} B"
    )


if __name__ == "__main__":
    main()
