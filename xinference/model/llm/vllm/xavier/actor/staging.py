"""Snapshot computed blocks into the store: copy every layer, then publish.

The blocks come from the engine's KV cache or from the worker's staging ring
(``connector.staging_ring``); ``stage_snapshots`` does not care which, it is handed
the copy. A snapshot is never visible before all its layers are in the store: slots
are reserved (invisible), the copy runs in a worker thread and is fenced, and only
then are the keys published. Nothing is published unless every staged snapshot was
copied: on failure every staged key is rolled back and the error re-raised. Keys
already present, or skipped by a full store, are not staged. No xoscar here: the
actor registers the published keys with the tracker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

import torch

from ..aio import finish_even_if_cancelled
from ..engine.blocks import BlockMajorCache
from ..engine.device import SharedTensorHandles, fence, import_tensors
from ..engine.layout import copy_snapshot_rows
from ..hashing import BlockHash
from ..stats import ActorCounters
from ..store.tiered import StageSlot, TieredKVSnapshotStore
from ..wire import CPU_TIER, DEVICE_TIER

# Copies (store slot, source index) pairs into the store and fences; blocking.
SnapshotCopy = Callable[[Sequence[tuple[StageSlot, int]]], None]


async def stage_snapshots(
    store: TieredKVSnapshotStore,
    sources: Mapping[BlockHash, int],
    logical_dtype: str,
    copy: SnapshotCopy,
    counters: ActorCounters,
) -> list[BlockHash]:
    """Snapshot the blocks at ``sources`` (key -> source index, in order) under
    their keys with ``copy``; returns the keys published.

    The caller must have completed the writes to the sources first (on CUDA:
    synchronised the stream that wrote them), and must not let them be reused
    before this returns.
    """
    try:
        batch = store.reserve_stage_batch(list(sources), logical_dtype)
    except BaseException:
        counters.stage_failures += 1
        raise
    staged = [(slot, sources[slot.key]) for slot in batch.slots]
    demoted = False

    def demote_then_copy() -> None:
        # In a worker thread: the demotions' device-to-host copy can take
        # milliseconds, and this actor shares its event loop with the replica's
        # model actor, which streams every token. The demotions read device rows
        # that the staged snapshots overwrite next, hence this order.
        nonlocal demoted
        store.copy_demotions(batch)
        demoted = True
        if staged:
            copy(staged)

    try:
        try:
            if batch.demotions or staged:
                await finish_even_if_cancelled(asyncio.to_thread(demote_then_copy))
        finally:
            store.settle_stage_batch(batch, demotions_copied=demoted)
        layers = range(store.geometry.num_layers)
        for slot, _ in staged:
            store.mark_layers_written(slot.key, layers)
        for slot, _ in staged:
            store.publish(slot.key)
    except BaseException:
        counters.stage_failures += 1
        for slot, _ in staged:
            if store.is_staging(slot.key):
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
    for tier in (DEVICE_TIER, CPU_TIER):
        picked = [(slot, block) for slot, block in staged if slot.tier == tier]
        if picked:
            cache.copy_blocks_to_rows(
                torch.tensor([block for _, block in picked], dtype=torch.long),
                store.rows(tier),
                [slot.first_row for slot, _ in picked],
            )
    # A snapshot must never be published before its copy has completed.
    fence(cache.device)
    fence(store.device)


def copy_ring_into_store(
    ring: torch.Tensor,
    store: TieredKVSnapshotStore,
    staged: Sequence[tuple[StageSlot, int]],
) -> None:
    """Copy staged snapshots from staging ring slots (``connector.staging_ring``: the
    store's row layout) into their store slots, then fence both devices."""
    num_layers = store.geometry.num_layers
    for tier in (DEVICE_TIER, CPU_TIER):
        picked = [(slot, ring_slot) for slot, ring_slot in staged if slot.tier == tier]
        if picked:
            copy_snapshot_rows(
                ring,
                [r * num_layers for _, r in picked],
                store.rows(tier),
                [slot.first_row for slot, _ in picked],
                num_layers,
            )
    fence(ring.device)
    if store.device != ring.device:
        fence(store.device)


def import_staging_ring(
    handles: SharedTensorHandles, cache: BlockMajorCache
) -> torch.Tensor:
    """Map the worker's staging ring and check it has the store's row layout."""
    (ring,) = import_tensors(handles)
    num_layers, row_nbytes = cache.num_layers, cache.layout.layer_block_nbytes
    if (
        ring.dtype != torch.uint8
        or ring.dim() != 2
        or ring.shape[1] != row_nbytes
        or ring.shape[0] % num_layers
        or ring.device != cache.device
    ):
        raise ValueError(
            f"the staging ring is {ring.dtype} {tuple(ring.shape)} on {ring.device}; "
            f"expected uint8 rows of {row_nbytes} bytes, {num_layers} per slot, on "
            f"{cache.device}"
        )
    return ring


def device_tier_bytes(budget_bytes: int | None, ring: torch.Tensor | None) -> int:
    """The device tier's share of the replica's device budget: what the worker's
    staging ring, which lives on the same device, leaves of it (0: no tier).

    The worker sizes its ring from the same budget (``connector.staging_ring``),
    so the two together stay within ``xavier_gpu_cache_bytes``."""
    if not budget_bytes:
        return 0
    ring_nbytes = 0 if ring is None else ring.numel() * ring.element_size()
    return max(0, budget_bytes - ring_nbytes)
