"""The write path's copies, before and after issue 44, on one device.

Two copies carry every staged block (``docs/internals.md``, Stage):

  staging   on the engine's thread, in ``wait_for_save``: a step's full blocks
            out of the engine's per-layer caches into consecutive staging ring
            slots. Before: the ids as a tensor read back to check them, a fresh
            pinned buffer per call, a gather into a new tensor as large as the
            copy, then a copy into the ring (``gather_snapshots`` and
            ``write_snapshot_rows``). After: the ids checked as a list, staged
            through the cache's pinned buffers, one gather straight into the ring
            (``copy_listed_blocks_to_rows``).
  demotion  in the transfer actor: device-tier snapshots to CPU-tier slots when
            the device tier is full (half its bytes, in the workloads of issue 44).
            Before: a gather on the device, a copy to a new pageable host tensor,
            then a copy on the host into the tier. After: one copy per run of
            snapshots that follow each other on both sides, straight into the
            tier, page-locked on a GPU (``copy_snapshot_rows``, ``HostPin``).

An 8B model's geometry (Llama-3.1-8B: 32 layers, blocks of 16 tokens x 8 KV heads
x 128 dims, K and V packed, in bfloat16: 2 MiB a block), the layout vLLM 0.26
uses on an H100 (``packed_kv_nhd``, one allocation per layer). Staging takes 1,
16 and 128 blocks (a 2,048-token step), the engine thread's time being what the
engine waits (its copies are only queued, until the device time is measured
apart with a synchronisation); demotion takes 128 snapshots whose CPU slots are
scattered (a full tier's LRU victims), device to host, synchronised. Rounds
alternate the cases; the table gives medians and the ratio after / before. Every
case's result is checked against the other's.

    python benchmark/write_path_copies.py --device cuda [--rounds 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.device import HostPin, fence
from xinference.model.llm.vllm.xavier.engine.layout import (
    PACKED_KV_NHD_LAYOUT,
    copy_snapshot_rows,
    detect_layout,
    read_snapshot_rows,
    wide_view,
    write_snapshot_rows,
)

LAYERS, TOKENS, HEADS, DIM = 32, 16, 8, 128
STAGE_BLOCKS = (1, 16, 128)
DEMOTE_BLOCKS = 128


def engine_cache(num_blocks: int, device: str) -> BlockMajorCache:
    """Per-layer KV tensors in ``packed_kv_nhd``, random, one allocation each."""
    layers = []
    for _ in range(LAYERS):
        memory = torch.randint(
            -(2**15), 2**15, (num_blocks * TOKENS * HEADS * 2 * DIM,), dtype=torch.int16
        ).to(device)
        layers.append(
            memory.view(torch.bfloat16)
            .view(num_blocks, TOKENS, HEADS, 2 * DIM)
            .transpose(1, 2)
        )
    return BlockMajorCache(
        layers, detect_layout(layers, num_blocks, PACKED_KV_NHD_LAYOUT)
    )


def staging_before(
    cache: BlockMajorCache, ids: list[int], ring: torch.Tensor, first_rows: list[int]
) -> None:
    snapshots = cache.gather_snapshots(torch.tensor(ids, dtype=torch.long))
    write_snapshot_rows(
        ring, first_rows, wide_view(snapshots, wide_view(ring).dtype), cache.num_layers
    )


def staging_after(
    cache: BlockMajorCache, ids: list[int], ring: torch.Tensor, first_rows: list[int]
) -> None:
    cache.copy_listed_blocks_to_rows(ids, ring, first_rows)


def demotion_before(
    device_rows: torch.Tensor,
    sources: list[int],
    cpu_rows: torch.Tensor,
    targets: list[int],
) -> None:
    rows = read_snapshot_rows(device_rows, sources, LAYERS)
    write_snapshot_rows(cpu_rows, targets, rows.to("cpu"), LAYERS)
    fence(device_rows.device)


def demotion_after(
    device_rows: torch.Tensor,
    sources: list[int],
    cpu_rows: torch.Tensor,
    targets: list[int],
) -> None:
    copy_snapshot_rows(device_rows, sources, cpu_rows, targets, LAYERS)
    fence(device_rows.device)


def timed(call: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """(host seconds of ``call``, seconds until its device work completed)."""
    fence(device)
    started = time.perf_counter()
    call()
    host = time.perf_counter() - started
    fence(device)
    return host, time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    rng = random.Random(44)
    num_blocks = 2 * max(STAGE_BLOCKS) + 8
    cache = engine_cache(num_blocks, args.device)
    row = cache.layout.layer_block_nbytes
    block = row * LAYERS
    ring = torch.empty((max(STAGE_BLOCKS) * LAYERS, row), dtype=torch.uint8).to(device)
    check = torch.empty_like(ring)
    rows_out: list[dict[str, Any]] = []
    for n in STAGE_BLOCKS:
        ids = rng.sample(range(num_blocks), n)
        first_rows = [i * LAYERS for i in range(n)]
        cases = {"before": staging_before, "after": staging_after}
        for name, case in cases.items():  # results equal, warm caches
            out = ring if name == "after" else check
            out.zero_()
            case(cache, ids, out, first_rows)
        fence(device)
        assert torch.equal(ring[: n * LAYERS], check[: n * LAYERS]), n
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, case in cases.items():
                times[name].append(
                    timed(
                        lambda c=case, i=ids, f=first_rows: c(cache, i, ring, f),
                        device,
                    )
                )
        rows_out.append(_row(f"staging {n} blocks", n * block, times))
    # demotion: a full device tier's LRU victims to scattered CPU slots
    slots = 4 * DEMOTE_BLOCKS
    device_rows = torch.randint(0, 256, (slots * LAYERS, row), dtype=torch.uint8).to(
        device
    )
    cpu_rows = torch.empty((slots * LAYERS, row), dtype=torch.uint8)
    pin = HostPin(cpu_rows)
    pinned = device.type == "cuda" and pin.pin()
    sources = [s * LAYERS for s in rng.sample(range(slots), DEMOTE_BLOCKS)]
    targets = [t * LAYERS for t in rng.sample(range(slots), DEMOTE_BLOCKS)]
    cases = {"before": demotion_before, "after": demotion_after}
    reference = None
    for case in cases.values():
        cpu_rows.zero_()
        case(device_rows, sources, cpu_rows, targets)
        got = torch.cat([cpu_rows[t : t + LAYERS] for t in targets])
        assert reference is None or torch.equal(got, reference)
        reference = got
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            times[name].append(
                timed(lambda c=case: c(device_rows, sources, cpu_rows, targets), device)
            )
    rows_out.append(
        _row(
            f"demotion {DEMOTE_BLOCKS} blocks to "
            f"{'page-locked' if pinned else 'pageable'} host memory",
            DEMOTE_BLOCKS * block,
            times,
        )
    )
    pin.unpin()
    return {
        "device": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        ),
        "rounds": args.rounds,
        "block_nbytes": block,
        "rows": rows_out,
    }


def _row(
    name: str, nbytes: int, times: dict[str, list[tuple[float, float]]]
) -> dict[str, Any]:
    out: dict[str, Any] = {"case": name, "bytes": nbytes}
    for label, samples in times.items():
        out[f"{label}_host_ms"] = statistics.median(h for h, _ in samples) * 1e3
        out[f"{label}_done_ms"] = statistics.median(d for _, d in samples) * 1e3
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['device']}, medians of {result['rounds']} rounds (host: the "
        "calling thread's time; done: until the device work completed)",
        "| copy | before host ms | after host ms | ratio | before done ms "
        "| after done ms | ratio | after GB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['case']} | {row['before_host_ms']:.3f} | "
            f"{row['after_host_ms']:.3f} | "
            f"{row['after_host_ms'] / row['before_host_ms']:.2f} | "
            f"{row['before_done_ms']:.3f} | {row['after_done_ms']:.3f} | "
            f"{row['after_done_ms'] / row['before_done_ms']:.2f} | "
            f"{row['bytes'] / row['after_done_ms'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = run(args)
    print(table(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
