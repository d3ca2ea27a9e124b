"""GPUTransfer over real xoscar pools: two sub-pools on ``nixl://`` addresses are two
processes, and ``copy_to`` between them is a real NIXL WRITE (DRAM on CPU tensors,
VRAM on CUDA tensors). The actors live in ``transports/peers.py``.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import xoscar as xo
from xoscar.core import BufferRef

from xinference.model.llm.vllm.xavier.transports.xoscar.gpu_transfer import (
    GPUTransfer,
    LogicalDtypeMismatch,
    PushRequest,
    check_logical_dtype,
    chunk_row_index,
    full_slab_bytes,
    small_view_bytes,
)
from xinference.model.llm.vllm.xavier.wire import KVGeometry

from ..peers import slot_key, transfer_pair

KiB = 1024
MiB = 1024 * KiB
# Qwen2.5-0.5B in BF16: 24 layers; a layer's block is K and V of 2 KV heads x 16
# tokens x head dim 64 x 2 bytes = 8 KiB; a snapshot 192 KiB.
QWEN = KVGeometry(num_layers=24, layer_block_nbytes=8 * KiB, logical_dtype="bfloat16")
# One row per key, so a batch of n keys is exactly n x 8 KiB: 31, 32 and 33 keys sit
# below, at and above the 256 KiB view (slab: 64 x 8 KiB = 512 KiB).
ONE_LAYER = KVGeometry(num_layers=1, layer_block_nbytes=8 * KiB, logical_dtype="int8")

CUDA_AVAILABLE = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not CUDA_AVAILABLE, reason="needs a CUDA device (torch sees none)"
            ),
        ],
    ),
]


def random_bytes(nbytes: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return data.numpy().tobytes()


@pytest.fixture
async def local_pool():
    """A pool in this process: enough context for xo.buffer_ref, no peer."""
    pool = await xo.create_actor_pool(
        "127.0.0.1", n_process=0, external_address_schemes=["nixl"]
    )
    async with pool:
        yield pool.external_address


# ---- sizes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "geometry, full, view",
    [
        (QWEN, 12 * MiB, 256 * KiB),
        # 64 snapshots of 2 KiB = 128 KiB: slab and view below 256 KiB, one view
        (KVGeometry(2, KiB, "bfloat16"), 128 * KiB, 128 * KiB),
        # exactly 256 KiB: one view
        (KVGeometry(4, KiB, "bfloat16"), 256 * KiB, 256 * KiB),
        # just above
        (KVGeometry(4, KiB + 16, "bfloat16"), 64 * 4 * (KiB + 16), 256 * KiB),
        # 64 snapshots of 512 KiB would be 32 MiB: capped at 16 MiB
        (KVGeometry(64, 8 * KiB, "bfloat16"), 16 * MiB, 256 * KiB),
        # one layer's block above 16 MiB still fits the slab
        (KVGeometry(1, 20 * MiB, "bfloat16"), 20 * MiB, 256 * KiB),
    ],
)
def test_slab_sizes(geometry, full, view):
    assert full_slab_bytes(geometry) == full
    assert small_view_bytes(full) == view


# ---- the real constructor ---------------------------------------------------------


@pytest.mark.parametrize(
    "geometry",
    [QWEN, KVGeometry(2, KiB, "bfloat16"), KVGeometry(4, KiB, "bfloat16"), ONE_LAYER],
    ids=["qwen-12MiB", "below-256KiB", "at-256KiB", "one-layer-512KiB"],
)
async def test_constructor_builds_prefix_views_with_one_ref_each(local_pool, geometry):
    gt = GPUTransfer(local_pool, "cpu", geometry)
    full, view = full_slab_bytes(geometry), small_view_bytes(full_slab_bytes(geometry))
    assert (gt.full_bytes, gt.small_bytes) == (full, view)
    assert gt.rows_per_copy == full // geometry.layer_block_nbytes
    sizes = {full, view}
    assert gt.view_sizes == tuple(sorted(sizes))
    for views in (gt.send_views, gt.recv_views):
        assert set(views) == sizes
        slab = views[full]
        assert slab.dtype == torch.uint8 and slab.numel() == full
        assert slab.is_contiguous()
        for size, v in views.items():
            # a prefix of the same allocation: offset 0, same data pointer
            assert v.numel() == size
            assert v.data_ptr() == slab.data_ptr()
            assert v.untyped_storage().data_ptr() == slab.untyped_storage().data_ptr()
    # send and receive slabs are separate memory
    assert gt.send_views[full].data_ptr() != gt.recv_views[full].data_ptr()
    # exactly one ref per receive view, resolving to that very view object
    assert set(gt.recv_refs) == sizes
    for size, ref in gt.recv_refs.items():
        assert ref.address == local_pool
        assert BufferRef.get_buffer(ref) is gt.recv_views[size]
    assert len({ref.uid for ref in gt.recv_refs.values()}) == len(sizes)
    assert isinstance(gt.send_lock, asyncio.Lock)
    assert isinstance(gt.recv_lock, asyncio.Lock)
    assert gt.send_lock is not gt.recv_lock


async def test_views_share_memory(local_pool):
    gt = GPUTransfer(local_pool, "cpu", QWEN)
    gt.recv_views[gt.full_bytes][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert gt.recv_views[gt.small_bytes][:4].tolist() == [1, 2, 3, 4]


async def test_constructor_rejects_a_bad_timeout(local_pool):
    with pytest.raises(ValueError, match="copy_timeout_s"):
        GPUTransfer(local_pool, "cpu", QWEN, copy_timeout_s=0)


# ---- bad input, refused before any device work or copy ----------------------------


def push_request(gt: GPUTransfer, num_rows: int, wire_bytes: int, **overrides):
    fields = dict(
        lease_id="lease",
        keys=(slot_key(0), slot_key(1)),
        first_row=0,
        num_rows=num_rows,
        wire_bytes=wire_bytes,
        # a ref nobody serves: any attempt to copy would fail loudly
        dest=BufferRef("nixl://127.0.0.1:9", b"nobody"),
    )
    fields.update(overrides)
    return PushRequest(**fields)


async def test_serve_push_rejects_bad_requests(local_pool):
    gt = GPUTransfer(local_pool, "cpu", QWEN)
    rows = torch.zeros((4 * 24, 8 * KiB), dtype=torch.uint8)
    small = gt.small_bytes

    with pytest.raises(ValueError, match="not a slab view size"):
        await gt.serve_push(push_request(gt, 1, 12345), rows, [0])
    with pytest.raises(ValueError, match="do not fit"):
        await gt.serve_push(push_request(gt, 33, small), rows, range(33))
    with pytest.raises(ValueError, match="outside the 48 rows"):
        await gt.serve_push(push_request(gt, 2, small, first_row=47), rows, [0, 1])
    with pytest.raises(ValueError, match="outside"):
        await gt.serve_push(push_request(gt, 1, small, first_row=-1), rows, [0])
    with pytest.raises(IndexError, match="outside the 96 source rows"):
        await gt.serve_push(push_request(gt, 2, small), rows, [0, 96])
    with pytest.raises(IndexError, match="outside"):
        await gt.serve_push(push_request(gt, 1, small), rows, [-1])
    with pytest.raises(ValueError, match="torch.long"):
        index = torch.tensor([0, 1], dtype=torch.int32)
        await gt.serve_push(push_request(gt, 2, small), rows, index)
    with pytest.raises(ValueError, match="has 3 rows, the request 2"):
        await gt.serve_push(push_request(gt, 2, small), rows, [0, 1, 2])
    with pytest.raises(ValueError, match="uint8"):
        await gt.serve_push(push_request(gt, 1, small), rows.view(torch.int16), [0])
    with pytest.raises(ValueError, match="uint8"):
        await gt.serve_push(push_request(gt, 1, small), rows[:, :100], [0])
    assert gt.counters.copies == 0


async def test_zero_rows_copy_nothing(local_pool):
    gt = GPUTransfer(local_pool, "cpu", QWEN)
    rows = torch.zeros((24, 8 * KiB), dtype=torch.uint8)
    empty = torch.tensor([], dtype=torch.long)
    # the dest is unreachable: returning at all proves nothing was copied
    await gt.serve_push(push_request(gt, 0, gt.small_bytes), rows, empty)
    await gt.serve_push(push_request(gt, 0, gt.full_bytes, keys=()), rows, [])

    async def push(req):
        raise AssertionError("an empty load must not push")

    def scatter(first_row, rows):
        raise AssertionError("an empty load must not scatter")

    assert await gt.load_rows(1, push, "lease", [], scatter) == 0
    assert gt.counters.copies == gt.counters.received_copies == 0


async def test_load_rejects_a_policy_size_that_is_no_view(local_pool):
    class OddPolicy:
        def select(self, source_rank, nbytes):
            return 12345

    gt = GPUTransfer(local_pool, "cpu", QWEN, selector=OddPolicy())

    async def push(req):
        raise AssertionError("must not push")

    with pytest.raises(ValueError, match="views are"):
        await gt.load_rows(1, push, "lease", [slot_key(0)], lambda r, t: None)


async def test_a_failed_push_retires_the_receive_slab(local_pool):
    """The holder's push times out on our side while its write may still be in
    flight: the slab it may write into is never used again, the next load gets a
    fresh slab with fresh refs, and the retired one stays allocated."""
    gt = GPUTransfer(local_pool, "cpu", QWEN)
    old_view = gt.recv_views[gt.full_bytes]
    old_refs = dict(gt.recv_refs)

    async def failing_push(req):
        raise TimeoutError("holder did not answer in time")

    with pytest.raises(TimeoutError):
        await gt.load_rows(1, failing_push, "lease", [slot_key(0)], lambda r, t: None)
    assert gt.counters.retired_receive_slabs == 1
    new_view = gt.recv_views[gt.full_bytes]
    assert new_view.data_ptr() != old_view.data_ptr()
    assert all(gt.recv_refs[size] is not old_refs[size] for size in old_refs)
    # the retired slab is still owned by the runtime: a late write lands there
    assert any(views[gt.full_bytes] is old_view for views, _ in gt._retired_recv)

    pushed = []

    async def push(req):
        pushed.append(req)

    await gt.load_rows(1, push, "lease", [slot_key(0)], lambda r, t: None)
    assert pushed[0].dest is gt.recv_refs[pushed[0].wire_bytes]
    assert gt.counters.retired_receive_slabs == 1


async def test_closed_runtime_refuses_work(local_pool):
    gt = GPUTransfer(local_pool, "cpu", QWEN)
    await gt.close()
    await gt.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await gt.load_rows(1, None, "lease", [slot_key(0)], None)  # type: ignore[arg-type]
    assert gt.recv_refs == {}


def test_chunk_row_index():
    # keys at tensor rows 10.. and 0..; 3 layers; global rows 2..4
    index = chunk_row_index([10, 0], 3, 2, 3)
    assert index.dtype == torch.long
    assert index.tolist() == [12, 0, 1]
    empty = chunk_row_index([], 3, 0, 0)
    assert empty.dtype == torch.long and empty.numel() == 0
    with pytest.raises(ValueError, match="exceed"):
        chunk_row_index([0], 3, 2, 2)


def test_check_logical_dtype():
    check_logical_dtype("bfloat16", "bfloat16")
    with pytest.raises(LogicalDtypeMismatch, match="'bfloat16'.*'float16'"):
        check_logical_dtype("bfloat16", "float16")


# ---- real cross-process transfers -------------------------------------------------


@pytest.mark.nixl
@pytest.mark.parametrize("device", DEVICES)
async def test_all_bf16_bit_patterns_survive_a_cross_process_load(device):
    """Every one of the 65,536 BF16 bit patterns (NaNs, infinities, subnormals, -0)
    crosses the process boundary bit-exactly, through the full slab and through the
    small view, and lands in the destination rows the scatter maps it to."""
    num_slots = 6
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    snapshot_values = QWEN.block_nbytes // 2
    gen = torch.Generator().manual_seed(7)
    tiles = [
        patterns[torch.randperm(patterns.numel(), generator=gen)]
        for _ in range(-(-num_slots * snapshot_values // patterns.numel()))
    ]
    values = torch.cat(tiles)[: num_slots * snapshot_values]
    source = values.view(torch.bfloat16).view(torch.uint8).numpy().tobytes()

    async with transfer_pair(QWEN, device, num_slots) as (holder, loader, address):
        await holder.write_source(0, source)
        # 6 keys through the full slab, in an order that is not the slot order ...
        assert await loader.load(address, [[5, 0, 3, 1, 4, 2]]) == 6 * 24
        got = await loader.read_dest(0, num_slots * 24)
        assert got == source
        # ... then one key at a time: after two small batches, the 256 KiB view
        await loader.clear_dest()
        assert await loader.load(address, [[s] for s in range(num_slots)]) == 144
        got = await loader.read_dest(0, num_slots * 24)
        arrived = torch.frombuffer(bytearray(got), dtype=torch.int16)
        assert torch.equal(arrived, values)
        assert set(arrived.tolist()) == set(range(-(2**15), 2**15))
        counters = await holder.counters()
        assert counters["copies"] == 7
        assert counters["wire_bytes"] == 2 * 12 * MiB + 5 * 256 * KiB
        assert counters["useful_bytes"] == 2 * 6 * QWEN.block_nbytes


@pytest.mark.nixl
async def test_loads_larger_than_the_slab_are_chunked():
    """70 snapshots are 1,680 rows: a full slab of 1,536 rows, then 144 rows."""
    num_slots = 70
    source = random_bytes(num_slots * QWEN.block_nbytes, seed=3)
    async with transfer_pair(QWEN, "cpu", num_slots) as (holder, loader, address):
        await holder.write_source(0, source)
        assert await loader.load(address, [list(range(num_slots))]) == 1680
        assert await loader.read_dest(0, num_slots * 24) == source
        sent, received = await holder.counters(), await loader.counters()
        assert sent["copies"] == received["received_copies"] == 2
        assert sent["useful_bytes"] == num_slots * QWEN.block_nbytes
        assert sent["wire_bytes"] == received["received_wire_bytes"] == 24 * MiB


@pytest.mark.nixl
async def test_view_choice_below_at_and_above_256_kib():
    """31, 32 and 33 rows of 8 KiB: the first two are small (the second completes the
    streak and takes the view), the third is large and takes the full slab."""
    num_slots = 64
    source = random_bytes(num_slots * ONE_LAYER.block_nbytes, seed=5)
    async with transfer_pair(ONE_LAYER, "cpu", num_slots) as (holder, loader, address):
        await holder.write_source(0, source)
        wires = []
        for batch in [range(31), range(31, 63), range(33), range(32), range(32)]:
            before = (await holder.counters())["wire_bytes"]
            await loader.load(address, [list(batch)])
            wires.append((await holder.counters())["wire_bytes"] - before)
        assert wires == [512 * KiB, 256 * KiB, 512 * KiB, 512 * KiB, 256 * KiB]
        assert await loader.read_dest(0, 63) == source[: 63 * 8 * KiB]
        assert await loader.read_dest(63, 1) == bytes(8 * KiB)


@pytest.mark.nixl
async def test_a_write_into_a_view_of_the_wrong_size_is_refused():
    """A request whose destination is not ``wire_bytes`` long fails loudly, and the
    channel keeps working for the next, correct load."""
    source = random_bytes(4 * QWEN.block_nbytes, seed=9)
    async with transfer_pair(QWEN, "cpu", 4) as (holder, loader, address):
        await holder.write_source(0, source)
        with pytest.raises(ValueError, match="sizes must match"):
            await loader.push_into_wrong_view(address, [0])
        await loader.load(address, [[0, 1, 2, 3]])
        assert await loader.read_dest(0, 4 * 24) == source


@pytest.mark.nixl
@pytest.mark.parametrize("device", DEVICES)
async def test_streak_selection_registers_nothing_after_warm_up(device):
    """Registrations counted by wrapping NIXL's register_memory in both processes.

    An alternation of one-snapshot (192 KiB) and two-snapshot (384 KiB) loads stays
    on the full slab, and sustained one-snapshot loads settle on the small view:
    after warm-up neither end registers anything, and the refs and views in use
    are the ones made at construction.
    """
    source = random_bytes(8 * QWEN.block_nbytes, seed=11)
    async with transfer_pair(QWEN, device, 8) as (holder, loader, address):
        await holder.write_source(0, source)
        info_before = await loader.transfer_info()

        alternating = [[0], [1, 2]] * 10
        await loader.load(address, alternating[:4])  # warm-up
        calls = (await holder.registration_calls(), await loader.registration_calls())
        counted = await holder.counters()
        await loader.load(address, alternating)
        assert (
            await holder.registration_calls(),
            await loader.registration_calls(),
        ) == calls
        after = await holder.counters()
        assert after["registration_changes"] == counted["registration_changes"]
        assert after["wire_bytes"] - counted["wire_bytes"] == 20 * 12 * MiB

        sustained = [[3], [4], [5]] * 7
        await loader.load(address, sustained[:3])  # warm-up: settles on the view
        calls = (await holder.registration_calls(), await loader.registration_calls())
        counted = await holder.counters()
        await loader.load(address, sustained)
        assert (
            await holder.registration_calls(),
            await loader.registration_calls(),
        ) == calls
        after = await holder.counters()
        assert after["registration_changes"] == counted["registration_changes"]
        assert after["wire_bytes"] - counted["wire_bytes"] == 21 * 256 * KiB

        # the runtime's count agrees with what NIXL saw, per endpoint, from the start
        assert after["local_registration_changes"] == calls[0]
        assert after["remote_registration_changes"] == calls[1]
        assert calls == (2, 2)  # full slab once, small view once, on each end

        # the refs made at construction are the only ones, and the only targets
        info_after = await loader.transfer_info()
        assert info_after["refs"] == info_before["refs"]
        assert info_after["object_ids"] == info_before["object_ids"]
        assert info_after["registry_refs_here"] == 2
        ref_keys = {key for _, key, _ in info_after["refs"].values()}
        assert await holder.get_seen_dests() == ref_keys
        assert await loader.read_dest(0, 6 * 24) == source[: 6 * QWEN.block_nbytes]


@pytest.mark.nixl
async def test_old_smallest_choice_re_registers_at_every_switch():
    """The pre-streak choice (the view whenever the batch fits) alternates buffers
    on the channel, and both endpoints re-register at every switch: this proves the
    instrumentation sees what the streak rule avoids, and the runtime's count
    agrees with it."""
    source = random_bytes(4 * QWEN.block_nbytes, seed=13)
    async with transfer_pair(QWEN, "cpu", 4, loader_policy="smallest") as (
        holder,
        loader,
        address,
    ):
        await holder.write_source(0, source)
        await loader.load(address, [[0], [1, 2]])  # warm-up
        calls = (await holder.registration_calls(), await loader.registration_calls())
        assert calls == (2, 2)
        await loader.load(address, [[3], [1, 2]] * 10)
        now = (await holder.registration_calls(), await loader.registration_calls())
        assert (now[0] - calls[0], now[1] - calls[1]) == (20, 20)
        counters = await holder.counters()
        assert counters["local_registration_changes"] == now[0]
        assert counters["remote_registration_changes"] == now[1]
        assert await loader.read_dest(0, 4 * 24) == source
