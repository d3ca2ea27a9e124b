"""Scatter benchmark: writing a chunk of loaded snapshots into the engine's blocks.

The last step of a load through the receive slab is ``BlockMajorCache.scatter_rows``:
rows ``(keys * L, R)`` go to blocks ``ids`` of every layer. How many copies that
takes depends on how the engine allocated its layers:

  one allocation     equally spaced views of one storage (vLLM on CPU): one
                     ``index_copy_`` through the stacked view;
  per layer, span    one allocation per layer (vLLM on a GPU), addresses on whole
                     pieces: one ``index_copy_`` over the piece span, after one
                     broadcast addition for the row indices;
  per layer, loop    the same allocations with the span switched off: one
                     ``index_copy_`` per layer, the path before the span (baseline);
  span, staged       the span with the ids checked once per load and staged
                     through a pinned buffer (``BlockMajorCache.destinations``), as
                     the load runner scatters, CUDA graphs off;
  span, graph        the same with graphs on: from the second chunk of a shape, the
                     ids copy, the arithmetic and the copy are one CUDA graph replay.

Qwen2.5-0.5B's geometry (24 layers, K/V-first blocks of 16 tokens x 2 heads x 64
dims in bfloat16: 8 KiB per layer and block) at 1, 16 and 64 blocks. Each timing
includes the ids' host-to-device copy (the staged cases: checking the ids too), the
scatter and a device synchronisation. The source rows stay in one buffer, as a
load's chunks do in the receive slab.
Cases alternate within every round; the table gives the median and p95 over
rounds, and the ratio of each case's median to the loop's. Every case's result is
checked against the loop's.

Run from the repository root:

  python benchmark/scatter_benchmark.py --device cuda [--rounds 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.layout import (
    KV_FIRST_LAYOUT,
    detect_layout,
)

NUM_LAYERS = 24
NUM_BLOCKS = 2048
BLOCK_SHAPE = (16, 2, 64)  # tokens, kv heads, head size
BLOCK_COUNTS = (1, 16, 64)
CASES = (
    "per layer, loop",
    "per layer, span",
    "span, staged",
    "span, graph",
    "one allocation",
)
# cases that stage their destinations once per scatter, as a load does
STAGED = ("span, staged", "span, graph")


def engine_layers(device: str, one_allocation: bool) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS) + BLOCK_SHAPE
    if not one_allocation:
        return [
            torch.zeros(shape, dtype=torch.bfloat16, device=device)
            for _ in range(NUM_LAYERS)
        ]
    flat = torch.zeros((NUM_LAYERS,) + shape, dtype=torch.bfloat16, device=device)
    return list(flat.unbind(0))


def make_caches(device: str) -> dict[str, BlockMajorCache]:
    caches = {}
    for case in CASES:
        layers = engine_layers(device, one_allocation=case == "one allocation")
        cache = BlockMajorCache(
            layers,
            detect_layout(layers, NUM_BLOCKS, KV_FIRST_LAYOUT),
            scatter_graphs=case == "span, graph",
        )
        if case == "per layer, loop":
            cache._span = None  # the baseline: the path the span replaced
        elif case != "one allocation" and cache.scatter_path != "span":
            raise SystemExit("the allocator's addresses do not allow a piece span here")
        caches[case] = cache
    return caches


def timed_scatter(
    cache: BlockMajorCache,
    rows: torch.Tensor,
    ids: torch.Tensor,
    sync: Callable[[], None],
    staged: bool,
) -> float:
    """Microseconds for one ``scatter_rows`` of whole snapshots, synchronised."""
    start = time.perf_counter()
    cache.scatter_rows(0, rows, cache.destinations(ids.tolist()) if staged else ids)
    sync()
    return (time.perf_counter() - start) * 1e6


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(
    args: argparse.Namespace, caches: dict[str, BlockMajorCache]
) -> list[dict[str, Any]]:
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    row_bytes = caches[CASES[0]].layout.layer_block_nbytes
    generator = torch.Generator().manual_seed(0)
    results = []
    for blocks in BLOCK_COUNTS:
        rows = torch.randint(
            0,
            256,
            (blocks * NUM_LAYERS, row_bytes),
            dtype=torch.uint8,
            generator=generator,
        ).to(device)
        ids = torch.randperm(NUM_BLOCKS, generator=generator)[:blocks]
        times: dict[str, list[float]] = {case: [] for case in CASES}
        for round_ in range(args.warmup + args.rounds):
            order = CASES if round_ % 2 == 0 else CASES[::-1]
            for case in order:
                took = timed_scatter(caches[case], rows, ids, sync, case in STAGED)
                if round_ >= args.warmup:
                    times[case].append(took)
        reference = caches["per layer, loop"]
        for case in CASES:
            for layer in range(NUM_LAYERS):
                got = caches[case].gather(layer, ids.to(device))
                if not torch.equal(got, reference.gather(layer, ids.to(device))):
                    raise SystemExit(f"{case}: layer {layer} differs from the loop's")
        base = statistics.median(times["per layer, loop"])
        for case in CASES:
            p50 = statistics.median(times[case])
            results.append(
                {
                    "case": case,
                    "blocks": blocks,
                    "payload_bytes": blocks * NUM_LAYERS * row_bytes,
                    "p50_us": p50,
                    "p95_us": percentile(times[case], 0.95),
                    "ratio_to_loop": p50 / base,
                }
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    torch.set_num_threads(1)
    caches = make_caches(args.device)
    results = run(args, caches)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"device {args.device} ({name}), torch {torch.__version__}, {NUM_LAYERS} layers, "
        f"K/V-first bf16, {args.rounds} rounds after {args.warmup} warm-up"
    )
    print("| case | blocks | payload | p50 us | p95 us | p50 / loop's |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['case']} | {r['blocks']} | {r['payload_bytes'] // 1024} KiB | "
            f"{r['p50_us']:.0f} | {r['p95_us']:.0f} | {r['ratio_to_loop']:.2f} |"
        )
    graphs = caches["span, graph"].scatter_graphs
    if graphs is not None:
        print(f"\nspan, graph: {graphs.summary()}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
