"""What device-tier locations cost the block index: memory per block and the
tracker's and a mirror's work per change, with every key located (a GPU-first
fleet whose holders serve generation words) and with none.

``index_costs.memory_per_block`` and ``ingest_us`` measure keys without locations;
here every registration of 32 keys comes with its ``LOCATE`` record, as a
transfer actor sends them (``update_blocks(rank, dropped, added, located)``), and
the index's memory is measured once every key is located. Runs against any tree
whose tracker takes ``located`` (before and after the tracker kept locations), so
the two can be compared in one table.

Usage: python benchmark/location_costs.py [--ranks 64] [--per-rank 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from index_costs import HEAD_CHAINS, chain  # noqa: E402

from xinference.model.llm.vllm.xavier.change_log import (  # noqa: E402
    encode,
    pack_keys,
    pack_locations,
)
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor  # noqa: E402
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror  # noqa: E402
from xinference.model.llm.vllm.xavier.wire import (  # noqa: E402
    IndexChange,
    TrackerChanges,
)

BATCH = 32
ANSWER_UPDATES = 80  # updates per mirror answer: a 40 ms window at 64 replicas
GENERATION0 = time.time_ns() // 2 * 2  # what a store's clock-based words look like


def fleet_updates(
    ranks: int, per_rank: int, located: bool
) -> list[tuple[int, bytes, bytes]]:
    """(rank, packed keys, packed locations) per 32-key registration: shared
    heads and tails of each rank's own, as ``index_costs.memory_per_block``."""
    updates = []
    for rank in range(ranks):
        keys = [k for head in HEAD_CHAINS for k in head]
        keys += chain(b"mem-%d" % rank, per_rank - len(keys))
        for i in range(0, len(keys), BATCH):
            batch = keys[i : i + BATCH]
            where = [
                (k, (i + j) * 4, GENERATION0 + 2 * (i + j)) for j, k in enumerate(batch)
            ]
            updates.append(
                (rank, pack_keys(batch), pack_locations(where) if located else b"")
            )
    return updates


def new_tracker(ranks: int) -> BlockTrackerActor:
    tracker = BlockTrackerActor()
    for rank in range(ranks):
        tracker.register_replica(rank, f"sim://{rank}")
    return tracker


def not_polled(since: int, wait_s: float) -> Any:
    raise AssertionError("not polled")


def feed(updates: list[tuple[int, bytes, bytes]], ranks: int) -> list[TrackerChanges]:
    """The updates as a following mirror gets them: answers of
    ``ANSWER_UPDATES`` updates each, an ADD record then a LOCATE record per
    update, as the tracker logs them."""
    addresses = tuple((rank, f"sim://{rank}") for rank in range(ranks))
    answers = []
    for first in range(0, len(updates), ANSWER_UPDATES):
        records = []
        for rank, keys, where in updates[first : first + ANSWER_UPDATES]:
            records.append(encode(IndexChange.ADD, rank, keys))
            if where:
                records.append(encode(IndexChange.LOCATE, rank, where))
        answers.append(
            TrackerChanges(first + 1, False, (), addresses, b"".join(records))
        )
    return answers


def grown_by(build: Any) -> tuple[Any, int]:
    """What ``build()`` returns, and the bytes tracemalloc saw it keep."""
    before = tracemalloc.get_traced_memory()[0]
    made = build()
    return made, tracemalloc.get_traced_memory()[0] - before


def memory(ranks: int, per_rank: int, located: bool) -> tuple[float, float, float]:
    """Bytes per indexed block: the tracker (change log included), a mirror
    that followed every change, and a mirror started from the tracker's
    snapshot afterwards."""
    updates = fleet_updates(ranks, per_rank, located)
    answers = feed(updates, ranks)

    def tracker_of_the_fleet() -> BlockTrackerActor:
        tracker = new_tracker(ranks)
        for rank, keys, where in updates:
            tracker.update_blocks(rank, b"", keys, where)
        return tracker

    def mirror_of(answers: list[TrackerChanges]) -> TrackerMirror:
        mirror = TrackerMirror(not_polled, rpc_timeout_s=1)
        for answer in answers:
            mirror.apply(answer)
        return mirror

    tracemalloc.start()
    tracker, in_tracker = grown_by(tracker_of_the_fleet)
    _, in_follower = grown_by(lambda: mirror_of(answers))
    snapshot = asyncio.run(tracker.mirror_changes(0, -1, 0.0))
    _, in_fresh = grown_by(lambda: mirror_of([snapshot]))
    tracemalloc.stop()
    blocks = ranks * per_rank
    return in_tracker / blocks, in_follower / blocks, in_fresh / blocks


def per_change_us(ranks: int, per_rank: int, located: bool) -> tuple[float, float]:
    """(tracker, mirror) CPU time per registered key, median of 5 rounds: the
    tracker's ``update_blocks`` of the fleet's registrations (with their
    locations), and a following mirror's apply of the answers they made."""
    updates = fleet_updates(ranks, per_rank, located)
    answers = feed(updates, ranks)
    keys = ranks * per_rank
    tracker_us, mirror_us = [], []
    for _ in range(5):
        tracker = new_tracker(ranks)
        started = time.process_time()
        for rank, added, where in updates:
            tracker.update_blocks(rank, b"", added, where)
        tracker_us.append((time.process_time() - started) / keys * 1e6)
        mirror = TrackerMirror(not_polled, rpc_timeout_s=1)
        started = time.process_time()
        for answer in answers:
            mirror.apply(answer)
        mirror_us.append((time.process_time() - started) / keys * 1e6)
    return statistics.median(tracker_us), statistics.median(mirror_us)


def fresh_locates(located: bool) -> str:
    """Whether a mirror started from a snapshot locates a located key."""
    if not located:
        return "-"
    rank, keys, where = fleet_updates(1, 64, True)[0]
    tracker = new_tracker(1)
    tracker.update_blocks(rank, b"", keys, where)
    mirror = TrackerMirror(not_polled, rpc_timeout_s=1)
    mirror.apply(asyncio.run(tracker.mirror_changes(0, -1, 0.0)))
    return "yes" if mirror.locate(rank, [keys[:16]]) is not None else "no"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--per-rank", type=int, default=2000)
    opts = parser.parse_args()
    print(
        f"location_costs: {opts.ranks} ranks x {opts.per_rank} blocks, "
        f"{BATCH}-key registrations"
    )
    print(
        "bytes per indexed block (tracemalloc); CPU us per registered key "
        "(median of 5); the fresh mirror started from a snapshot"
    )
    print(
        f"{'keys':>11} {'tracker B':>9} {'follower B':>10} {'fresh B':>7} "
        f"{'fresh locates':>13} {'tracker us':>10} {'mirror us':>9}"
    )
    for located in (False, True):
        tracker_b, follower_b, fresh_b = memory(opts.ranks, opts.per_rank, located)
        tracker_us, mirror_us = per_change_us(opts.ranks, opts.per_rank, located)
        print(
            f"{'located' if located else 'no location':>11} {tracker_b:>9.0f} "
            f"{follower_b:>10.0f} {fresh_b:>7.0f} {fresh_locates(located):>13} "
            f"{tracker_us:>10.3f} {mirror_us:>9.3f}"
        )


if __name__ == "__main__":
    main()
