"""The CPU-tier read path: holder-side gather, loader-side batched reads and checks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from xinference.model.llm.vllm.xavier.engine.layout import PACKED_KV_LAYOUT
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.stats import TransportStats
from xinference.model.llm.vllm.xavier.store.tiered import TieredKVSnapshotStore
from xinference.model.llm.vllm.xavier.transports.cpu_tier import (
    check_cpu_rows_reply,
    gather_cpu_rows,
    load_cpu_rows,
)
from xinference.model.llm.vllm.xavier.transports.xoscar.gpu_transfer import (
    LogicalDtypeMismatch,
)
from xinference.model.llm.vllm.xavier.wire import KVGeometry, StageItem

from .._support import (
    EngineSpec,
    SyntheticEngine,
    all_bf16_patterns,
    cluster,
    new_id,
    stage_and_register,
)

__all__ = ["cluster"]  # the fixture, imported for pytest

pytestmark = pytest.mark.timeout(120)

GEOMETRY = KVGeometry(num_layers=3, layer_block_nbytes=64, logical_dtype="bfloat16")
KEYS = hash_full_blocks(list(range(8 * 4)), 4, "cpu-transfer-test")


def publish(store: TieredKVSnapshotStore, key: bytes, fill: int) -> None:
    slot = store.begin_stage(key, "bfloat16")
    assert slot is not None
    rows = store.rows(slot.tier)
    for layer in range(GEOMETRY.num_layers):
        rows[slot.first_row + layer].fill_(fill + layer)
    store.mark_layers_written(key, range(GEOMETRY.num_layers))
    store.publish(key)


def test_gather_returns_every_layer_of_the_leased_keys_in_order():
    store = TieredKVSnapshotStore(GEOMETRY, "cpu", 0, cpu_capacity_blocks=8)
    for i, key in enumerate(KEYS[:4]):
        publish(store, key, fill=10 * i)
    store.lease("lease", KEYS[:4])
    dtypes, rows = gather_cpu_rows(store, "lease", [KEYS[2], KEYS[0]])
    assert dtypes == ("bfloat16", "bfloat16")
    assert rows.dtype == np.uint8 and rows.shape == (6, 64)
    assert rows[:, 0].tolist() == [20, 21, 22, 0, 1, 2]
    empty_dtypes, empty = gather_cpu_rows(store, "lease", [])
    assert empty_dtypes == () and empty.shape == (0, 64)
    with pytest.raises(KeyError, match="is not held by lease"):
        gather_cpu_rows(store, "lease", [KEYS[5]])
    with pytest.raises(KeyError, match="no active lease"):
        gather_cpu_rows(store, "other", [KEYS[0]])


def test_gather_refuses_device_tier_snapshots():
    store = TieredKVSnapshotStore(
        GEOMETRY, "cpu", GEOMETRY.block_nbytes, cpu_capacity_blocks=8
    )
    publish(store, KEYS[0], fill=1)  # takes the one device slot
    store.lease("lease", KEYS[:1])
    with pytest.raises(ValueError, match="in the device tier"):
        gather_cpu_rows(store, "lease", KEYS[:1])


def test_replies_are_checked_on_arrival():
    keys = KEYS[:2]
    good = np.zeros((6, 64), dtype=np.uint8)
    assert check_cpu_rows_reply((("bfloat16",) * 2, good), keys, GEOMETRY).shape == (
        6,
        64,
    )
    with pytest.raises(LogicalDtypeMismatch):
        check_cpu_rows_reply((("bfloat16", "float16"), good), keys, GEOMETRY)
    with pytest.raises(ValueError, match="described 1 snapshots for 2 keys"):
        check_cpu_rows_reply((("bfloat16",), good), keys, GEOMETRY)
    with pytest.raises(ValueError, match=r"expected uint8 \(6, 64\)"):
        check_cpu_rows_reply((("bfloat16",) * 2, good[:5]), keys, GEOMETRY)
    with pytest.raises(ValueError, match="expected uint8"):
        check_cpu_rows_reply((("bfloat16",) * 2, good.view(np.int16)), keys, GEOMETRY)


@pytest.mark.nixl
async def test_batched_reads_from_a_holder_in_another_process_are_bit_exact(cluster):
    """All BF16 patterns in 16 CPU-tier snapshots, read in batches of 5 blocks."""
    engine = SyntheticEngine(EngineSpec(PACKED_KV_LAYOUT, num_layers=2, num_blocks=32))
    holder = await cluster.add_replica(0, engine, None, cpu_capacity_blocks=32)
    patterns = all_bf16_patterns()
    n = patterns.numel() // engine.block_elements()
    blocks = engine.fill_blocks(range(n), patterns)
    keys = hash_full_blocks(list(range(n * 16)), 16, "cpu-read")
    assert (
        await stage_and_register(
            holder, [StageItem(k, b) for k, b in zip(keys, blocks, strict=True)]
        )
        == n
    )
    lease_id = new_id("lease")
    grant = await holder.reserve(keys, lease_id, engine.identity())
    assert set(grant.tiers) == {"cpu"}

    received: dict[int, torch.Tensor] = {}

    def scatter(first_row: int, rows: torch.Tensor) -> None:
        received[first_row] = rows.clone()

    geometry = engine.geometry
    counters = TransportStats()
    loaded = await load_cpu_rows(
        holder,
        lease_id,
        keys,
        geometry,
        scatter,
        timeout_s=30,
        max_read_bytes=5 * geometry.block_nbytes,
        counters=counters,
    )
    assert loaded == n * geometry.num_layers
    assert sorted(received) == [0, 10, 20, 30]  # 4 reads: 5 + 5 + 5 + 1 blocks
    # each reply counted as it arrived: the rows, nothing more
    assert counters.received_copies == 4 and counters.loads == 1
    assert counters.received_wire_bytes == n * geometry.block_nbytes
    assert counters.received_useful_bytes == n * geometry.block_nbytes
    # a refused read (no such lease) counts as a failure, a late one as a timeout
    with pytest.raises(KeyError):
        await load_cpu_rows(
            holder, "no-lease", keys[:1], geometry, scatter, 30, counters=counters
        )
    assert counters.transfer_failures == 1 and counters.loads == 1

    class Stalled:
        async def read_cpu_rows(self, lease_id, keys):
            await asyncio.sleep(30)

    with pytest.raises(TimeoutError):
        await load_cpu_rows(
            Stalled(), lease_id, keys[:1], geometry, scatter, 0.05, counters=counters
        )
    assert counters.transfer_timeouts == 1 and counters.transfer_failures == 1
    rows = torch.cat([received[r] for r in sorted(received)])
    assert torch.equal(rows.reshape(-1).view(torch.int16), patterns.view(torch.int16))
    stats = await holder.stats()
    assert stats.actor.cpu_rows_served == n * geometry.num_layers
    await holder.release(lease_id)
