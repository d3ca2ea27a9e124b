"""What vLLM's scheduler thread waits for when Xavier looks up a new request.

The scheduler half (``SchedulerSide.num_new_matched_tokens``) runs on vLLM's
scheduler thread. Before the tracker mirror it asked the block tracker actor for
every new request (one round trip, hit or miss) and then reserved on the holder
(a second round trip on a hit). With the mirror, a miss asks nobody and a hit
makes one round trip, the reservation.

Here the tracker and a holder run in a sub-pool (another process, as in serving:
the tracker lives in the supervisor's pool, the holder in a replica's); this
process plays the engine: a ``BackgroundLoop`` thread for the actor calls and the
calling thread as vLLM's scheduler thread. The tracker indexes ``--indexed`` keys of
one other replica. Each lookup is a fresh 1,600-token prompt (100 blocks of 16
tokens; the hashing is timed too, in both modes): misses share nothing with the
index, hits share their first 64 blocks with it. The holder grants what it is
asked for, pinning nothing (what it costs is the round trip, not a store).

  rpc     the tracker asked on every lookup (the mirror is left out)
  mirror  the mirror, synced before timing starts

A holder slower than the scheduler's ``reply_wait_s`` (5 ms) gets a "ask again"
answer, as vLLM would: the benchmark asks again until it has the hit, and a lookup's
time is the sum of its calls (the scheduler thread's share, without the waits
between passes); ``deferred`` counts the lookups that needed more than one call.

Usage: python benchmark/lookup_cost.py [--lookups N] [--indexed N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import xoscar as xo

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector.scheduler import (
    SchedulerSettings,
    SchedulerSide,
)
from xinference.model.llm.vllm.xavier.hashing import BlockHash, hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror
from xinference.model.llm.vllm.xavier.wire import (
    CPU_TIER,
    KVGeometry,
    LeaseGrant,
    PrefixHit,
    ReplicaIdentity,
)

BLOCK, NS, PROMPT_TOKENS, SHARED_BLOCKS = 16, "lookup-bench|bfloat16|16", 1600, 64
HOLDER, ENGINE = 1, 0
IDENTITY = ReplicaIdentity(
    model="lookup-bench",
    geometry=KVGeometry(num_layers=24, layer_block_nbytes=8192, logical_dtype="bf16"),
    layout="block_first",
)


class GrantingHolder(xo.StatelessActor):
    """Answers reservations with everything asked for (nothing is loaded here)."""

    def reserve(self, keys: list[BlockHash], lease_id: str, requester: Any) -> Any:
        n = len(keys)
        return LeaseGrant(lease_id, HOLDER, tuple(keys), (CPU_TIER,) * n, ("bf16",) * n)

    def release(self, lease_id: str) -> None:
        pass


def prompt(rng: random.Random, shared: list[int] | None) -> list[int]:
    head = shared if shared is not None else []
    return head + [rng.randrange(1, 50_000) for _ in range(PROMPT_TOKENS - len(head))]


async def setup(indexed: int) -> tuple[Any, Any, Any, list[int]]:
    pool = await xo.create_actor_pool("127.0.0.1", n_process=1)
    (sub,) = list(pool.sub_processes)
    tracker = await xo.create_actor(BlockTrackerActor, address=sub, uid="tracker")
    holder = await xo.create_actor(GrantingHolder, address=sub, uid="holder")
    await tracker.register_replica(HOLDER, sub)
    await tracker.register_replica(ENGINE, pool.external_address)
    rng = random.Random(1)
    shared = [rng.randrange(1, 50_000) for _ in range(SHARED_BLOCKS * BLOCK)]
    keys = hash_full_blocks(shared, BLOCK, NS)
    while len(keys) < indexed:  # other prompts' blocks fill the index
        keys += hash_full_blocks(prompt(rng, None), BLOCK, NS)
    for start in range(0, len(keys), 2000):
        await tracker.register_blocks(HOLDER, keys[start : start + 2000])
    return pool, tracker, holder, shared


def measure(
    loop: BackgroundLoop,
    tracker: Any,
    holder: Any,
    shared: list[int],
    use_mirror: bool,
    lookups: int,
) -> dict[str, list[float]]:
    trips = {"queries": 0, "reservations": 0}

    async def query(rank: int, keys: list[BlockHash]) -> PrefixHit | None:
        trips["queries"] += 1
        return await tracker.query_prefix(rank, keys)

    async def reserve(hit: PrefixHit, keys: list[BlockHash], lease: str, who: Any):
        trips["reservations"] += 1
        return await holder.reserve(keys, lease, who)

    async def release(hit: PrefixHit, lease: str) -> None:
        await holder.release(lease)

    mirror = following = None
    if use_mirror:
        mirror = TrackerMirror(
            lambda since, wait: tracker.mirror_changes(ENGINE, since, wait),
            rpc_timeout_s=5,
        )
        following = loop.submit(mirror.run())
        deadline = time.monotonic() + 30
        while not mirror.ready:
            assert time.monotonic() < deadline, "the mirror never synced"
            time.sleep(0.01)
    settings = SchedulerSettings(ENGINE, NS, BLOCK, True, rpc_timeout_s=5)
    side = SchedulerSide(settings, loop, query, reserve, release, mirror)
    side.set_identity(IDENTITY)
    rng = random.Random(7)
    out: dict[str, list[float]] = {"miss": [], "hit": []}
    deferred = 0
    for n in range(lookups + 50):
        kind = "hit" if n % 2 else "miss"
        tokens = prompt(rng, shared if kind == "hit" else None)
        elapsed, calls = 0.0, 0
        answer: tuple[int | None, bool] = (None, False)
        while answer[0] is None:
            if calls:
                time.sleep(0.0005)  # vLLM's next scheduling pass
            started = time.perf_counter()
            answer = side.num_new_matched_tokens(f"r{n}", tokens, 0)
            elapsed += time.perf_counter() - started
            calls += 1
        side.request_finished(f"r{n}")
        expected = SHARED_BLOCKS * BLOCK if kind == "hit" else 0
        assert answer[0] == expected, (kind, answer)
        if n >= 50:  # the first ones warm connections and caches
            out[kind].append(elapsed * 1e6)
            deferred += calls > 1
    side.flush(5)
    if mirror is not None and following is not None:
        mirror.stop()  # as the connector does at shutdown: no poll left in flight
        loop.run(tracker.wake_mirrors(), 5)
        following.result(5)
    out["trips"] = [trips["queries"] / (lookups + 50), trips["reservations"]]
    out["deferred"] = [deferred]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--indexed", type=int, default=20_000)
    args = parser.parse_args()
    loop = BackgroundLoop("lookup-bench")
    pool, tracker, holder, shared = loop.run(setup(args.indexed), 120)
    rows = {}
    try:
        for mode in ("rpc", "mirror", "rpc", "mirror"):  # interleaved against drift
            got = measure(loop, tracker, holder, shared, mode == "mirror", args.lookups)
            row = rows.setdefault(
                mode, {"miss": [], "hit": [], "queries": 0.0, "deferred": 0}
            )
            row["miss"] += got["miss"]
            row["hit"] += got["hit"]
            row["queries"] = got["trips"][0]
            row["deferred"] += int(got["deferred"][0])
    finally:
        loop.run(pool.stop(), 30)
        loop.close()

    def pct(values: list[float], q: float) -> float:
        return sorted(values)[int(q * (len(values) - 1))]

    print(
        f"lookup on the scheduler thread, us ({args.indexed} keys indexed, "
        f"{2 * args.lookups} lookups per mode, half hits of {SHARED_BLOCKS} blocks)"
    )
    print(
        "| mode | miss p50 | miss p95 | hit p50 | hit p95 | tracker queries/lookup "
        "| deferred |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, row in rows.items():
        print(
            f"| {mode} | {statistics.median(row['miss']):.0f} | "
            f"{pct(row['miss'], 0.95):.0f} | {statistics.median(row['hit']):.0f} | "
            f"{pct(row['hit'], 0.95):.0f} | {row['queries']:.2f} | "
            f"{row['deferred']} |"
        )
    ratios = {
        kind: statistics.median(rows["mirror"][kind])
        / statistics.median(rows["rpc"][kind])
        for kind in ("miss", "hit")
    }
    print(f"mirror / rpc, p50: miss x{ratios['miss']:.2f}, hit x{ratios['hit']:.2f}")


if __name__ == "__main__":
    main()
