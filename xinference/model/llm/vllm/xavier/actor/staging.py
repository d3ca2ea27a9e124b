"""Snapshot computed engine blocks into the store: copy every layer, then publish.

A snapshot is never visible before all its layers are in the store: slots are
reserved (invisible), the copy runs in a worker thread and is fenced, and only then
are the keys published. Nothing is published unless every staged snapshot was
copied: on failure every staged key is rolled back and the error re-raised. Keys
already present, or skipped by a full store, are not staged. No xoscar here: the
actor registers the published keys with the tracker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from ..aio import finish_even_if_cancelled
from ..engine.blocks import BlockMajorCache
from ..engine.device import fence
from ..engine.layout import wide_view
from ..hashing import BlockHash
from ..stats import ActorCounters
from ..store.tiered import StageSlot, TieredKVSnapshotStore
from ..wire import CPU_TIER, DEVICE_TIER, StageItem


async def stage_snapshots(
    cache: BlockMajorCache,
    store: TieredKVSnapshotStore,
    items: Sequence[StageItem],
    counters: ActorCounters,
) -> list[BlockHash]:
    """Snapshot ``items``' engine blocks under their keys; returns the keys published.

    The caller must have completed the engine's writes to these blocks first (on
    CUDA: synchronised the stream that computed them), and must not let them be
    reused before this returns.
    """
    staged: list[tuple[StageSlot, int]] = []
    try:
        for item in items:
            slot = store.begin_stage(item.key, cache.layout.dtype)
            if slot is not None:
                staged.append((slot, item.block_id))
        if staged:
            await finish_even_if_cancelled(
                asyncio.to_thread(copy_blocks_into_store, cache, store, staged)
            )
            layers = range(cache.num_layers)
            for slot, _ in staged:
                store.mark_layers_written(slot.key, layers)
            for slot, _ in staged:
                store.publish(slot.key)
    except BaseException:
        counters.stage_failures += 1
        for slot, _ in staged:
            if not store.contains(slot.key):
                store.abort_stage(slot.key)
        raise
    counters.snapshots_staged += len(staged)
    return [slot.key for slot, _ in staged]


def copy_blocks_into_store(
    cache: BlockMajorCache,
    store: TieredKVSnapshotStore,
    staged: Sequence[tuple[StageSlot, int]],
) -> None:
    """Copy every layer of the staged engine blocks into their store slots, then
    fence both devices. Runs in a worker thread: the slots are reserved and
    invisible, so nothing else touches them meanwhile."""
    num_layers = cache.num_layers
    for tier in (DEVICE_TIER, CPU_TIER):
        picked = [(slot, block) for slot, block in staged if slot.tier == tier]
        if not picked:
            continue
        rows = wide_view(store.rows(tier))
        blocks = torch.tensor([block for _, block in picked], dtype=torch.long)
        first_rows = torch.tensor(
            [slot.first_row for slot, _ in picked], dtype=torch.long, device=rows.device
        )
        for layer in range(num_layers):
            gathered = wide_view(
                cache.gather(layer, blocks).to(rows.device), rows.dtype
            )
            rows.index_copy_(0, first_rows + layer, gathered)
    # A snapshot must never be published before its copy has completed.
    fence(cache.device)
    fence(store.device)
