"""Where a lease-free load READ by the engine process spends its time.

The fast path's load (``DirectReads.load_now``, called from ``start_load_kv`` on
the engine thread) READs a holder's rows into the engine agent's receive slab,
scatters them into engine blocks and READs the slots' generation words back.
Served, its time is far above its bytes' (on CPU 1.7-2.6 ms for 0.4-1.5 MiB; on
an H100 2.1-3.2 ms for an 8B model's 62-254 MiB), and this says where it goes: a
real holder (a snapshot store in another process, served by the NIXL transport,
as ``tests/.../direct_holder.py`` has it), the engine's blocks in this process,
``load_now`` timed as a whole and, by wrapping them, the calls it makes:

- ``hand-over``: from ``load_now``'s call to the loop starting the load, and from
  the load's end to ``load_now``'s return (the engine thread waits meanwhile);
- ``READ rows``: preparing, posting and polling the rows' READ (``_read``);
- ``scatter``: the rows from the slab into engine blocks (``scatter_rows``);
- ``READ words``: the generation words' READ and check (``read_words``).

The wrappers add a few microseconds a call. Usage:

    python benchmark/direct_load_phases.py [--device cuda] [--layers 32] \
        [--layer-block-kib 64] [--blocks 31 127] [--loads 40]

(the defaults are an 8B model's shape: 32 layers, 8 KV heads of 128, blocks of
16 tokens: 64 KiB a layer's block; 31 / 127 blocks are a 512 / 2,048-token hit).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xoscar as xo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.model.llm.vllm.xavier.connector.direct_holder import (  # noqa: E402
    HOLDER_UID,
    StoreHolder,
    lease_free_load,
    reader,
)
from xinference.model.llm.vllm.xavier.connector import direct_reads  # noqa: E402
from xinference.model.llm.vllm.xavier.engine import blocks  # noqa: E402
from xinference.model.llm.vllm.xavier.engine.layout import detect_layout  # noqa: E402
from xinference.model.llm.vllm.xavier.transports.nixl.transport import (  # noqa: E402
    NixlDirectTransport,
)
from xinference.model.llm.vllm.xavier.wire import (  # noqa: E402
    KVGeometry,
)

TOKENS_PER_BLOCK = 16
KV_HEADS = 8

# phase -> seconds of each call, for the loads being timed
calls: dict[str, list[float]] = defaultdict(list)
marks: dict[str, float] = {}


def timing(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    if asyncio.iscoroutinefunction(function):

        @functools.wraps(function)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await function(*args, **kwargs)
            finally:
                calls[name].append(time.perf_counter() - started)

        return timed_async

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            calls[name].append(time.perf_counter() - started)

    return timed


def instrument() -> None:
    reads = direct_reads.DirectReads
    load_all = reads._load_all

    async def marked_load_all(self: Any, *args: Any, **kwargs: Any) -> Any:
        marks["loop started"] = time.perf_counter()
        try:
            return await load_all(self, *args, **kwargs)
        finally:
            marks["loop ended"] = time.perf_counter()

    reads._load_all = marked_load_all  # type: ignore[method-assign]
    transport = NixlDirectTransport
    transport._read = timing("READ rows", transport._read)  # type: ignore[method-assign]
    cache = blocks.BlockMajorCache
    cache.scatter_rows = timing("scatter", cache.scatter_rows)  # type: ignore[method-assign]
    direct_reads.read_words = timing("READ words", direct_reads.read_words)


def engine_cache(
    num_blocks: int, layers: int, layer_block_bytes: int, device: str
) -> blocks.BlockMajorCache:
    head_dim = layer_block_bytes // (2 * TOKENS_PER_BLOCK * KV_HEADS * 2)
    tensors = [
        torch.zeros(
            (num_blocks, 2, TOKENS_PER_BLOCK, KV_HEADS, head_dim),
            dtype=torch.bfloat16,
            device=device,
        )
        for _ in range(layers)
    ]
    return blocks.BlockMajorCache(
        tensors, detect_layout(tensors, num_blocks, "block_first")
    )


def timed_loads(
    reads: direct_reads.DirectReads,
    locations: list[tuple[int, int]],
    loads: int,
    label: str,
) -> tuple[dict[str, float], int]:
    """p50 ms over ``loads`` loads (after as many warm-ups) of the whole and of
    each phase, a phase's calls within one load summed (a load larger than the
    receive slab READs and scatters a chunk at a time), and the chunks a load
    took."""
    per_load: dict[str, list[float]] = defaultdict(list)
    chunks: list[int] = []  # the rows' READs per load
    for index in range(2 * loads):
        every = list(range(len(locations)))
        request = lease_free_load(f"{label}-{index}", every, locations, every)
        calls.clear()
        started = time.perf_counter()
        outcome = reads.load_now([request], 1.0)
        ended = time.perf_counter()
        if outcome != {request.load_id: None}:
            raise RuntimeError(f"load {index} failed: {outcome}")
        if index >= loads:
            per_load["load_now"].append(ended - started)
            per_load["hand-over"].append(
                marks["loop started"] - started + ended - marks["loop ended"]
            )
            for name, seconds in calls.items():
                per_load[name].append(sum(seconds))
            chunks.append(len(calls["READ rows"]))
        time.sleep(0.01)  # an engine step apart
    p50 = {name: statistics.median(v) * 1e3 for name, v in per_load.items()}
    return p50, int(statistics.median(chunks))


Row = tuple[int, dict[str, float], int]  # blocks, p50 ms per phase, chunks


async def measure(args: argparse.Namespace) -> list[Row]:
    geometry = KVGeometry(
        num_layers=args.layers,
        layer_block_nbytes=args.layer_block_kib * 1024,
        logical_dtype="bfloat16",
    )
    most = max(args.blocks)
    pool = await xo.create_actor_pool(
        "127.0.0.1",
        n_process=1,
        external_address_schemes=["nixl"] * 2,
        auto_recover=False,
    )
    rows: list[Row] = []
    async with pool:
        (address,) = list(pool.sub_processes)
        holder = await xo.create_actor(
            StoreHolder,
            geometry,
            most + 2,
            args.device,
            address=address,
            uid=HOLDER_UID,
        )
        locations = [await holder.put(i) for i in range(most)]
        cache = engine_cache(
            most, args.layers, geometry.layer_block_nbytes, args.device
        )
        loop, reads = await asyncio.to_thread(reader, address, cache, "bench", 120.0)
        try:
            for count in args.blocks:
                p50, chunks = await asyncio.to_thread(
                    timed_loads, reads, locations[:count], args.loads, str(count)
                )
                rows.append((count, p50, chunks))
        finally:
            await asyncio.to_thread(loop.run, reads.close(), 10.0)
            loop.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--layer-block-kib", type=int, default=64)
    parser.add_argument("--blocks", type=int, nargs="+", default=[31, 127])
    parser.add_argument("--loads", type=int, default=40)
    args = parser.parse_args()
    instrument()
    rows = asyncio.run(measure(args))
    phases = ("hand-over", "READ rows", "scatter", "READ words")
    print(
        f"\n{args.device}: {args.layers} layers, {args.layer_block_kib} KiB a "
        f"layer's block; p50 of {args.loads} loads, ms\n"
    )
    print(
        "| blocks | MiB | READs | load_now | "
        + " | ".join(phases)
        + " | rest | READ rows / load_now |"
    )
    print("| ---: | ---: | ---: | ---: | " + "---: | " * len(phases) + "---: | ---: |")
    for count, p50, chunks in rows:
        mib = count * args.layers * args.layer_block_kib / 1024
        named = sum(p50.get(name, 0.0) for name in phases)
        cells = " | ".join(f"{p50.get(name, 0.0):.3f}" for name in phases)
        print(
            f"| {count} | {mib:.1f} | {chunks} | {p50['load_now']:.3f} | {cells} | "
            f"{p50['load_now'] - named:.3f} | "
            f"x{p50.get('READ rows', 0.0) / p50['load_now']:.2f} |"
        )


if __name__ == "__main__":
    main()
