"""CPU-tier reads: rows in an xoscar RPC reply vs. a NIXL DRAM write into a slab.

Two sub-pools on ``nixl://`` addresses (two processes). The holder keeps a CPU tier of
64 snapshots of Qwen2.5-0.5B size (24 layers x 8 KiB rows = 192 KiB per block) and
serves reads of 1, 16 and 64 blocks, taken in reverse slot order (not one contiguous
run, as a real lease would not be). Each read ends with the rows copied into the
loader's destination tensor, and the contents are verified after every case.

  rpc        loader calls the holder; the holder gathers the rows into one
             contiguous buffer and returns it in the reply (what cpu_transfer does)
  nixl_exact loader calls the holder with the ref of a persistent registered CPU
             receive view of exactly the batch's size; the holder gathers into its
             persistent send slab and ``xo.copy_to``'s that view (one registration
             per size, reused: each case runs alone)
  nixl_full  the same through the whole 12 MiB slab (GPUTransfer's large batches)

Rows are copied as int64 (``layout.wide_view``), as the real code does.

Usage: python benchmark/cpu_tier_read.py [iterations] [modes, comma separated]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.engine.layout import wide_view

LAYERS, ROW, SLOTS = 24, 8192, 64
BLOCK = LAYERS * ROW
WARMUP = 20


def row_index(n: int) -> torch.Tensor:
    slots = torch.arange(SLOTS - 1, SLOTS - 1 - n, -1, dtype=torch.long)
    return (slots[:, None] * LAYERS + torch.arange(LAYERS)[None, :]).reshape(-1)


class Holder(xo.StatelessActor):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.rows = torch.randint(
            0, 256, (SLOTS * LAYERS, ROW), dtype=torch.uint8, generator=gen
        )
        self.send = torch.empty(SLOTS * BLOCK, dtype=torch.uint8)
        self.views: dict[int, torch.Tensor] = {}  # size -> persistent view

    def read_rows(self, n: int) -> np.ndarray:
        return wide_view(self.rows).index_select(0, row_index(n)).numpy()

    async def push(self, n: int, ref: object, nbytes: int) -> None:
        out = wide_view(self.send[: n * BLOCK].view(n * LAYERS, ROW))
        torch.index_select(wide_view(self.rows), 0, row_index(n), out=out)
        view = self.views.setdefault(nbytes, self.send[:nbytes])
        await xo.copy_to([view], [ref])


class Loader(xo.StatelessActor):
    def __init__(self) -> None:
        super().__init__()
        self.slab = torch.zeros(SLOTS * BLOCK, dtype=torch.uint8)
        self.dest = torch.zeros(SLOTS * LAYERS, ROW, dtype=torch.uint8)
        self.views: dict[int, torch.Tensor] = {}  # size -> persistent view
        self.refs: dict[int, object] = {}  # size -> its one buffer ref

    def _ref(self, nbytes: int) -> object:
        if nbytes not in self.refs:
            self.views[nbytes] = self.slab[:nbytes]
            self.refs[nbytes] = xo.buffer_ref(self.address, self.views[nbytes])
        return self.refs[nbytes]

    async def run(
        self, holder_address: str, mode: str, n: int, iterations: int
    ) -> tuple[list[float], bool]:
        holder = await xo.actor_ref(holder_address, "holder")
        dest = self.dest[: n * LAYERS]
        times = []
        for i in range(WARMUP + iterations):
            start = time.perf_counter()
            if mode == "rpc":
                reply = await holder.read_rows(n)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only reply
                    wide_view(dest).copy_(torch.from_numpy(reply))
            else:
                nbytes = SLOTS * BLOCK if mode == "nixl_full" else n * BLOCK
                await holder.push(n, self._ref(nbytes), nbytes)
                received = self.slab[: n * BLOCK].view(n * LAYERS, ROW)
                wide_view(dest).copy_(wide_view(received))
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        expected = await holder.read_rows(n)
        ok = bool(np.array_equal(wide_view(dest).numpy(), expected))
        self.dest.zero_()
        return times, ok


async def main() -> None:
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    modes = (
        sys.argv[2].split(",")
        if len(sys.argv) > 2
        else ["rpc", "nixl_exact", "nixl_full"]
    )
    pool = await xo.create_actor_pool(
        "127.0.0.1", n_process=2, external_address_schemes=["nixl"] * 3
    )
    async with pool:
        config = await xo.get_pool_config(pool.external_address)
        addresses = config.get_external_addresses()
        await xo.create_actor(Holder, address=addresses[1], uid="holder")
        loader = await xo.create_actor(Loader, address=addresses[2], uid="loader")
        print(
            f"{iterations} reads after {WARMUP} warm-up per case; two trials, the second in reverse order"
        )
        print(
            f"{'mode':10} {'blocks':>6} {'MiB':>6} {'p50 ms':>8} {'p90 ms':>8} {'GB/s p50':>8} ok"
        )
        for trial in range(2):
            for n in (1, 16, 64) if trial == 0 else (64, 16, 1):
                for mode in modes if trial == 0 else modes[::-1]:
                    times, ok = await loader.run(addresses[1], mode, n, iterations)
                    p50 = statistics.median(times)
                    p90 = sorted(times)[int(0.9 * len(times))]
                    print(
                        f"{mode:10} {n:6} {n * BLOCK / 2**20:6.2f} {p50 * 1e3:8.3f} "
                        f"{p90 * 1e3:8.3f} {n * BLOCK / p50 / 1e9:8.2f} {ok}",
                        flush=True,
                    )


if __name__ == "__main__":
    asyncio.run(main())
