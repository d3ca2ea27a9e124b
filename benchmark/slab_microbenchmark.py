"""Slab-selection microbenchmark: what switching slab views costs on a real channel.

Two processes (sub-pools of one xoscar pool on ``nixl://`` addresses), each with the
real ``GPUTransfer``: a holder that serves rows and a loader that loads them with
``load_rows`` (one push call and one ``copy_to`` per load). Payloads are one
Qwen2.5-0.5B snapshot (192 KiB, fits the 256 KiB view) or 64 snapshots (12 MiB, the
full slab). Cases:

  always-full          alternating payloads, every copy through the full slab
  alternating-old      alternating payloads, the view whenever the batch fits it
  alternating-new      alternating payloads, SlabSelector (the runtime's default)
  sustained-small-old  small payloads only, the view whenever the batch fits it
  sustained-small-new  small payloads only, SlabSelector

Each case runs ``--warmup`` loads, then ``--copies`` measured loads, in forward case
order in odd trials and reverse order in even ones. The destination is cleared
before each case of each trial and compared with the source afterwards. NIXL
registrations are counted in both processes by wrapping
``nixl_agent.register_memory`` (the real method still runs). The floor is a plain
torch copy of the same bytes on the same device. Both peers run with one torch
thread by default (``--torch-threads``): with more, CPU gathers and scatters wake
intra-op threads whose spinning starves the event loops and UCX.

Run from the repository root:

  python benchmark/slab_microbenchmark.py --device cpu [--copies 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import xoscar as xo

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.model.llm.vllm.xavier.transports.registrations import (
    install_registration_counter,
    registration_calls,
)
from xinference.model.llm.vllm.xavier.transports.xoscar.gpu_transfer import (  # noqa: E402
    GPUTransfer,
    PushRequest,
    chunk_row_index,
    full_slab_bytes,
)
from xinference.model.llm.vllm.xavier.transports.xoscar.slab_selector import (  # noqa: E402
    FullSlabSelector,
    SlabPolicy,
    SlabSelector,
    SmallestFitSelector,
)
from xinference.model.llm.vllm.xavier.wire import KVGeometry

KiB = 1024
MiB = 1024 * KiB
GEOMETRY = KVGeometry(
    num_layers=24, layer_block_nbytes=8 * KiB, logical_dtype="bfloat16"
)
NUM_SLOTS = 64  # 64 snapshots = 12 MiB = the full slab
HOLDER_UID = "slab-bench-holder"
LOADER_UID = "slab-bench-loader"
SOURCE_SEED = 20261202

POLICIES: dict[str, Callable[[int], SlabPolicy]] = {
    "full": FullSlabSelector,
    "smallest": SmallestFitSelector,
    "streak": SlabSelector,
}
# case -> (payload pattern, policy)
CASES = {
    "always-full": ("alternating", "full"),
    "alternating-old": ("alternating", "smallest"),
    "alternating-new": ("alternating", "streak"),
    "sustained-small-old": ("small", "smallest"),
    "sustained-small-new": ("small", "streak"),
}


def source_rows(device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SOURCE_SEED)
    rows = torch.randint(
        0,
        256,
        (NUM_SLOTS * GEOMETRY.num_layers, GEOMETRY.layer_block_nbytes),
        dtype=torch.uint8,
        generator=gen,
    )
    return rows.to(device)


def batches(pattern: str, count: int, offset: int) -> list[list[int]]:
    """Slots per load: one rotating snapshot, or all 64 (alternating with one)."""
    out = []
    for i in range(offset, offset + count):
        if pattern == "alternating" and i % 2 == 1:
            out.append(list(range(NUM_SLOTS)))
        else:
            out.append([i % NUM_SLOTS])
    return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def scatter_into(
    dest: torch.Tensor, key_first_rows: list[int], num_layers: int
) -> Callable[[int, torch.Tensor], None]:
    """A scatter callback writing a load's global rows into ``dest``'s snapshot rows."""

    def scatter(first_row: int, rows: torch.Tensor) -> None:
        index = chunk_row_index(key_first_rows, num_layers, first_row, rows.shape[0])
        dest.index_copy_(0, index.to(dest.device), rows)

    return scatter


class BenchPeer(xo.StatelessActor):
    def __init__(self, device: str, torch_threads: int) -> None:
        super().__init__()
        if torch_threads > 0:
            # CPU gathers/scatters otherwise wake every intra-op thread; their
            # spinning competes with the event loop and UCX's progress thread.
            torch.set_num_threads(torch_threads)
        self._device = device
        self.rows = source_rows(device)  # the holder serves these
        self.dest = torch.zeros_like(self.rows)  # the loader fills this
        # (wire bytes, seconds) of each serve_push since the last take
        self.serve_times: list[tuple[int, float]] = []

    async def __post_create__(self) -> None:
        self.transfer = self._new_transfer("streak")

    def _new_transfer(self, policy: str) -> GPUTransfer:
        selector: SlabPolicy = POLICIES[policy](full_slab_bytes(GEOMETRY))
        return GPUTransfer(self.address, self._device, GEOMETRY, selector=selector)

    def instrument(self) -> None:
        install_registration_counter()

    def snapshot(self) -> dict[str, int]:
        return {
            "registration_calls": registration_calls(),
            **self.transfer.counters.as_dict(),
        }

    # holder

    async def push_rows(self, req: PushRequest) -> None:
        layers = GEOMETRY.num_layers
        index = chunk_row_index(
            [int.from_bytes(k, "big") * layers for k in req.keys],
            layers,
            req.first_row,
            req.num_rows,
        )
        start = time.perf_counter()
        await self.transfer.serve_push(req, self.rows, index)
        self.serve_times.append((req.wire_bytes, time.perf_counter() - start))

    def take_serve_times(self) -> list[tuple[int, float]]:
        times, self.serve_times = self.serve_times, []
        return times

    # loader

    def start_case(self, policy: str) -> None:
        """A fresh runtime with this policy (its selector starts with no streaks)."""
        self.transfer = self._new_transfer(policy)
        self.dest.zero_()
        _synchronize(self.dest.device)

    async def load(self, holder_address: str, plan: list[list[int]]) -> list[float]:
        """Load each batch; seconds per load (each load is one copy)."""
        holder = await xo.actor_ref(holder_address, HOLDER_UID)
        layers = GEOMETRY.num_layers
        times = []
        for slots in plan:
            scatter = scatter_into(self.dest, [s * layers for s in slots], layers)

            start = time.perf_counter()
            await self.transfer.load_rows(
                0,
                holder.push_rows,
                "bench-lease",
                [s.to_bytes(16, "big") for s in slots],
                scatter,
            )
            times.append(time.perf_counter() - start)
        # the last scatter may still be queued on the device: count it
        start = time.perf_counter()
        _synchronize(self.dest.device)
        times[-1] += time.perf_counter() - start
        return times

    def verify(self, slots: list[int]) -> bool:
        """Loaded slots hold the source's bytes; the others are still clear."""
        layers = GEOMETRY.num_layers
        loaded = torch.zeros(NUM_SLOTS, dtype=torch.bool)
        loaded[slots] = True
        rows = loaded.repeat_interleave(layers).to(self.dest.device)
        expected = torch.where(rows[:, None], self.rows, torch.zeros_like(self.rows))
        return bool(torch.equal(self.dest, expected))


def copy_floor_ms(device: torch.device, nbytes: int, reps: int) -> float:
    """Median of a plain torch copy of ``nbytes`` on ``device``, in ms."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(10):
        dst.copy_(src)
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end))
    else:
        for _ in range(reps):
            start = time.perf_counter()
            dst.copy_(src)
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


async def run_case(
    name: str,
    holder: Any,
    loader: Any,
    holder_address: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    pattern, policy = CASES[name]
    warmup = batches(pattern, args.warmup, 0)
    measured = batches(pattern, args.copies, args.warmup)
    await loader.start_case(policy)
    await loader.load(holder_address, warmup)
    await holder.take_serve_times()
    before = (await holder.snapshot(), await loader.snapshot())
    load_s = await loader.load(holder_address, measured)
    after = (await holder.snapshot(), await loader.snapshot())
    serve = await holder.take_serve_times()
    loaded = sorted({slot for batch in warmup + measured for slot in batch})
    if not await loader.verify(loaded):
        raise RuntimeError(f"{name}: destination differs from the source")
    sent = {k: after[0][k] - before[0][k] for k in after[0]}
    return {
        "case": name,
        "pattern": pattern,
        "policy": policy,
        "copies": sent["copies"],
        "ms_per_copy": 1e3 * sum(load_s) / len(load_s),
        "p50_ms": 1e3 * statistics.median(load_s),
        "serve_ms_per_copy": 1e3 * sum(t for _, t in serve) / len(serve),
        "registrations_holder": sent["registration_calls"],
        "registrations_loader": after[1]["registration_calls"]
        - before[1]["registration_calls"],
        "counted_local": sent["local_registration_changes"],
        "counted_remote": sent["remote_registration_changes"],
        "wire_bytes": sent["wire_bytes"],
        "useful_bytes": sent["useful_bytes"],
        "wire_sizes": sorted({w for w, _ in serve}),
        "wire_counts": {str(w): sum(1 for x, _ in serve if x == w) for w, _ in serve},
        "verified": True,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    pool = await xo.create_actor_pool(
        "127.0.0.1", n_process=2, external_address_schemes=["nixl"] * 3
    )
    async with pool:
        holder_address, loader_address = list(pool.sub_processes)
        holder = await xo.create_actor(
            BenchPeer,
            args.device,
            args.torch_threads,
            address=holder_address,
            uid=HOLDER_UID,
        )
        loader = await xo.create_actor(
            BenchPeer,
            args.device,
            args.torch_threads,
            address=loader_address,
            uid=LOADER_UID,
        )
        await holder.instrument()
        await loader.instrument()
        # the first copy on a channel creates NIXL agents (about a second): not a case
        await loader.load(holder_address, batches("small", 2, 0))

        names = list(CASES) if not args.cases else args.cases.split(",")
        trials = []
        for trial in range(args.trials):
            order = names if trial % 2 == 0 else names[::-1]
            results = []
            for name in order:
                results.append(
                    await run_case(name, holder, loader, holder_address, args)
                )
                print(
                    f"trial {trial + 1} {name}: "
                    f"{results[-1]['ms_per_copy']:.4f} ms/copy",
                    file=sys.stderr,
                    flush=True,
                )
            trials.append({"order": order, "results": results})

    floors = {
        size: copy_floor_ms(device, size, args.floor_reps)
        for size in (full_slab_bytes(GEOMETRY), 256 * KiB)
    }
    return {
        "device": str(device),
        "device_name": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        ),
        "versions": {
            name: importlib.metadata.version(name)
            for name in ("torch", "xoscar", "nixl")
        },
        "geometry": {
            "num_layers": GEOMETRY.num_layers,
            "layer_block_nbytes": GEOMETRY.layer_block_nbytes,
        },
        "torch_threads": args.torch_threads or torch.get_num_threads(),
        "warmup": args.warmup,
        "copies": args.copies,
        "trials": trials,
        "floor_ms": {str(k): v for k, v in floors.items()},
    }


def summarise(report: dict[str, Any]) -> list[dict[str, Any]]:
    floors = {int(k): v for k, v in report["floor_ms"].items()}
    by_case: dict[str, list[dict[str, Any]]] = {}
    for trial in report["trials"]:
        for result in trial["results"]:
            by_case.setdefault(result["case"], []).append(result)
    rows = []
    for name, results in by_case.items():
        counts = results[0]["wire_counts"]
        floor = sum(floors[int(w)] * n for w, n in counts.items()) / sum(
            counts.values()
        )
        rows.append(
            {
                "case": name,
                "ms_per_copy": statistics.median(r["ms_per_copy"] for r in results),
                "serve_ms_per_copy": statistics.median(
                    r["serve_ms_per_copy"] for r in results
                ),
                "registrations": [
                    (r["registrations_holder"], r["registrations_loader"])
                    for r in results
                ],
                "counted": [(r["counted_local"], r["counted_remote"]) for r in results],
                "wire_bytes": results[0]["wire_bytes"],
                "useful_bytes": results[0]["useful_bytes"],
                "floor_ms_per_copy": floor,
            }
        )
    base = next((r for r in rows if r["case"] == "always-full"), None)
    for row in rows:
        row["time_vs_full"] = row["ms_per_copy"] / base["ms_per_copy"] if base else None
        row["wire_vs_full"] = row["wire_bytes"] / base["wire_bytes"] if base else None
    return rows


def print_table(report: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(
        f"device {report['device_name']} ({report['device']}); "
        f"{report['warmup']} warm-up + {report['copies']} measured copies per case, "
        f"{len(report['trials'])} trials (forward/reverse order); "
        f"torch threads per peer {report['torch_threads']}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    )
    header = (
        f"{'case':<21} {'ms/copy':>8} {'serve ms':>8} {'floor ms':>8} "
        f"{'regs H/L per trial':>20} {'counted':>10} {'wire MiB':>9} "
        f"{'useful MiB':>10} {'t/full':>6} {'wire/full':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        regs = ",".join(f"{h}/{lo}" for h, lo in row["registrations"])
        counted = ",".join(f"{a}/{b}" for a, b in row["counted"])
        ratio = "n/a" if row["time_vs_full"] is None else f"{row['time_vs_full']:.3f}"
        wire = "n/a" if row["wire_vs_full"] is None else f"{row['wire_vs_full']:.3f}"
        print(
            f"{row['case']:<21} {row['ms_per_copy']:>8.4f} "
            f"{row['serve_ms_per_copy']:>8.4f} {row['floor_ms_per_copy']:>8.4f} "
            f"{regs:>20} {counted:>10} {row['wire_bytes'] / MiB:>9.1f} "
            f"{row['useful_bytes'] / MiB:>10.1f} {ratio:>6} {wire:>9}"
        )
    print(
        "ms/copy: load_rows on the loader (push call + gather + copy_to + scatter), "
        "mean per trial, median over trials; serve ms: gather + copy_to on the "
        "holder; floor: torch copy of the same bytes; regs: NIXL register_memory "
        "calls, holder/loader; counted: GPUTransfer's local/remote registration "
        "changes; bytes per trial."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--copies", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch.set_num_threads in both peers (0: torch's default); with more "
        "than one, CPU gathers and scatters wake intra-op threads whose spinning "
        "starves the event loops and UCX (10x slower CPU copies were seen)",
    )
    parser.add_argument("--floor-reps", type=int, default=200)
    parser.add_argument(
        "--cases", default="", help=f"comma-separated subset of {','.join(CASES)}"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if args.warmup < 2 or args.copies < 2 or args.trials < 1:
        parser.error("need --warmup >= 2, --copies >= 2 and --trials >= 1")
    report = asyncio.run(run(args))
    rows = summarise(report)
    report["summary"] = rows
    print_table(report, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
