"""The direct NIXL transport with real agents in two processes.

Each test runs two xoscar sub-pools on ``nixl://`` addresses; the actors
(``transport_peers.py``) own a ``NixlDirectTransport`` each, so every load below is a
real NIXL READ between two processes (DRAM on CPU tensors, VRAM on CUDA tensors).
The pure planning helpers are tested first, without NIXL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.layout import (
    PACKED_KV_NHD_LAYOUT,
    detect_layout,
)
from xinference.model.llm.vllm.xavier.transports.nixl.endpoint import NixlAgentEndpoint
from xinference.model.llm.vllm.xavier.transports.nixl.peers import PeerPath
from xinference.model.llm.vllm.xavier.transports.nixl.placement import (
    PLACEMENT_AUTO,
    PLACEMENT_ENGINE,
    PLACEMENT_SLAB,
    engine_reads_are_bounded,
)
from xinference.model.llm.vllm.xavier.transports.nixl.plan import (
    EngineBlockMap,
    plan_engine_read,
    plan_slab_read,
    plan_slab_rows,
)
from xinference.model.llm.vllm.xavier.transports.nixl.ucx import (
    PROGRESS_THREAD_DELAY_ENV,
    PROGRESS_THREAD_DELAY_US,
    _progress_thread_delay,
    progress_thread_delay_us,
    ucx_settings,
)
from xinference.model.llm.vllm.xavier.transports.nixl.wire import (
    NixlRegion,
    NixlTransferError,
    NixlTransferTimeout,
)
from xinference.model.llm.vllm.xavier.wire import KVGeometry

from ..._support import CUDA_SKIP, DEVICES, all_bf16_patterns, wait_until_stopped
from ..peers import PeerSpec, transport_pair

KiB = 1024
# Two layers of 4 KiB rows: 65,536 BF16 values (128 KiB) fill 16 snapshots exactly.
GEOMETRY = KVGeometry(
    num_layers=2, layer_block_nbytes=4 * KiB, logical_dtype="bfloat16"
)


def random_bytes(nbytes: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        .numpy()
        .tobytes()
    )


def rows_of(data: bytes, slot: int, geometry: KVGeometry = GEOMETRY) -> bytes:
    n = geometry.block_nbytes
    return data[slot * n : (slot + 1) * n]


# ---- planning, without NIXL ---------------------------------------------------------

STORE = NixlRegion("DRAM", 1 << 20, 64 * 4096, 0)
SLAB = NixlRegion("DRAM", 1 << 30, 8 * 4096, 0)


def test_slab_plan_is_one_descriptor_per_contiguous_run() -> None:
    """Keys in consecutive holder slots read as one run; a gap starts another."""
    plan = plan_slab_read([0, 2, 4, 10], 2, 4096, STORE, SLAB, 0, 8)
    assert plan.descriptors == 2
    assert plan.nbytes == 8 * 4096
    local, remote = plan.local.tolist(), plan.remote.tolist()
    assert remote == [
        [STORE.address, 6 * 4096, 0],
        [STORE.address + 10 * 4096, 2 * 4096, 0],
    ]
    assert local == [
        [SLAB.address, 6 * 4096, 0],
        [SLAB.address + 6 * 4096, 2 * 4096, 0],
    ]


def test_slab_plan_chunk_starts_inside_a_key() -> None:
    """A chunk may begin at any global row: row 3 is layer 1 of the second key."""
    plan = plan_slab_read([20, 40], 2, 4096, STORE, SLAB, 3, 1)
    assert plan.remote.tolist() == [[STORE.address + 41 * 4096, 4096, 0]]
    assert plan.local.tolist() == [[SLAB.address, 4096, 0]]


def test_slab_plan_refuses_more_rows_than_the_slab() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        plan_slab_read([0] * 5, 2, 4096, STORE, SLAB, 0, 9)


def row_by_row_plan(
    first_rows: list[int], num_layers: int, row_bytes: int, first: int, count: int
) -> list[tuple[int, int, int]]:
    """(slab address, holder address, length) per row, merged where both sides
    continue: the slab plan's reference."""
    pieces: list[list[int]] = []
    for i, row in enumerate(range(first, first + count)):
        key, layer = divmod(row, num_layers)
        remote = STORE.address + (first_rows[key] + layer) * row_bytes
        local = SLAB.address + i * row_bytes
        last = pieces[-1] if pieces else None
        if last and last[0] + last[2] == local and last[1] + last[2] == remote:
            last[2] += row_bytes
        else:
            pieces.append([local, remote, row_bytes])
    return [tuple(p) for p in pieces]  # type: ignore[misc]


@pytest.mark.parametrize("seed", range(4))
def test_slab_plan_matches_the_row_by_row_reference(seed: int) -> None:
    """Random chunks of random key orders, some stored back to back, some not."""
    rng = np.random.default_rng(seed)
    for _ in range(250):
        num_layers = int(rng.choice([1, 2, 3, 8]))
        slots = STORE.nbytes // (64 * num_layers)
        keys = int(rng.integers(1, 13))
        if rng.random() < 0.4:
            start = int(rng.integers(0, slots - keys))
            order = list(range(start, start + keys))
        else:
            order = [int(k) for k in rng.choice(slots, keys, replace=False)]
        first_rows = [k * num_layers for k in order]
        total = keys * num_layers
        first = int(rng.integers(0, total))
        count = int(rng.integers(1, total - first + 1))
        plan = plan_slab_read(first_rows, num_layers, 64, STORE, SLAB, first, count)
        expected = row_by_row_plan(first_rows, num_layers, 64, first, count)
        got = list(
            zip(
                plan.local[:, 0].tolist(),
                plan.remote[:, 0].tolist(),
                plan.local[:, 1].tolist(),
                strict=True,
            )
        )
        assert got == expected
        assert plan.nbytes == count * 64
        assert plan.remote[:, 1].tolist() == plan.local[:, 1].tolist()


@pytest.mark.parametrize("seed", range(4))
def test_row_index_plan_names_every_row_in_order(seed: int) -> None:
    """The prepared-list form of a slab read: slab row i <- the holder row of global
    row first + i, counted row by row here; descriptors are the merged runs."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(250):
        num_layers = int(rng.choice([1, 2, 3, 8]))
        keys = int(rng.integers(1, 13))
        if rng.random() < 0.4:
            start = int(rng.integers(0, 50))
            order = list(range(start, start + keys))
        else:
            order = [int(k) for k in rng.choice(200, keys, replace=False)]
        first_rows = [k * num_layers for k in order]
        total = keys * num_layers
        first = int(rng.integers(0, total))
        count = int(rng.integers(1, total - first + 1))
        plan = plan_slab_rows(first_rows, num_layers, 64, first, count, "s", "h")
        assert plan.rows is not None
        holder_rows = []
        for row in range(first, first + count):
            key, layer = divmod(row, num_layers)
            holder_rows.append(first_rows[key] + layer)
        assert plan.rows.remote.tolist() == holder_rows
        assert plan.rows.local.tolist() == list(range(count))
        steps = zip(holder_rows, holder_rows[1:], strict=False)
        runs = 1 + sum(b != a + 1 for a, b in steps)
        assert (
            plan.descriptors
            == len(row_by_row_plan(first_rows, num_layers, 64, first, count))
            == runs
        )
        assert plan.nbytes == count * 64
        assert (plan.rows.local_list, plan.rows.remote_list) == ("s", "h")


def engine_tensors(layout: str, num_blocks: int = 8) -> list[torch.Tensor]:
    flat = torch.zeros(2 * num_blocks * 2048, dtype=torch.bfloat16)
    per_layer = num_blocks * 2048
    layers = [flat[i * per_layer : (i + 1) * per_layer] for i in range(2)]
    if layout == "block_first":
        return [t.view(num_blocks, 2, 16, 2, 32) for t in layers]
    return [t.view(2, num_blocks, 16, 2, 32) for t in layers]


def test_engine_map_block_first_is_one_piece_per_block() -> None:
    layers = engine_tensors("block_first")
    engine = EngineBlockMap.from_layers(layers, 0, 4096)
    assert engine.segment_offsets == (0,)
    assert engine.segment_nbytes == 4096
    assert engine.block_stride == 4096
    assert engine.layer_bases == tuple(t.data_ptr() for t in layers)
    # both layers are views of one allocation: one region
    assert len(engine.regions) == 1


def test_engine_map_kv_first_is_two_pieces_per_block() -> None:
    """(2, blocks, ...): K of a block and its V are num_blocks * 2 KiB apart."""
    layers = engine_tensors("kv_first", num_blocks=8)
    engine = EngineBlockMap.from_layers(layers, 1, 4096)
    assert engine.segment_offsets == (0, 8 * 2048)
    assert engine.segment_nbytes == 2048
    assert engine.block_stride == 2048


def test_engine_map_refuses_a_wrong_row_size() -> None:
    with pytest.raises(ValueError, match="geometry says"):
        EngineBlockMap.from_layers(engine_tensors("block_first"), 0, 8192)


def test_engine_plan_addresses_every_piece_exactly() -> None:
    layers = engine_tensors("kv_first", num_blocks=8)
    engine = EngineBlockMap.from_layers(layers, 1, 4096)
    plan = plan_engine_read([4, 0], [5, 2], 2, 4096, STORE, engine)
    # 2 keys x 2 layers x (K, V), none adjacent on both sides
    assert plan.descriptors == 8
    assert plan.nbytes == 2 * 2 * 4096
    expected = []
    for row, block in ((4, 5), (0, 2)):
        for layer in range(2):
            for piece in range(2):
                remote = STORE.address + (row + layer) * 4096 + piece * 2048
                local = layers[layer].data_ptr() + block * 2048 + piece * 8 * 2048
                expected.append(([local, 2048, 0], [remote, 2048, 0]))
    assert list(zip(plan.local.tolist(), plan.remote.tolist(), strict=True)) == [
        (list(a), list(b)) for a, b in expected
    ]
    assert np.all(plan.local[:, 1] == plan.remote[:, 1])


def cross_layer_tensors(num_blocks: int = 8, num_layers: int = 2) -> list[torch.Tensor]:
    """Per-layer ``block_first`` views of one ``(blocks, layers, ...)`` allocation,
    as vLLM's cross-layer cache: a block of every layer is one contiguous range."""
    blocks = torch.zeros((num_blocks, num_layers, 2, 16, 2, 32), dtype=torch.bfloat16)
    return [blocks[:, layer] for layer in range(num_layers)]


def test_engine_map_is_whole_blocks_only_for_a_cross_layer_allocation() -> None:
    """Cross-layer: each block of all layers is one range, layer 0 first. Layers one
    after the other (per-layer or one flat allocation), K/V apart, or the
    cross-layer layers in another order than the store's rows: not."""
    cross = cross_layer_tensors()
    engine = EngineBlockMap.from_layers(cross, 0, 4096)
    assert engine.whole_blocks
    assert engine.block_stride == 2 * 4096
    assert not EngineBlockMap.from_layers(
        engine_tensors("block_first"), 0, 4096
    ).whole_blocks
    assert not EngineBlockMap.from_layers(
        engine_tensors("kv_first"), 1, 4096
    ).whole_blocks
    assert not EngineBlockMap.from_layers(cross[::-1], 0, 4096).whole_blocks
    separate = [torch.zeros(8, 2, 16, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
    assert not EngineBlockMap.from_layers(separate, 0, 4096).whole_blocks


def test_flash_attention_cross_layer_cache_is_whole_blocks_in_row_order() -> None:
    """vLLM 0.26's FlashAttention cross-layer cache: memory (blocks, layers, tokens,
    heads, K|V), each layer viewed in the packed logical shape (blocks, heads,
    tokens, K|V). Its layout is ``packed_kv_nhd``; through the cache's row-ordered
    layers a block of every layer is one range (a load READs straight into it),
    through the logical views it is 2 x tokens pieces per layer (it is not)."""
    blocks, layers, tokens, heads, packed = 8, 2, 16, 2, 64
    memory = torch.zeros((blocks, layers, tokens, heads, packed), dtype=torch.bfloat16)
    logical = [memory[:, layer].transpose(1, 2) for layer in range(layers)]
    layout = detect_layout(logical, blocks)
    assert layout.name == PACKED_KV_NHD_LAYOUT
    cache = BlockMajorCache(logical, layout)
    row_bytes = layout.layer_block_nbytes
    engine = EngineBlockMap.from_layers(cache.row_layers, 0, row_bytes)
    assert engine.whole_blocks and len(engine.segment_offsets) == 1
    assert not EngineBlockMap.from_layers(logical, 0, row_bytes).whole_blocks


def piece_by_piece_plan(
    first_rows: list[int], blocks: list[int], engine: EngineBlockMap, num_layers: int
) -> list[tuple[int, int, int]]:
    """(engine address, holder address, length) per piece of each (key, layer),
    merged where both sides continue: the engine plan's reference."""
    merged: list[list[int]] = []
    seg = engine.segment_nbytes
    for row, block in zip(first_rows, blocks, strict=True):
        for layer in range(num_layers):
            for piece, offset in enumerate(engine.segment_offsets):
                local = engine.layer_bases[layer] + block * engine.block_stride + offset
                remote = STORE.address + (row + layer) * 4096 + piece * seg
                last = merged[-1] if merged else None
                if last and last[0] + last[2] == local and last[1] + last[2] == remote:
                    last[2] += seg
                else:
                    merged.append([local, remote, seg])
    return [tuple(m) for m in merged]  # type: ignore[misc]


@pytest.mark.parametrize(
    "first_rows, blocks, runs",
    [
        ([0, 2, 4, 6], [3, 4, 5, 6], 1),  # both sides consecutive: one READ range
        ([0, 2, 4, 10], [3, 4, 5, 7], 2),  # a gap on both sides
        ([0, 2, 4, 6], [1, 3, 5, 7], 4),  # every other block
        ([0, 2, 4, 6], [7, 6, 5, 4], 4),  # reversed blocks
        ([8, 2], [0, 1], 2),  # holder rows out of order
    ],
)
def test_whole_block_plan_is_one_descriptor_per_run_of_keys(
    first_rows: list[int], blocks: list[int], runs: int
) -> None:
    engine = EngineBlockMap.from_layers(cross_layer_tensors(), 0, 4096)
    plan = plan_engine_read(first_rows, blocks, 2, 4096, STORE, engine)
    assert plan.descriptors == runs
    assert plan.nbytes == len(blocks) * 2 * 4096
    got = [
        (local[0], remote[0], local[1])
        for local, remote in zip(plan.local.tolist(), plan.remote.tolist(), strict=True)
    ]
    assert got == piece_by_piece_plan(first_rows, blocks, engine, 2)


@pytest.mark.parametrize("whole_blocks", [True, False])
@pytest.mark.parametrize(
    "blocks, error",
    [
        ([3, 4, 3], "duplicate destination blocks"),
        ([5, 3, 5], "duplicate destination blocks"),
        ([3, 8, 4], r"destination blocks \[8\] are out of range for 8"),
        ([-1, 3, 4], r"destination blocks \[-1\] are out of range"),
        ([3, 4], "2 destination blocks for 3 keys"),
    ],
)
def test_engine_plan_refuses_blocks_that_are_not_one_distinct_block_per_key(
    blocks: list[int], error: str, whole_blocks: bool
) -> None:
    layers = cross_layer_tensors() if whole_blocks else engine_tensors("kv_first")
    engine = EngineBlockMap.from_layers(layers, 0 if whole_blocks else 1, 4096)
    assert engine.num_blocks == 8
    with pytest.raises(ValueError, match=error):
        plan_engine_read([0, 2, 4], blocks, 2, 4096, STORE, engine)


def test_a_long_run_of_keys_is_one_descriptor_and_a_broken_one_is_not() -> None:
    """The common case (both sides consecutive) skips the per-key loop; a run that
    breaks on one side only, anywhere, must still split."""
    engine = EngineBlockMap.from_layers(cross_layer_tensors(num_blocks=80), 0, 4096)
    rows = [2 * i for i in range(64)]
    blocks = list(range(10, 74))
    plan = plan_engine_read(rows, blocks, 2, 4096, STORE, engine)
    assert plan.descriptors == 1
    assert plan.local.tolist() == [
        [blocks[0] * 2 * 4096 + engine.layer_bases[0], 64 * 2 * 4096, 0]
    ]
    for broken_rows, broken_blocks in (
        (rows[:40] + [r + 2 for r in rows[40:]], blocks),  # a holder gap at key 40
        (rows, blocks[:63] + [75]),  # the last block elsewhere
    ):
        plan = plan_engine_read(broken_rows, broken_blocks, 2, 4096, STORE, engine)
        assert plan.descriptors == 2
        got = [
            (local[0], remote[0], local[1])
            for local, remote in zip(
                plan.local.tolist(), plan.remote.tolist(), strict=True
            )
        ]
        assert got == piece_by_piece_plan(broken_rows, broken_blocks, engine, 2)


def vram_path(**changes: Any) -> PeerPath:
    fields = dict(
        peer="holder",
        local_mem_type="VRAM",
        remote_mem_type="VRAM",
        nbytes=4096,
        seconds=1e-4,
        zero_copy_only=True,
        peer_host="here",
        same_host=True,
        transports=("cuda_copy", "cuda_ipc", "tcp"),
    )
    fields.update(changes)
    return PeerPath(**fields)  # type: ignore[arg-type]


def test_only_vram_reads_over_cuda_ipc_are_bounded() -> None:
    """Engine placement needs a READ that cannot land after its deadline: VRAM to
    VRAM on one host, emulation off, cuda_ipc there. Anything else keeps the slab."""
    assert engine_reads_are_bounded(vram_path())
    assert not engine_reads_are_bounded(None)  # the peer was never checked
    assert not engine_reads_are_bounded(
        vram_path(local_mem_type="DRAM", remote_mem_type="DRAM")
    )
    assert not engine_reads_are_bounded(vram_path(remote_mem_type="DRAM"))
    assert not engine_reads_are_bounded(vram_path(zero_copy_only=False))
    assert not engine_reads_are_bounded(vram_path(transports=("cuda_copy", "tcp")))
    assert not engine_reads_are_bounded(vram_path(same_host=False))


# ---- real agents in two processes ---------------------------------------------------


@pytest.mark.nixl
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", [PLACEMENT_SLAB, PLACEMENT_ENGINE])
async def test_every_bf16_bit_pattern_arrives_exactly(
    device: str, placement: str
) -> None:
    """All 65,536 BF16 patterns (NaNs, infinities, subnormals, -0) in 16 snapshots,
    read in one load, arrive bit for bit: into the slab and scatter, or straight
    into engine blocks."""
    patterns = all_bf16_patterns().view(torch.uint8).numpy().tobytes()
    assert len(patterns) == 16 * GEOMETRY.block_nbytes
    spec = PeerSpec(
        "nixl",
        GEOMETRY,
        device=device,
        num_slots=16,
        placement=placement,
        engine_layout="block_first",
        engine_blocks=32,
    )
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, patterns)
        slots = list(range(16))
        dst_blocks = [31 - s for s in slots]  # reversed, so nothing lines up by chance
        await loader.load(holder_address, slots, dst_blocks=dst_blocks)
        if placement == PLACEMENT_SLAB:
            got = await loader.read_dest(0, 16 * GEOMETRY.num_layers)
        else:
            got = b"".join([await loader.read_engine_block(b) for b in dst_blocks])
        assert got == patterns
        counters = await loader.counters()
        assert counters["engine_placed_loads"] == (placement == PLACEMENT_ENGINE)


@pytest.mark.nixl
@pytest.mark.parametrize("device", DEVICES)
async def test_wire_bytes_equal_useful_bytes(device: str) -> None:
    """Loads of 1, 3 and 7 snapshots from scattered holder slots: every READ moves
    exactly the payload, in one descriptor per contiguous run of holder rows."""
    data = random_bytes(16 * GEOMETRY.block_nbytes, seed=3)
    spec = PeerSpec("nixl", GEOMETRY, device=device, num_slots=16)
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        expected_descriptors = 0
        for batch, runs in (([5], 1), ([1, 2, 3], 1), ([9, 10, 0, 1, 2, 14, 3], 4)):
            before = await loader.counters()
            await loader.load(holder_address, batch, dst_slots=list(range(len(batch))))
            after = await loader.counters()
            useful = len(batch) * GEOMETRY.block_nbytes
            assert (
                after["received_useful_bytes"] - before["received_useful_bytes"]
                == useful
            )
            assert (
                after["received_wire_bytes"] - before["received_wire_bytes"] == useful
            )
            assert after["descriptors"] - before["descriptors"] == runs
            expected_descriptors += runs
            for i, slot in enumerate(batch):
                got = await loader.read_dest(
                    i * GEOMETRY.num_layers, GEOMETRY.num_layers
                )
                assert got == rows_of(data, slot)
        assert (await loader.counters())["descriptors"] == expected_descriptors


@pytest.mark.nixl
@pytest.mark.parametrize("device", DEVICES)
async def test_slab_reads_by_prepared_rows_equal_reads_by_descriptors(
    device: str,
) -> None:
    """With the row lists enabled, reads into the slab go through the row lists
    prepared when the peer was met; without, the same loads carry descriptors.
    Both bring every byte, in as many descriptors."""
    data = random_bytes(16 * GEOMETRY.block_nbytes, seed=21)
    spec = PeerSpec("nixl", GEOMETRY, device=device, num_slots=16)
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        batches = ([7], [3, 4, 5], [15, 0, 1, 9, 10, 11, 2])
        descriptors: dict[bool, int] = {}
        await loader.use_row_lists(True)
        for prepared in (True, False):
            before = (await loader.counters())["descriptors"]
            for batch in batches:
                await loader.clear_dest()
                await loader.load(
                    holder_address, batch, dst_slots=list(range(len(batch)))
                )
                got = await loader.read_dest(0, len(batch) * GEOMETRY.num_layers)
                assert got == b"".join(rows_of(data, slot) for slot in batch)
            descriptors[prepared] = (await loader.counters())["descriptors"] - before
            # the holder was met on the first load: its row list exists from then
            assert len(await loader.use_row_lists(not prepared)) == 1
        assert descriptors[True] == descriptors[False] == 1 + 1 + 4


@pytest.mark.nixl
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", [PLACEMENT_SLAB, PLACEMENT_ENGINE])
async def test_no_registration_after_warm_up(device: str, placement: str) -> None:
    """After the first load, loads of every size register no memory in either process
    and load the holder's metadata no more (counted inside both processes by wrapping
    nixl_agent.register_memory)."""
    data = random_bytes(64 * GEOMETRY.block_nbytes, seed=5)
    spec = PeerSpec(
        "nixl",
        GEOMETRY,
        device=device,
        num_slots=64,
        placement=placement,
        engine_layout="block_first",
        engine_blocks=64,
    )
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        await loader.load(holder_address, [0], dst_blocks=[0])  # warm-up
        holder_calls = await holder.registration_calls()
        loader_calls = await loader.registration_calls()
        assert loader_calls >= 2  # store rows and slab (and the engine cache)
        for n in (1, 16, 64, 1, 64, 16, 1):
            slots = list(range(64 - n, 64))
            await loader.load(holder_address, slots, dst_blocks=list(range(n)))
        assert await holder.registration_calls() == holder_calls
        assert await loader.registration_calls() == loader_calls
        counters = await loader.counters()
        assert counters["registration_changes"] == 0
        assert counters["peer_metadata_loads"] == 1
        assert counters["transfer_failures"] == counters["transfer_timeouts"] == 0


@pytest.mark.nixl
async def test_kv_first_engine_layout_reads_two_pieces_per_block_layer() -> None:
    """A (2, blocks, ...) engine cache: K and V of a block are far apart, so each
    (block, layer) is two descriptors, and each lands where layout.py reads it."""
    data = random_bytes(8 * GEOMETRY.block_nbytes, seed=7)
    spec = PeerSpec(
        "nixl",
        GEOMETRY,
        num_slots=8,
        placement=PLACEMENT_ENGINE,
        engine_layout="kv_first",
        engine_blocks=16,
    )
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        slots, blocks = [2, 7, 3], [9, 0, 15]
        await loader.load(holder_address, slots, dst_blocks=blocks)
        for slot, block in zip(slots, blocks, strict=True):
            assert await loader.read_engine_block(block) == rows_of(data, slot)
        # untouched blocks stay zero
        assert await loader.read_engine_block(1) == bytes(GEOMETRY.block_nbytes)
        counters = await loader.counters()
        assert counters["descriptors"] == len(slots) * GEOMETRY.num_layers * 2
        assert counters["received_wire_bytes"] == len(slots) * GEOMETRY.block_nbytes


@pytest.mark.nixl
async def test_engine_placement_without_destination_blocks_uses_the_slab() -> None:
    """A caller that gives no destination blocks gets the scatter path: the rows
    arrive through the slab and scatter, still in one exact-size READ."""
    data = random_bytes(4 * GEOMETRY.block_nbytes, seed=17)
    spec = PeerSpec(
        "nixl",
        GEOMETRY,
        num_slots=4,
        placement=PLACEMENT_ENGINE,
        engine_layout="block_first",
        engine_blocks=8,
    )
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        await loader.load(holder_address, [3, 1])
        assert await loader.read_dest(6, 2) == rows_of(data, 3)
        assert await loader.read_dest(2, 2) == rows_of(data, 1)
        counters = await loader.counters()
        assert counters["engine_placed_loads"] == 0
        assert counters["received_wire_bytes"] == 2 * GEOMETRY.block_nbytes


@pytest.mark.nixl
@pytest.mark.parametrize(
    "slots, blocks, runs",
    [
        ([4, 5, 6, 7], [8, 9, 10, 11], 1),  # consecutive on both sides
        ([4, 5, 6, 7], [8, 10, 12, 14], 4),  # every other block
        ([0, 1, 9, 10], [15, 0, 6, 7], 3),  # mixed
    ],
)
async def test_auto_placement_reads_straight_into_cross_layer_blocks(
    slots: list[int], blocks: list[int], runs: int
) -> None:
    """A cross-layer engine cache and a peer whose READs are bounded: the load is
    one READ into the engine blocks, one descriptor per run of keys that continue
    each other on both sides, no scatter; every byte lands in its block and no
    other block changes."""
    data = random_bytes(16 * GEOMETRY.block_nbytes, seed=23)
    spec = PeerSpec(
        "nixl",
        GEOMETRY,
        num_slots=16,
        placement=PLACEMENT_AUTO,
        engine_layout="cross_layer",
        engine_blocks=16,
        trust_engine_reads=True,
    )
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        await loader.load(holder_address, [3], dst_blocks=[3])  # meet the holder
        await loader.clear_dest()
        placement = await loader.placement()
        assert placement["engine_registered"]
        assert list(placement["places_in_engine"].values()) == [True]
        await loader.take_scatter_calls()
        before = await loader.counters()
        await loader.load(holder_address, slots, dst_blocks=blocks)
        after = await loader.counters()
        assert await loader.take_scatter_calls() == []
        assert after["engine_placed_loads"] - before["engine_placed_loads"] == 1
        assert after["descriptors"] - before["descriptors"] == runs
        assert after["received_wire_bytes"] - before["received_wire_bytes"] == (
            len(slots) * GEOMETRY.block_nbytes
        )
        for block in range(16):
            got = await loader.read_engine_block(block)
            if block in blocks:
                assert got == rows_of(data, slots[blocks.index(block)]), block
            else:
                assert got == bytes(GEOMETRY.block_nbytes), block


@pytest.mark.nixl
@pytest.mark.parametrize(
    "engine_layout, trusted", [("block_first", True), ("cross_layer", False)]
)
async def test_auto_placement_keeps_the_slab_unless_cheap_and_safe(
    engine_layout: str, trusted: bool
) -> None:
    """Per-layer blocks (a piece per layer), or DRAM reads (which may outlive their
    deadline over tcp): the load goes through the slab and the scatter."""
    data = random_bytes(4 * GEOMETRY.block_nbytes, seed=29)
    spec = PeerSpec(
        "nixl",
        GEOMETRY,
        num_slots=4,
        placement=PLACEMENT_AUTO,
        engine_layout=engine_layout,
        engine_blocks=8,
        trust_engine_reads=trusted,
    )
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        await loader.load(holder_address, [3, 1], dst_blocks=[5, 2], dst_slots=[0, 1])
        assert await loader.read_dest(0, 2) == rows_of(data, 3)
        assert await loader.read_dest(2, 2) == rows_of(data, 1)
        assert await loader.take_scatter_calls() == [(0, 4)]
        assert await loader.read_engine_block(5) == bytes(GEOMETRY.block_nbytes)
        counters = await loader.counters()
        assert counters["engine_placed_loads"] == 0
        placement = await loader.placement()
        # per-layer blocks are not even registered
        assert placement["engine_registered"] == (engine_layout == "cross_layer")
        assert list(placement["places_in_engine"].values()) == [False]


@pytest.mark.nixl
@pytest.mark.parametrize("engine_layout", ["cross_layer", "block_first"])
@pytest.mark.parametrize("device", DEVICES)
async def test_the_serving_transport_registers_only_whole_engine_blocks(
    engine_layout: str, device: str
) -> None:
    """``create`` (what the transfer actor calls) uses auto placement: on a GPU it
    registers a cross-layer engine cache and not a per-layer one, and a load into
    cross-layer blocks from a peer on this GPU (cuda_ipc) is one READ into them;
    on CPU (DRAM) nothing is registered and every load goes through the slab."""
    data = random_bytes(2 * GEOMETRY.block_nbytes, seed=31)
    spec = PeerSpec(
        "nixl",
        GEOMETRY,
        num_slots=2,
        engine_layout=engine_layout,
        engine_blocks=4,
        serving=True,
        device=device,
    )
    in_engine = device == "cuda" and engine_layout == "cross_layer"
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        await loader.load(holder_address, [0, 1], dst_blocks=[1, 2])
        if in_engine:
            assert await loader.read_engine_block(1) == rows_of(data, 0)
            assert await loader.read_engine_block(2) == rows_of(data, 1)
            assert await loader.take_scatter_calls() == []
        else:
            assert await loader.read_dest(0, 4) == data
        placement = await loader.placement()
        assert placement["placement"] == PLACEMENT_AUTO
        assert placement["engine_registered"] == in_engine
        assert list(placement["places_in_engine"].values()) == [in_engine]
        assert (await loader.counters())["engine_placed_loads"] == in_engine


@pytest.mark.nixl
async def test_metadata_is_loaded_again_only_after_the_holder_re_registers() -> None:
    """The loader keeps the holder's metadata across loads; when the holder moves its
    device tier (a new registration, a new generation), the next load fetches the
    new metadata once and reads the new memory."""
    data = random_bytes(4 * GEOMETRY.block_nbytes, seed=11)
    spec = PeerSpec("nixl", GEOMETRY, num_slots=4)
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        for _ in range(3):
            await loader.load(holder_address, [0, 1])
        assert (await loader.counters())["peer_metadata_loads"] == 1
        await holder.replace_store()
        await holder.write_source(0, data[::-1])  # only the new memory has these
        await loader.load(holder_address, [2, 3])
        await loader.load(holder_address, [0])
        counters = await loader.counters()
        assert counters["peer_metadata_loads"] == 2
        reversed_data = data[::-1]
        assert await loader.read_dest(2 * 2, 4) == reversed_data[2 * 8192 : 4 * 8192]
        assert await loader.read_dest(0, 2) == reversed_data[:8192]


@pytest.mark.nixl
async def test_startup_reports_the_ucx_transports() -> None:
    """The endpoint lists UCX's resources; here shared-memory transports are among
    them, so this is not a TCP fallback."""
    spec = PeerSpec("nixl", GEOMETRY)
    async with transport_pair(spec) as (holder, _, _):
        report = await holder.ucx_report()
        assert report["probe_error"] is None
        assert "tcp" in report["transports"]
        assert report["tcp_only"] is False
        assert "UCX 1." in report["text"]


@pytest.mark.nixl
async def test_a_tcp_only_ucx_is_reported_as_such() -> None:
    """With UCX_TLS=tcp the report says so: the fallback is visible at start."""
    spec = PeerSpec("nixl", GEOMETRY)
    envs = [{"UCX_TLS": "tcp"}, {"UCX_TLS": "tcp"}]
    async with transport_pair(spec, envs=envs) as (holder, _, _):
        report = await holder.ucx_report()
        assert report["env"]["UCX_TLS"] == "tcp"
        assert set(report["transports"]) == {"tcp"}
        assert report["tcp_only"] is True


@pytest.mark.nixl
async def test_meeting_a_peer_reads_one_row_from_it_once() -> None:
    """The first load from a holder starts with one READ of a row (the path check):
    its outcome is kept per peer, and later loads do not repeat it."""
    data = random_bytes(2 * GEOMETRY.block_nbytes, seed=17)
    spec = PeerSpec("nixl", GEOMETRY, num_slots=2)
    async with transport_pair(spec) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        await loader.load(holder_address, [0])
        await loader.load(holder_address, [1])
        paths = await loader.peer_paths()
        assert len(paths) == 1
        (path,) = paths.values()
        assert path["local_mem_type"] == path["remote_mem_type"] == "DRAM"
        assert path["nbytes"] == GEOMETRY.layer_block_nbytes
        assert path["zero_copy_only"] is False  # UCX's defaults on DRAM
        # the path names the peer's host and the UCX transports that can join the
        # two: both run here, so one-host ones (shared memory) are among them
        assert path["same_host"] is True
        assert path["peer_host"] == socket.gethostname()
        offered = set((await loader.ucx_report())["transports"]) - {"self"}
        assert path["transports"] and set(path["transports"]) == offered
        counters = await loader.counters()
        assert counters["peer_metadata_loads"] == 1
        assert counters["descriptors"] == 2  # the two loads, not the check
        assert await loader.read_dest(0, 4) == data


@pytest.mark.nixl
async def test_without_emulation_a_tcp_only_read_fails_at_the_peer_check() -> None:
    """UCX_PROTO_EMULATION_ENABLE=n (what a VRAM endpoint sets) with UCX_TLS=tcp:
    UCX has no zero-copy READ over TCP here, so the first load fails at the peer
    check, fast, with a message that names the cause (NIXL itself reports a remote
    disconnect). The next load checks again rather than trusting the peer."""
    spec = PeerSpec("nixl", GEOMETRY, num_slots=2, transfer_timeout_s=10.0)
    env = {"UCX_TLS": "tcp", "UCX_PROTO_EMULATION_ENABLE": "n"}
    async with transport_pair(spec, envs=[env, env]) as (_, loader, holder_address):
        for attempt in (1, 2):
            started = time.monotonic()
            with pytest.raises(NixlTransferError) as failure:
                await loader.load(holder_address, [0])
            assert time.monotonic() - started < 5.0
            message = str(failure.value)
            assert "the first READ from peer" in message
            assert "DRAM->DRAM" in message
            assert "UCX_PROTO_EMULATION_ENABLE=y" in message
            assert (await loader.peer_paths()) == {}
            counters = await loader.counters()
            assert counters["transfer_failures"] == attempt
            assert counters["descriptors"] == 0


def test_ucx_settings_fill_in_only_what_the_environment_leaves_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_PROTO_EMULATION_ENABLE", "y")
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    settings = (
        ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on"),
        ("UCX_PROTO_EMULATION_ENABLE", "n"),
    )
    with ucx_settings(settings) as applied:
        assert applied == (("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on"),)
        assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
        assert os.environ["UCX_PROTO_EMULATION_ENABLE"] == "y"
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ
    assert os.environ["UCX_PROTO_EMULATION_ENABLE"] == "y"


def _thread_cpu_seconds(tids: set[str]) -> float:
    """CPU time (user + system) that threads ``tids`` of this process have used."""
    ticks = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread has ended
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.nixl
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
async def test_an_idle_endpoint_does_not_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL's Python agent would poll UCX without pause (a core at 100% per agent,
    busy or idle); ours waits up to PROGRESS_THREAD_DELAY_US between polls. Counted
    over the threads the endpoint started, so other agents in this process (from
    other tests) do not count."""
    monkeypatch.delenv(PROGRESS_THREAD_DELAY_ENV, raising=False)
    before = set(os.listdir("/proc/self/task"))
    endpoint = await NixlAgentEndpoint.create(
        "idle",
        row_bytes=GEOMETRY.layer_block_nbytes,
        store_rows=torch.zeros(4, GEOMETRY.layer_block_nbytes, dtype=torch.uint8),
        slab_bytes=4 * GEOMETRY.layer_block_nbytes,
    )
    try:
        assert endpoint.progress_delay_us == PROGRESS_THREAD_DELAY_US > 0
        await asyncio.sleep(0.2)  # past the agent's start
        started = set(os.listdir("/proc/self/task")) - before
        assert started, "the agent started no thread"
        wall, cpu = time.monotonic(), _thread_cpu_seconds(started)
        await asyncio.sleep(1.0)
        busy = (_thread_cpu_seconds(started) - cpu) / (time.monotonic() - wall)
    finally:
        await endpoint.close()
    # A spinning progress thread makes this about 1.0 (a whole core).
    assert busy < 0.3


@pytest.mark.nixl
def test_the_delay_patch_is_undone_and_skipped_where_nixl_differs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import nixl._api as api

    base = api.nixlBind.nixlAgentConfig
    with _progress_thread_delay(api, 250):
        config = api.nixlBind.nixlAgentConfig()
        config.pthrDelay = 0  # what nixl_agent assigns
        assert config.pthrDelay == 250
    assert api.nixlBind.nixlAgentConfig is base
    assert base().pthrDelay == 0
    # A NIXL whose bindings lack the field: agents start with its default.
    other = SimpleNamespace(nixlBind=SimpleNamespace(nixlAgentConfig=object))
    with _progress_thread_delay(other, 250):
        assert other.nixlBind.nixlAgentConfig is object
    assert "cannot set the NIXL progress thread delay" in caplog.text


@pytest.mark.parametrize("value", ["-1", "1ms", ""])
def test_a_bad_progress_delay_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(PROGRESS_THREAD_DELAY_ENV, value)
    with pytest.raises(ValueError, match=PROGRESS_THREAD_DELAY_ENV):
        progress_thread_delay_us()
    monkeypatch.setenv(PROGRESS_THREAD_DELAY_ENV, "250")
    assert progress_thread_delay_us() == 250


@pytest.mark.nixl
@pytest.mark.cuda
@CUDA_SKIP
async def test_a_vram_endpoint_reads_zero_copy_from_its_peers() -> None:
    """On VRAM the agent is created with cuda_ipc get zero-copy on and emulation
    off (the process environment is left as it was), so the peer check's success
    means a zero-copy READ."""
    spec = PeerSpec("nixl", GEOMETRY, num_slots=2, device="cuda")
    async with transport_pair(spec) as (_, loader, holder_address):
        report = await loader.ucx_report()
        assert report["env"]["UCX_PROTO_EMULATION_ENABLE"] == "n"
        assert report["env"]["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
        assert "UCX_PROTO_EMULATION_ENABLE" not in await loader.environment()
        await loader.load(holder_address, [0, 1])
        (path,) = (await loader.peer_paths()).values()
        assert path["local_mem_type"] == path["remote_mem_type"] == "VRAM"
        assert path["zero_copy_only"] is True


# ---- peers that die or stall --------------------------------------------------------

# Over TCP a READ needs the holder's progress thread: it can stall, and it is slow
# enough (tens of MB/s on this machine) that a kill lands mid-transfer.
TCP_ENVS = [{"UCX_TLS": "tcp"}, {"UCX_TLS": "tcp"}]
# 64 snapshots of 2 x 256 KiB: a 32 MiB load, one slab of 64 blocks
BIG = KVGeometry(num_layers=2, layer_block_nbytes=256 * KiB, logical_dtype="bfloat16")


@pytest.mark.nixl
@pytest.mark.slow
async def test_a_holder_killed_mid_load_fails_the_load_within_the_deadline() -> None:
    """The holder process dies while a 64 MiB READ from it is in flight: the load
    fails with a NixlTransferError well within its deadline, instead of hanging."""
    deadline_s = 10.0
    spec = PeerSpec("nixl", BIG, num_slots=128, transfer_timeout_s=deadline_s)
    async with transport_pair(spec, envs=TCP_ENVS) as (holder, loader, holder_address):
        await loader.load(holder_address, [0])  # connected, metadata loaded
        slots = list(range(128))
        # Located beforehand, so the load goes straight to the READ.
        source = await loader.fetch_source(holder_address, slots)
        pid = await holder.pid()
        load = asyncio.ensure_future(loader.load(holder_address, slots, source=source))
        # Over tcp on loopback 64 MiB took about 60 ms on the CPU machine.
        await asyncio.sleep(0.005)
        assert not load.done(), "the READ ended before the kill; make it larger"
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        failure = await _error_of(load, deadline_s + 10)
        if failure is None:
            # Over TCP the holder may have handed every byte to the kernel before
            # the kill landed, and the READ then completes. A load from the dead
            # holder must still fail, not hang.
            started = time.monotonic()
            failure = await _error_of(
                loader.load(holder_address, slots, source=source), deadline_s + 10
            )
        elapsed = time.monotonic() - started
        assert isinstance(failure, NixlTransferError), repr(failure)
        assert elapsed < deadline_s, f"the failure took {elapsed:.1f} s"
        assert "rank 0" in str(failure)
        counters = await loader.counters()
        assert counters["transfer_failures"] == 1
        assert counters["transfer_timeouts"] == 0


@pytest.mark.nixl
@pytest.mark.slow
async def test_a_holder_killed_mid_engine_placed_load_fails_the_load() -> None:
    """As above, with the READ going straight into cross-layer engine blocks: the
    load fails with a NixlTransferError (counted), not a hang or a success."""
    deadline_s = 10.0
    spec = PeerSpec(
        "nixl",
        BIG,
        num_slots=128,
        transfer_timeout_s=deadline_s,
        placement=PLACEMENT_AUTO,
        engine_layout="cross_layer",
        engine_blocks=128,
        trust_engine_reads=True,
    )
    async with transport_pair(spec, envs=TCP_ENVS) as (holder, loader, holder_address):
        await loader.load(holder_address, [0], dst_blocks=[0])
        slots = list(range(128))
        source = await loader.fetch_source(holder_address, slots)
        pid = await holder.pid()
        load = asyncio.ensure_future(
            loader.load(holder_address, slots, source=source, dst_blocks=slots)
        )
        await asyncio.sleep(0.005)
        assert not load.done(), "the READ ended before the kill; make it larger"
        os.kill(pid, signal.SIGKILL)
        failure = await _error_of(load, deadline_s + 10)
        placed = 1 if failure is not None else 2
        if failure is None:  # every byte had left the holder before the kill
            failure = await _error_of(
                loader.load(holder_address, slots, source=source, dst_blocks=slots),
                deadline_s + 10,
            )
        assert isinstance(failure, NixlTransferError), repr(failure)
        counters = await loader.counters()
        assert counters["transfer_failures"] == 1
        assert counters["engine_placed_loads"] == placed  # the failed one not


async def _error_of(call: Any, timeout_s: float) -> BaseException | None:
    """The exception ``call`` ends with (None if it succeeds), within ``timeout_s``."""
    try:
        await asyncio.wait_for(call, timeout_s)
    except Exception as exc:  # the outcome under test
        return exc
    return None


@pytest.mark.nixl
@pytest.mark.slow
async def test_a_stalled_holder_times_out_and_retires_the_slab() -> None:
    """A holder that stops (SIGSTOP) never serves the READ: the load fails at its
    deadline; further loads from it are refused at once while that READ is pending;
    the receive slab it may still write is retired (one new registration). Once the
    holder resumes, the READ ends and loads from it work again."""
    deadline_s = 1.5
    data = random_bytes(4 * GEOMETRY.block_nbytes, seed=13)
    spec = PeerSpec("nixl", GEOMETRY, num_slots=4, transfer_timeout_s=deadline_s)
    async with transport_pair(spec, envs=TCP_ENVS) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        await loader.load(holder_address, [0])
        source = await loader.fetch_source(holder_address, [1, 2])
        pid = await holder.pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until_stopped(pid)
            started = time.monotonic()
            with pytest.raises(NixlTransferTimeout, match="did not complete"):
                await asyncio.wait_for(
                    loader.load(holder_address, [1, 2], source=source), deadline_s + 10
                )
            elapsed = time.monotonic() - started
            assert deadline_s <= elapsed < deadline_s + 1.0
            assert await loader.pending_orphans() == 1

            started = time.monotonic()
            with pytest.raises(NixlTransferError, match="refusing further loads"):
                await asyncio.wait_for(
                    loader.load(holder_address, [1, 2], source=source), 10
                )
            assert time.monotonic() - started < 0.5
        finally:
            os.kill(pid, signal.SIGCONT)
        # The stalled READ ends once the holder runs again (into the retired slab).
        for _ in range(200):
            if await loader.pending_orphans() == 0:
                break
            await asyncio.sleep(0.05)
        assert await loader.pending_orphans() == 0
        await loader.clear_dest()
        await loader.load(holder_address, [1, 2])
        assert await loader.read_dest(2, 4) == data[8192 : 3 * 8192]
        counters = await loader.counters()
        assert counters["transfer_timeouts"] == 1
        assert counters["registration_changes"] == 1  # the fresh slab


@pytest.mark.nixl
@pytest.mark.slow
async def test_an_engine_read_past_its_deadline_sends_that_peer_to_the_slab() -> None:
    """Auto placement trusted a peer's READs to end within their deadline and one
    did not (a stopped holder over tcp): the load fails with the engine blocks at
    risk, and once the holder runs again its loads go through the slab."""
    deadline_s = 1.5
    data = random_bytes(4 * GEOMETRY.block_nbytes, seed=37)
    spec = PeerSpec(
        "nixl",
        GEOMETRY,
        num_slots=4,
        transfer_timeout_s=deadline_s,
        placement=PLACEMENT_AUTO,
        engine_layout="cross_layer",
        engine_blocks=8,
        trust_engine_reads=True,
    )
    async with transport_pair(spec, envs=TCP_ENVS) as (holder, loader, holder_address):
        await holder.write_source(0, data)
        await loader.load(holder_address, [0], dst_blocks=[0])
        assert (await loader.counters())["engine_placed_loads"] == 1
        source = await loader.fetch_source(holder_address, [1, 2])
        pid = await holder.pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until_stopped(pid)
            failure = await _error_of(
                loader.load(holder_address, [1, 2], source=source, dst_blocks=[1, 2]),
                deadline_s + 10,
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        assert isinstance(failure, NixlTransferTimeout), repr(failure)
        assert failure.destination_at_risk
        for _ in range(200):
            if await loader.pending_orphans() == 0:
                break
            await asyncio.sleep(0.05)
        assert list((await loader.placement())["places_in_engine"].values()) == [False]
        await loader.take_scatter_calls()
        await loader.load(holder_address, [1, 2], dst_blocks=[3, 4], dst_slots=[1, 2])
        assert await loader.take_scatter_calls() == [(0, 4)]
        assert await loader.read_dest(2, 4) == data[8192 : 3 * 8192]
        assert (await loader.counters())["engine_placed_loads"] == 1
