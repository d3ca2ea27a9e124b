"""The Python around one NIXL load, measured where it is steady: one process, DRAM.

Why this exists: on the lent H200 hosts a load into cross-layer engine blocks is a
READ of about 25 us plus Python (plan, checks, posting, polling) that those hosts run
3-4 times slower than the CPU machine, and their timings move by up to 2x between
calls. A change of a microsecond or two cannot be seen there. Here both transports
live in one process, with no xoscar hop, and the loader READs from the holder's
registered memory in host memory; with ``--row-bytes 64`` the copy itself is a few
hundred bytes, so what is timed is the load's own cost. Both placements are timed:

  engine   a READ straight into a cross-layer engine cache (what serving picks with
           ``--xavier-cross-layer-blocks``), one descriptor per run of keys;
  slab     a READ into the receive slab, then the load runner's scatter into a
           per-layer engine cache (what per-layer caches take).

Each case runs ``--warmup`` loads, then ``--loads`` timed ones around
``NixlDirectTransport.load`` (and, for the slab, the scatter it calls); contents are
checked after each case. The ratio column is each case's median over the first
row's (the one-block engine load, unless ``--cases`` leaves it out), measured in the
same run. ``--profile`` prints the functions that took the most time over all timed
loads.

Run from the repository root (not in CI; needs nixl):

  python benchmark/load_overhead.py [--row-bytes 64] [--loads 2000] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xinference.model.llm.vllm.xavier.actor.loads import row_scatter  # noqa: E402
from xinference.model.llm.vllm.xavier.engine.blocks import (  # noqa: E402
    BlockMajorCache,
)
from xinference.model.llm.vllm.xavier.engine.device import DeviceWorkMark  # noqa: E402
from xinference.model.llm.vllm.xavier.engine.layout import detect_layout  # noqa: E402
from xinference.model.llm.vllm.xavier.transports.nixl.endpoint import (  # noqa: E402
    NixlAgentEndpoint,
)
from xinference.model.llm.vllm.xavier.transports.nixl.placement import (  # noqa: E402
    PLACEMENT_ENGINE,
    PLACEMENT_SLAB,
)
from xinference.model.llm.vllm.xavier.transports.nixl.transport import (  # noqa: E402
    NixlDirectTransport,
)

LAYERS = 24
HOLDER_SLOTS = 96
ENGINE_BLOCKS = 128
SIZES = (1, 16, 64)


def engine_cache(row_bytes: int, cross_layer: bool) -> BlockMajorCache:
    """An engine cache in the ``block_first`` layout, K and V of one token and one
    head per block (bf16, ``row_bytes / 4`` per head): per-layer views of one
    block-major allocation (a block of every layer contiguous, as vLLM's cross-layer
    cache), or one allocation per layer."""
    block = (2, 1, 1, row_bytes // 4)
    if cross_layer:
        flat = torch.zeros((ENGINE_BLOCKS, LAYERS, *block), dtype=torch.bfloat16)
        layers = [flat[:, i] for i in range(LAYERS)]
    else:
        layers = [
            torch.zeros((ENGINE_BLOCKS, *block), dtype=torch.bfloat16)
            for _ in range(LAYERS)
        ]
    return BlockMajorCache(layers, detect_layout(layers, ENGINE_BLOCKS, "block_first"))


class Bench:
    """A holder transport over host-memory store rows, and a loader transport with
    its own engine cache, in one process."""

    def __init__(self, row_bytes: int) -> None:
        self.caches = {
            "engine": engine_cache(row_bytes, cross_layer=True),
            "slab": engine_cache(row_bytes, cross_layer=False),
        }
        self.geometry = self.caches["engine"].geometry
        gen = torch.Generator().manual_seed(5)
        self.rows = torch.randint(
            0, 256, (HOLDER_SLOTS * LAYERS, row_bytes), dtype=torch.uint8, generator=gen
        )
        self.transports: dict[str, NixlDirectTransport] = {}

    async def start(self) -> None:
        geometry, row_bytes = self.geometry, self.geometry.layer_block_nbytes
        slab_bytes = 64 * LAYERS * row_bytes
        holder_endpoint = await NixlAgentEndpoint.create(
            "overhead-holder",
            row_bytes=row_bytes,
            store_rows=self.rows,
            slab_bytes=slab_bytes,
        )
        self.holder = NixlDirectTransport(
            holder_endpoint,
            geometry,
            rpc_timeout_s=30.0,
            placement=PLACEMENT_SLAB,
            locate_rows=lambda lease, keys: [_slot(k) * LAYERS for k in keys],
        )
        for case, placement in (("engine", PLACEMENT_ENGINE), ("slab", PLACEMENT_SLAB)):
            cache = self.caches[case]
            endpoint = await NixlAgentEndpoint.create(
                f"overhead-{case}",
                row_bytes=row_bytes,
                store_rows=torch.zeros((LAYERS, row_bytes), dtype=torch.uint8),
                slab_bytes=slab_bytes,
                engine_layers=cache.row_layers,
                engine_block_axis=cache.layout.block_axis,
            )
            self.transports[case] = NixlDirectTransport(
                endpoint, geometry, rpc_timeout_s=30.0, placement=placement
            )

    async def close(self) -> None:
        for transport in (*self.transports.values(), self.holder):
            await transport.close()

    async def loads(self, case: str, n: int, count: int) -> list[float]:
        """``count`` loads of holder slots ``0 .. n-1`` into engine blocks ``0 ..
        n-1`` (consecutive on both sides: one run); seconds per load."""
        transport, cache = self.transports[case], self.caches[case]
        ops = self.holder.holder_ops()

        async def holder_call(op: str, *args: Any) -> Any:
            return await ops[op](*args)

        keys = [s.to_bytes(16, "big") for s in range(n)]
        blocks = list(range(n))
        hint = self.holder.hint([s * LAYERS for s in range(n)])
        times = []
        for _ in range(count):
            start = time.perf_counter()
            written = DeviceWorkMark(cache.device)
            scatter = row_scatter(cache, blocks, written, complete_each_chunk=False)
            await transport.load(
                holder_call, 0, "bench", keys, scatter, hint=hint, dst_block_ids=blocks
            )
            times.append(time.perf_counter() - start)
        return times

    def verify(self, case: str, n: int) -> bool:
        cache = self.caches[case]
        index = torch.arange(n)
        for layer in range(LAYERS):
            want = self.rows[layer : n * LAYERS : LAYERS]
            if not torch.equal(cache.gather(layer, index), want):
                return False
        return True


def _slot(key: bytes) -> int:
    return int.from_bytes(key, "big")


async def run(args: argparse.Namespace) -> None:
    bench = Bench(args.row_bytes)
    await bench.start()
    try:
        print(
            f"one process, DRAM, {LAYERS} layers x {args.row_bytes}-byte rows, "
            f"torch {torch.__version__}, {args.loads} loads after {args.warmup} "
            f"warm-up per case; slab placement scatters by "
            f"{bench.caches['slab'].scatter_path}"
        )
        print("| placement | blocks | p50 us | p95 us | p50 / first row's |")
        print("| --- | ---: | ---: | ---: | ---: |")
        base = None
        profile = cProfile.Profile() if args.profile else None
        for case in args.cases.split(","):
            for n in SIZES:
                await bench.loads(case, n, args.warmup)
                if profile is not None:
                    profile.enable()
                times = await bench.loads(case, n, args.loads)
                if profile is not None:
                    profile.disable()
                if not bench.verify(case, n):
                    raise SystemExit(f"{case}, {n} blocks: engine blocks differ")
                p50 = 1e6 * statistics.median(times)
                p95 = 1e6 * sorted(times)[int(0.95 * (len(times) - 1))]
                base = base or p50
                print(f"| {case} | {n} | {p50:.1f} | {p95:.1f} | {p50 / base:.2f} |")
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    finally:
        await bench.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--row-bytes",
        type=int,
        default=64,
        help="bytes of one layer's block (8192 for Qwen2.5-0.5B; small: the copy "
        "costs next to nothing and the Python is what is timed)",
    )
    parser.add_argument("--loads", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument(
        "--cases", default="engine,slab", help="placements to time: engine, slab"
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile every timed load"
    )
    args = parser.parse_args()
    if set(args.cases.split(",")) - {"engine", "slab"}:
        parser.error("--cases: engine, slab or both")
    if args.row_bytes <= 0 or args.row_bytes % 4 or args.loads < 1 or args.warmup < 0:
        parser.error(
            "--row-bytes must be a positive multiple of 4, --loads positive, "
            "--warmup >= 0"
        )
    torch.set_num_threads(1)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
