"""The block index's unit costs, each measured alone, and the model that turns them
into the tracker's cores at a fleet size this machine cannot drive.

``index_scale.py`` measures whole fleets; from N = 8 up this 2-core machine starves
its own driver and mirror processes before the tracker, so the fleet-size answer
comes from this model: per-change costs (the tracker's own work, serializing a
change into an answer), a per-message cost (xoscar, asyncio), and how many
messages a design sends (a replica's send interval, a mirror's window).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time
from typing import Any

import xoscar as xo
import xxhash

from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror

TRACKER_UID, PROBE_UID = "index-scale-tracker", "index-scale-probe"
HEADS, HEAD_BLOCKS, TAIL_BLOCKS = 16, 32, 64  # shared system prompts, user tails


def chain(seed: bytes, n: int) -> list[bytes]:
    keys, parent = [], xxhash.xxh3_128_digest(seed)
    for i in range(n):
        parent = xxhash.xxh3_128_digest(parent + i.to_bytes(4, "little"))
        keys.append(parent)
    return keys


HEAD_CHAINS = [chain(b"head-%d" % h, HEAD_BLOCKS) for h in range(HEADS)]


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ProcessProbe(xo.StatelessActor):
    """Lives in the tracker's process: that process's CPU time and memory."""

    def cpu_s(self) -> float:
        return time.process_time()

    def rss(self) -> int:
        return rss_bytes()


async def start_tracker(
    replicas: int, window_s: float | None = None
) -> tuple[Any, str, Any, Any]:
    """(pool, its sub-pool's address, tracker, probe): the real tracker alone in a
    sub-pool of its own, as in the supervisor, ``replicas`` ranks registered, and
    the probe reading that process's CPU time and memory."""
    pool = await xo.create_actor_pool("127.0.0.1", n_process=1)
    (sub,) = list(pool.sub_processes)
    tracker = await xo.create_actor(
        BlockTrackerActor, window_s, address=sub, uid=TRACKER_UID
    )
    probe = await xo.create_actor(ProcessProbe, address=sub, uid=PROBE_UID)
    for rank in range(replicas):
        await tracker.register_replica(rank, f"sim://{rank}")
    return pool, sub, tracker, probe


async def message_us(calls: int = 2000) -> float:
    """The tracker process's CPU time per call that carries nothing: what one
    xoscar message costs it, whatever it carries (the model's rpc term, alone)."""
    pool, _, tracker, probe = await start_tracker(1)
    started = await probe.cpu_s()
    for _ in range(calls):
        await tracker.num_blocks(0)
    spent = await probe.cpu_s() - started
    await pool.stop()
    return spent / calls * 1e6


def ingest_us(batch: int = 32, ranks: int = 64, per_rank: int = 2000) -> float:
    """The tracker's own work per change, called in process (no xoscar): a fleet's
    registrations of ``batch`` keys, then as many removals, with this tree's
    tracker (its index and change log) and the keys as ``TrackerUpdates`` sends
    them (packed where the tree packs them)."""
    try:
        from xinference.model.llm.vllm.xavier.change_log import pack_keys
    except ImportError:  # main's tree sends lists

        def pack_keys(keys: Any) -> Any:
            return list(keys)

    tracker = BlockTrackerActor()
    updates = []
    for rank in range(ranks):
        tracker.register_replica(rank, f"sim://{rank}")
        keys = chain(b"ingest-%d" % rank, per_rank)
        updates += [
            (rank, pack_keys(keys[i : i + batch])) for i in range(0, per_rank, batch)
        ]
    started = time.process_time()
    for rank, keys in updates:
        tracker.register_blocks(rank, keys)
    for rank, keys in updates:
        tracker.unregister_blocks(rank, keys)
    return (time.process_time() - started) / (2 * ranks * per_rank) * 1e6


@dataclasses.dataclass(frozen=True)
class Design:
    """How often a replica calls the tracker and a mirror is answered."""

    name: str
    send_s: float  # a replica's send interval (an engine step when it sends each)
    window_s: float  # a mirror's window: at most one answer per this


def solve_rpc(results: list[dict[str, Any]], costs: dict[str, float]) -> list[float]:
    """The model's rpc term, one value per sustained level of the runs: the
    tracker's measured CPU time less its idle upkeep and the ingest and fan-out
    terms, per message."""
    rpcs = []
    for r in results:
        for lv in r["levels"]:
            if not lv["sustained"] or not lv["calls"] + lv["answers"]:
                continue
            per_change = costs["ingest"] + costs["fanout"] * r["mirrors"]
            rest = lv["trk_core"] - r["trk_idle"] - per_change * lv["changes"] / 1e6
            rpcs.append(rest / (lv["calls"] + lv["answers"]) * 1e6)
    return rpcs


def tracker_cores(
    costs: dict[str, float], rpc_us: float, target: float, n: int, design: Design
) -> tuple[float, float]:
    """(tracker cores, of which fan-out) at ``target`` changes/s and N replicas:

    cores = idle + ingest x changes/s + fanout x changes/s x N
            + rpc x (N / send interval + N / mirror window)

    one call per replica per send interval and one answer per mirror per window:
    at the target rate every replica has changes in every interval and every
    mirror is behind at every window."""
    fan_out = costs["fanout"] * target * n / 1e6
    messages = n / design.send_s + n / design.window_s
    keys = costs["ingest"] * target / 1e6 + fan_out
    return costs["idle"] + keys + rpc_us * messages / 1e6, fan_out


def model(
    results: list[dict[str, Any]],
    target: float,
    designs: list[Design],
    costs: dict[str, float],
) -> None:
    """Prints the tracker's cores at ``target`` changes/s for N = 2..64 and each
    design (``tracker_cores``), bottom up from unit costs: ingest, the tracker's
    own work per change (``ingest_us``); idle, the tracker process's upkeep with
    no traffic (measured before each fleet's levels, median); fanout, serializing a change into one
    mirror's answer (``answer_encoding``); rpc, one call or answer whatever it
    carries, two ways: solved from the runs' sustained levels (``solve_rpc``,
    median) and an empty call alone (``message_us``). A mirror's process: its
    measured CPU per change times ``target``. The lag budget: a change waits at
    most one send interval in its replica and one window in the tracker."""
    rpcs = solve_rpc(results, costs)
    if not rpcs:
        print("\nmodel: needs a sustained level")
        return
    rpc = statistics.median(rpcs)
    mirror_us = min(
        lv["mirror_us"] for r in results for lv in r["levels"] if lv["sustained"]
    )
    print(
        f"\nmodel: tracker cores = {costs['idle']:.3f} (idle) + "
        f"{costs['ingest']:.2f} us x changes/s + "
        f"{costs['fanout']:.4f} us x changes/s x N + rpc x (N / send interval + "
        f"N / mirror window); rpc {rpc:.0f} us solved (median of {len(rpcs)} "
        f"sustained levels), {costs['message']:.0f} us an empty call alone"
    )
    print(
        f"at {target:.0f} changes/s; a mirror's process: {mirror_us:.2f} us per "
        f"change, {mirror_us * target / 1e6:.2f} core (its lowest over sustained "
        f"levels, where fixed costs weigh least)"
    )
    print(
        f"{'design':>10} {'send ms':>7} {'window ms':>9} {'lag bound ms':>12} "
        f"{'N':>3} {'msgs/s':>7} {'cores (solved rpc)':>18} "
        f"{'cores (empty call)':>18} {'fan-out':>7}"
    )
    for design in designs:
        for n in (2, 8, 16, 32, 64):
            cores, out = tracker_cores(costs, rpc, target, n, design)
            alone, _ = tracker_cores(costs, costs["message"], target, n, design)
            messages = n / design.send_s + n / design.window_s
            print(
                f"{design.name:>10} {design.send_s * 1e3:>7.0f} "
                f"{design.window_s * 1e3:>9.0f} "
                f"{(design.send_s + design.window_s) * 1e3:>12.0f} {n:>3} "
                f"{messages:>7.0f} {cores:>18.2f} {alone:>18.2f} {out:>7.2f}"
            )


def answer_encoding(keys: int = 2560, batch: int = 32) -> float:
    """What one answer to one mirror costs xoscar's serializer, per key, as
    ``IndexChange`` objects (main's feed) and as packed records, in this run: 2,560
    keys is a 20 ms window of 128,000 changes/s, in 32-key updates."""
    from xoscar.serialization import deserialize, serialize

    from xinference.model.llm.vllm.xavier.wire import IndexChange, TrackerChanges

    try:
        from xinference.model.llm.vllm.xavier.change_log import encode, pack_keys
    except ImportError:  # main's tree, before the packed feed
        encode = None

    updates = [chain(b"enc-%d" % i, batch) for i in range(keys // batch)]
    addresses = tuple((r, f"nixl://10.0.0.{r}:41000") for r in range(64))
    answers = {
        "objects": TrackerChanges(
            1,
            False,
            tuple(
                IndexChange(IndexChange.ADD, i % 64, tuple(u))
                for i, u in enumerate(updates)
            ),
            addresses,
        )
    }
    if encode is not None:
        records = [
            encode(IndexChange.ADD, i % 64, pack_keys(u)) for i, u in enumerate(updates)
        ]
        answers["packed"] = TrackerChanges(1, False, (), addresses, b"".join(records))

    def per_key_us(call: Any) -> float:
        times = []
        for _ in range(30):
            started = time.process_time()
            call()
            times.append(time.process_time() - started)
        return statistics.median(times) / keys * 1e6

    print(
        f"\none answer of {keys} keys in {len(updates)} changes, xoscar's serializer:"
    )
    costs = {}
    for name, answer in answers.items():
        headers, buffers = serialize(answer)
        costs[name] = (
            per_key_us(lambda a=answer: serialize(a)),
            per_key_us(lambda h=headers, b=buffers: deserialize(h, b)),
        )
        print(
            f"  {name:>8}: serialize {costs[name][0]:.4f} us/key (tracker, per "
            f"mirror), deserialize {costs[name][1]:.4f} us/key (mirror)"
        )
    if "packed" in costs:
        print(
            f"  packed/objects: serialize "
            f"x{costs['packed'][0] / costs['objects'][0]:.3f}, deserialize "
            f"x{costs['packed'][1] / costs['objects'][1]:.3f}"
        )
    # what this tree's tracker sends
    return costs["packed" if "packed" in costs else "objects"][0]


def memory_per_block(ranks: int = 64, per_rank: int = 2000) -> tuple[float, float]:
    """Bytes per indexed block (tracemalloc, in this process): a tracker holding
    ``ranks`` x ``per_rank`` blocks (shared heads plus tails of their own,
    registered 32 at a time, change log included), and a mirror of it."""
    import tracemalloc

    def fetch(since: int, wait_s: float) -> Any:
        raise AssertionError("not polled")

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tracker = BlockTrackerActor()
    blocks = 0
    for rank in range(ranks):
        tracker.register_replica(rank, f"sim://{rank}")
        keys = [k for head in HEAD_CHAINS for k in head]
        keys += chain(b"mem-%d" % rank, per_rank - len(keys))
        for i in range(0, len(keys), 32):
            tracker.register_blocks(rank, keys[i : i + 32])
        blocks += len(keys)
    in_tracker = tracemalloc.get_traced_memory()[0] - before
    snapshot = asyncio.run(tracker.mirror_changes(0, -1, 0.0))
    before = tracemalloc.get_traced_memory()[0]
    mirror = TrackerMirror(fetch, rpc_timeout_s=1)
    mirror.apply(snapshot)
    in_mirror = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return in_tracker / blocks, in_mirror / blocks
