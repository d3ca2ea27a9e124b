"""Layout detection and whole-block gather/scatter over the engine's KV tensors."""

from __future__ import annotations

import pytest
import torch

from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.layout import (
    BLOCK_FIRST_LAYOUT,
    KV_FIRST_LAYOUT,
    PACKED_KV_LAYOUT,
    PACKED_KV_NHD_LAYOUT,
    copy_snapshot_rows,
    detect_layout,
    row_format,
    snapshot_runs,
    wide_view,
)
from xinference.model.llm.vllm.xavier.wire import KVGeometry

from .._support import (
    CUDA_SKIP,
    DEVICES,
    EngineSpec,
    SyntheticEngine,
    all_bf16_patterns,
)

pytestmark = pytest.mark.timeout(60)

NB, H, BS, D = 6, 2, 4, 8


def layer_tensor(layout: str, num_blocks: int = NB) -> torch.Tensor:
    memory = torch.zeros(num_blocks * H * BS * 2 * D, dtype=torch.bfloat16)
    return shaped(memory, layout, num_blocks)


def shaped(memory: torch.Tensor, layout: str, num_blocks: int = NB) -> torch.Tensor:
    """One layer's flat ``memory`` in ``layout``'s logical shape; ``packed_kv_nhd``
    is the packed shape stored tokens before heads (FlashAttention's NHD)."""
    if layout == PACKED_KV_NHD_LAYOUT:
        return memory.view(num_blocks, BS, H, 2 * D).transpose(1, 2)
    shapes = {
        PACKED_KV_LAYOUT: (num_blocks, H, BS, 2 * D),
        KV_FIRST_LAYOUT: (2, num_blocks, BS, H, D),
        BLOCK_FIRST_LAYOUT: (num_blocks, 2, BS, H, D),
    }
    return memory.view(shapes[layout])


def long(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


@pytest.mark.parametrize(
    "layout, axis, block_shape",
    [
        (PACKED_KV_LAYOUT, 0, (H, BS, 2 * D)),
        (PACKED_KV_NHD_LAYOUT, 0, (BS, H, 2 * D)),
        (KV_FIRST_LAYOUT, 1, (2, BS, H, D)),
        (BLOCK_FIRST_LAYOUT, 0, (2, BS, H, D)),
    ],
)
def test_detects_the_layouts(layout, axis, block_shape):
    tensors = [layer_tensor(layout) for _ in range(3)]
    kv = detect_layout(tensors, NB)
    assert kv.name == layout
    assert kv.block_axis == axis
    assert kv.block_shape == block_shape
    assert kv.dtype == "bfloat16"
    assert kv.layer_block_nbytes == 2 * H * BS * D * 2
    assert kv.block_size == BS
    assert kv.geometry(3) == KVGeometry(3, kv.layer_block_nbytes, "bfloat16", BS)
    # The hint agrees with what was detected.
    assert detect_layout(tensors, NB, layout) == kv


def test_packed_kv_stored_tokens_first_has_rows_in_memory_order():
    """FlashAttention's NHD packed cache: the packed shape, but a row lists the
    block's bytes tokens first, as they lie in memory (one contiguous range), and
    the hint ``packed_kv`` names the same layout. With one head (or one token) both
    orders are the same bytes: plain ``packed_kv``."""
    tensor = layer_tensor(PACKED_KV_NHD_LAYOUT)
    tensor.view(torch.int16).copy_(
        torch.arange(tensor.numel(), dtype=torch.int16).view(tensor.shape)
    )
    kv = detect_layout([tensor], NB, PACKED_KV_LAYOUT)
    assert kv.name == PACKED_KV_NHD_LAYOUT
    assert row_format(kv.name) != row_format(PACKED_KV_LAYOUT)
    cache = BlockMajorCache([tensor], kv)
    memory = tensor.transpose(1, 2).contiguous().view(torch.uint8).view(NB, -1)
    assert torch.equal(cache.gather(0, long([3, 0])), memory[[3, 0]])
    assert not torch.equal(memory[3], tensor[3].contiguous().view(torch.uint8).view(-1))
    rows = torch.randint(0, 256, (1, kv.layer_block_nbytes), dtype=torch.uint8)
    cache.scatter(0, long([5]), rows)
    assert torch.equal(
        tensor.transpose(1, 2)[5].contiguous().view(torch.uint8),
        rows[0].view(BS, H, -1),
    )
    one_head = torch.zeros(NB, 1, BS, 2 * D, dtype=torch.bfloat16)
    assert detect_layout([one_head], NB).name == PACKED_KV_LAYOUT


def test_two_blocks_with_a_leading_two_is_ambiguous_without_a_hint():
    """num_blocks == 2 in a five-dimensional layout: K/V-first or block-first?"""
    tensors = [layer_tensor(KV_FIRST_LAYOUT, num_blocks=2)]
    with pytest.raises(ValueError, match="ambiguous KV cache shape"):
        detect_layout(tensors, 2)
    assert detect_layout(tensors, 2, KV_FIRST_LAYOUT).block_axis == 1
    assert detect_layout(tensors, 2, BLOCK_FIRST_LAYOUT).block_axis == 0


def test_rejects_unknown_shapes_hints_and_hybrid_layers():
    with pytest.raises(ValueError, match="unrecognised KV cache shape"):
        detect_layout([layer_tensor(PACKED_KV_LAYOUT)], NB + 1)
    with pytest.raises(ValueError, match="unknown KV layout"):
        detect_layout([layer_tensor(PACKED_KV_LAYOUT)], NB, "paged")
    with pytest.raises(ValueError, match="does not fit layout 'kv_first'"):
        detect_layout([layer_tensor(BLOCK_FIRST_LAYOUT)], NB, KV_FIRST_LAYOUT)
    mixed = [layer_tensor(PACKED_KV_LAYOUT), layer_tensor(PACKED_KV_LAYOUT).float()]
    with pytest.raises(ValueError, match="hybrid models"):
        detect_layout(mixed, NB)
    other_shape = [
        layer_tensor(PACKED_KV_LAYOUT),
        layer_tensor(PACKED_KV_LAYOUT, NB + 1),
    ]
    with pytest.raises(ValueError, match="hybrid models"):
        detect_layout(other_shape, NB)
    with pytest.raises(ValueError, match="no KV cache tensors"):
        detect_layout([], NB)


def test_row_formats_say_which_layouts_can_exchange_rows():
    assert row_format(KV_FIRST_LAYOUT) == row_format(BLOCK_FIRST_LAYOUT)
    assert row_format(PACKED_KV_LAYOUT) != row_format(KV_FIRST_LAYOUT)
    assert row_format("something-else") == "something-else"


@pytest.mark.parametrize(
    "layout", [PACKED_KV_LAYOUT, KV_FIRST_LAYOUT, BLOCK_FIRST_LAYOUT]
)
def test_gather_returns_the_blocks_bytes_and_scatter_writes_through(layout):
    engine = SyntheticEngine(
        EngineSpec(layout, num_layers=2, num_blocks=NB), share=False
    )
    for layer, tensor in enumerate(engine.tensors):
        values = torch.arange(tensor.numel(), dtype=torch.int16) + 1000 * layer
        tensor.copy_(values.view(torch.bfloat16).reshape(tensor.shape))
    cache = engine.cache
    axis = cache.layout.block_axis
    ids = [4, 1, 3]
    for layer, tensor in enumerate(engine.tensors):
        expected = (
            tensor.index_select(axis, long(ids))
            .movedim(axis, 0)
            .contiguous()
            .view(torch.uint8)
            .reshape(len(ids), -1)
        )
        assert torch.equal(cache.gather(layer, long(ids)), expected)

    before = [cache.gather(layer, long(range(NB))) for layer in range(2)]
    rows = torch.randint(
        0, 256, (2, cache.layout.layer_block_nbytes), dtype=torch.uint8
    )
    cache.scatter(1, long([5, 0]), rows)
    # Read back through the engine's own tensor, not through the cache.
    written = engine.tensors[1].index_select(axis, long([5, 0])).movedim(axis, 0)
    assert torch.equal(written.contiguous().view(torch.uint8).reshape(2, -1), rows)
    # Other blocks and layers are untouched.
    assert torch.equal(cache.gather(0, long(range(NB))), before[0])
    untouched = long([1, 2, 3, 4])
    assert torch.equal(cache.gather(1, untouched), before[1][untouched])


def test_kv_first_view_that_is_not_contiguous_round_trips():
    """vLLM may allocate block-first and permute to K/V-first: a strided view."""
    engine = SyntheticEngine(
        EngineSpec(KV_FIRST_LAYOUT, num_layers=1, num_blocks=NB), share=False
    )
    assert not engine.tensors[0].is_contiguous()
    byte_view = engine.cache.layer_bytes(0)
    assert byte_view.dtype == torch.uint8
    assert byte_view.data_ptr() == engine.tensors[0].data_ptr()
    rows = torch.randint(
        0, 256, (3, engine.cache.layout.layer_block_nbytes), dtype=torch.uint8
    )
    engine.cache.scatter(0, long([0, 2, 5]), rows)
    assert torch.equal(engine.cache.gather(0, long([0, 2, 5])), rows)
    assert torch.equal(engine.cache.gather(0, long([1, 3, 4])), torch.zeros_like(rows))


def test_all_bf16_patterns_move_between_kv_first_and_block_first_exactly():
    patterns = all_bf16_patterns()
    spec = dict(num_layers=2, num_blocks=64, kv_heads=2, block_size=16, head_size=32)
    source = SyntheticEngine(EngineSpec(KV_FIRST_LAYOUT, **spec), share=False)
    target = SyntheticEngine(EngineSpec(BLOCK_FIRST_LAYOUT, **spec), share=False)
    blocks = source.fill_blocks(
        range(patterns.numel() // source.block_elements()), patterns
    )
    ids = long(list(blocks))
    dst = long([63 - i for i in blocks])
    for layer in range(2):
        target.cache.scatter(layer, dst, source.cache.gather(layer, ids))
    moved = torch.cat([target.read_block(int(b)).reshape(-1) for b in dst])
    assert torch.equal(moved.view(torch.int16), patterns.view(torch.int16))


def test_index_rules():
    engine = SyntheticEngine(
        EngineSpec(PACKED_KV_LAYOUT, num_layers=1, num_blocks=NB), share=False
    )
    cache = engine.cache
    r = cache.layout.layer_block_nbytes
    empty = cache.gather(0, long([]))
    assert empty.shape == (0, r) and empty.dtype == torch.uint8
    cache.scatter(0, long([]), torch.empty((0, r), dtype=torch.uint8))
    with pytest.raises(ValueError, match="torch.long"):
        cache.gather(0, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(IndexError, match="block id 6 is out of range for 6"):
        cache.gather(0, long([0, 6]))
    with pytest.raises(IndexError, match="block id -1"):
        cache.scatter(0, long([-1]), torch.zeros((1, r), dtype=torch.uint8))
    with pytest.raises(ValueError, match="duplicate destination blocks"):
        cache.scatter(0, long([2, 2]), torch.zeros((2, r), dtype=torch.uint8))
    with pytest.raises(ValueError, match="rows must be uint8"):
        cache.scatter(0, long([2]), torch.zeros((1, r // 2), dtype=torch.bfloat16))


def test_cache_refuses_tensors_that_do_not_match_the_layout():
    tensors = [layer_tensor(PACKED_KV_LAYOUT)]
    kv = detect_layout(tensors, NB)
    with pytest.raises(ValueError, match="the layout says"):
        BlockMajorCache([layer_tensor(PACKED_KV_LAYOUT, NB + 1)], kv)
    with pytest.raises(ValueError, match="the layout says"):
        BlockMajorCache([layer_tensor(PACKED_KV_LAYOUT).half()], kv)


def test_wide_view_copies_bytes_exactly_as_the_widest_integer_that_fits():
    rows = torch.randint(0, 256, (4, 24), dtype=torch.uint8)
    assert wide_view(rows).dtype == torch.int64
    assert wide_view(rows[:, :12]).dtype == torch.int32  # 12-byte rows, stride 24
    assert wide_view(rows[:, :6]).dtype == torch.int16
    assert wide_view(rows[:, 1:8]).dtype == torch.uint8  # odd offset and length
    assert wide_view(rows[::2]).dtype == torch.int64  # strided rows are fine
    assert torch.equal(wide_view(rows).view(torch.uint8), rows)
    # An explicit dtype that the strides refuse is served from a contiguous copy.
    odd = rows[:, 1:9]
    assert torch.equal(wide_view(odd, torch.int64).view(torch.uint8), odd)


def test_cache_with_rows_that_only_fit_two_byte_elements():
    """K/V-first with head size 3 in BF16: 6-byte last dimension, int16 elements."""
    spec = EngineSpec(
        KV_FIRST_LAYOUT,
        num_layers=1,
        num_blocks=5,
        kv_heads=1,
        block_size=3,
        head_size=3,
    )
    engine = SyntheticEngine(spec, share=False)
    assert wide_view(engine.tensors[0]).dtype == torch.int16
    r = engine.cache.layout.layer_block_nbytes
    rows = torch.randint(0, 256, (2, r), dtype=torch.uint8)
    engine.cache.scatter(0, long([4, 1]), rows)
    assert torch.equal(engine.cache.gather(0, long([4, 1])), rows)
    block4 = engine.tensors[0][:, 4].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(block4, rows[0])


def one_allocation(
    layout: str, num_layers: int, gap: int = 0, device: str = "cpu", uneven: int = 0
) -> list[torch.Tensor]:
    """Per-layer views of one flat allocation, as vLLM on CPU lays them out; ``gap``
    elements of padding between layers, plus ``uneven`` times the layer's index
    more before each (then the layers are not equally spaced)."""
    per_layer = layer_tensor(layout).numel()
    starts = [
        i * (per_layer + gap) + uneven * i * (i + 1) // 2 for i in range(num_layers)
    ]
    flat = torch.zeros(starts[-1] + per_layer, dtype=torch.bfloat16, device=device)
    return [shaped(flat[start : start + per_layer], layout) for start in starts]


def expected_after_scatter(
    layers: list[torch.Tensor], first_row: int, rows: torch.Tensor, dst: list[int]
) -> list[torch.Tensor]:
    """``layers`` (each ``(blocks, R)``) after writing ``rows`` one row at a time:
    the reference that ``scatter_rows`` must match."""
    layers = [layer.clone() for layer in layers]
    for i in range(rows.shape[0]):
        row = first_row + i
        layers[row % len(layers)][dst[row // len(layers)]] = rows[i]
    return layers


# allocation -> (scatter path for whole snapshots, one_allocation's arguments
# with the gap and the unevenness in blocks of one layer, or None: separate tensors)
ALLOCATIONS: dict[str, tuple[str, tuple[float, float] | None]] = {
    "one allocation": ("stacked", (0, 0)),
    "padded": ("stacked", (0.25, 0)),  # a gap of a quarter block
    "uneven": ("span", (1, 2)),  # whole blocks apart, not equally
    "uneven, off the pieces": ("per layer", (0, 0.0625)),
    "separate tensors": ("span or per layer", None),  # up to the allocator
}


@pytest.mark.parametrize(
    "layout",
    [PACKED_KV_LAYOUT, PACKED_KV_NHD_LAYOUT, KV_FIRST_LAYOUT, BLOCK_FIRST_LAYOUT],
)
@pytest.mark.parametrize("allocation", list(ALLOCATIONS))
@pytest.mark.parametrize("first_row, num_rows", [(0, 9), (3, 3), (2, 5), (6, 3)])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staged", [False, True], ids=["ids", "staged"])
def test_scatter_rows_matches_writing_each_row(
    layout: str,
    allocation: str,
    first_row: int,
    num_rows: int,
    device: str,
    staged: bool,
) -> None:
    """Whole-snapshot chunks take one copy (stacked layers, or a span over the
    layers' pieces) where the addresses allow, one per layer otherwise, as do all
    other chunks: every path writes exactly the rows asked for and nothing else."""
    num_layers = 3
    path, spacing = ALLOCATIONS[allocation]
    if spacing is None:
        tensors = [layer_tensor(layout).to(device) for _ in range(num_layers)]
    else:
        block = layer_tensor(layout).numel() // NB  # elements of one block
        gap, uneven = (int(x * block) for x in spacing)
        tensors = one_allocation(layout, num_layers, gap, device, uneven)
    for i, tensor in enumerate(tensors):
        tensor.view(torch.int16).copy_(
            (torch.arange(tensor.numel(), dtype=torch.int16) + 100 * i)
            .view(tensor.shape)
            .to(device)
        )
    cache = BlockMajorCache(tensors, detect_layout(tensors, NB, layout))
    assert cache.scatter_path in path.split(" or ")
    expected = [
        cache.gather(layer, long(range(NB))).cpu() for layer in range(num_layers)
    ]
    # Two chunks back to back, the second to other blocks: the ids staged for the
    # first must not be overwritten before its copy has used them.
    for dst in ([4, 0, 2], [1, 5, 3]):
        rows = torch.randint(
            0, 256, (num_rows, cache.layout.layer_block_nbytes), dtype=torch.uint8
        )
        expected = expected_after_scatter(expected, first_row, rows, dst)
        ids = cache.destinations(dst) if staged else long(dst)
        cache.scatter_rows(first_row, rows.to(device), ids)
    for layer in range(num_layers):
        got = cache.gather(layer, long(range(NB))).cpu()
        assert torch.equal(got, expected[layer])


@pytest.mark.parametrize(
    "layout",
    [PACKED_KV_LAYOUT, PACKED_KV_NHD_LAYOUT, KV_FIRST_LAYOUT, BLOCK_FIRST_LAYOUT],
)
@pytest.mark.parametrize("allocation", list(ALLOCATIONS))
@pytest.mark.parametrize("device", DEVICES)
def test_gather_snapshots_and_copy_to_rows_read_each_layer_of_each_block(
    layout: str, allocation: str, device: str
) -> None:
    """Whole snapshots read by whichever path the addresses allow equal the layers'
    blocks read one by one, and land at the rows asked for, nothing else."""
    num_layers = 3
    path, spacing = ALLOCATIONS[allocation]
    if spacing is None:
        tensors = [layer_tensor(layout).to(device) for _ in range(num_layers)]
    else:
        block = layer_tensor(layout).numel() // NB
        gap, uneven = (int(x * block) for x in spacing)
        tensors = one_allocation(layout, num_layers, gap, device, uneven)
    for i, tensor in enumerate(tensors):
        tensor.view(torch.int16).copy_(
            (torch.arange(tensor.numel(), dtype=torch.int16) * 3 + 1000 * i)
            .view(tensor.shape)
            .to(device)
        )
    cache = BlockMajorCache(tensors, detect_layout(tensors, NB, layout))
    assert cache.scatter_path in path.split(" or ")
    blocks = [4, 0, 5, 2]
    want = torch.stack(
        [cache.gather(layer, long(blocks)).cpu() for layer in range(num_layers)],
        dim=1,
    ).reshape(len(blocks) * num_layers, -1)
    assert torch.equal(cache.gather_snapshots(long(blocks)).cpu(), want)

    row_nbytes = cache.layout.layer_block_nbytes
    # Scattered slots (an index copy), then consecutive ones (a slice copy, or
    # on the cache's device through the piece span, a gather into the rows); ids
    # as a tensor, or as the staging ring's list.
    for slots in ([6, 0, 3, 1], [2, 3, 4, 5]):
        for rows_device in ("cpu", device):
            for listed in (False, True):
                rows = torch.zeros(
                    (8 * num_layers, row_nbytes), dtype=torch.uint8, device=rows_device
                )
                first_rows = [slot * num_layers for slot in slots]
                if listed:
                    cache.copy_listed_blocks_to_rows(blocks, rows, first_rows)
                else:
                    cache.copy_blocks_to_rows(long(blocks), rows, first_rows)
                expected = torch.zeros_like(rows, device="cpu")
                for i, first in enumerate(first_rows):
                    expected[first : first + num_layers] = want[
                        i * num_layers : (i + 1) * num_layers
                    ]
                assert torch.equal(rows.cpu(), expected), (slots, rows_device, listed)


def test_scatter_rows_refuses_missing_or_repeated_destinations() -> None:
    tensors = one_allocation(PACKED_KV_LAYOUT, 2)
    cache = BlockMajorCache(tensors, detect_layout(tensors, NB, PACKED_KV_LAYOUT))
    rows = torch.zeros((4, cache.layout.layer_block_nbytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match="need destinations"):
        cache.scatter_rows(0, rows, long([1]))
    with pytest.raises(ValueError, match="duplicate"):
        cache.scatter_rows(0, rows, long([1, 1]))
    with pytest.raises(IndexError, match="out of range"):
        cache.scatter_rows(0, rows, long([1, NB]))
    with pytest.raises(ValueError, match="bytes"):
        cache.scatter_rows(0, rows[:, 1:], long([1, 2]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "source_slots, target_slots",
    [
        ([1, 2, 3], [4, 5, 6]),  # slices on both sides
        ([3, 0, 5], [1, 2, 3]),  # a gather, then a slice
        ([2, 3, 4], [6, 0, 3]),  # a slice, then an indexed copy
        ([5, 1, 4], [0, 6, 2]),  # indexed on both sides
        # past MAX_RUN_COPIES runs: gathered and scattered within a device
        (list(range(0, 80, 2)), list(range(1, 81, 2))),
    ],
)
def test_copy_snapshot_rows_moves_whole_snapshots_between_devices(
    device, source_slots, target_slots
):
    """Device to host as a demotion does, and within a device as the ring does."""
    layers, width, slots = 3, 16, 81
    source = torch.randint(0, 256, (slots * layers, width), dtype=torch.uint8).to(
        device
    )
    for target_device in ("cpu", device):
        target = torch.zeros(
            (slots * layers, width), dtype=torch.uint8, device=target_device
        )
        copy_snapshot_rows(
            source,
            [s * layers for s in source_slots],
            target,
            [t * layers for t in target_slots],
            layers,
        )
        expected = torch.zeros_like(target)
        for s, t in zip(source_slots, target_slots, strict=True):
            expected[t * layers : (t + 1) * layers] = source[
                s * layers : (s + 1) * layers
            ]
        assert torch.equal(target.cpu(), expected.cpu())
    with pytest.raises(ValueError, match="2 source snapshots for 1 target"):
        copy_snapshot_rows(source, [0, layers], source, [0], layers)


def test_snapshot_runs_join_what_follows_on_both_sides():
    # 3 layers a snapshot: (0 -> 9, 3 -> 12) follow, 6 -> 30 does not
    assert snapshot_runs([0, 3, 6, 9], [9, 12, 30, 33], 3) == [(0, 9, 6), (6, 30, 6)]
    assert snapshot_runs([6, 3], [0, 3], 3) == [(6, 0, 3), (3, 3, 3)]
    assert snapshot_runs([], [], 3) == []


def test_destinations_are_checked_once() -> None:
    tensors = one_allocation(PACKED_KV_LAYOUT, 2)
    cache = BlockMajorCache(tensors, detect_layout(tensors, NB, PACKED_KV_LAYOUT))
    rows = torch.zeros((4, cache.layout.layer_block_nbytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match="duplicate"):
        cache.destinations([1, 1])
    with pytest.raises(IndexError, match="out of range"):
        cache.destinations([1, NB])
    with pytest.raises(IndexError, match="out of range"):
        cache.destinations([-1])
    staged = cache.destinations([3])
    assert staged.ids == (3,) and staged.index.tolist() == [3]
    with pytest.raises(ValueError, match="need destinations"):
        cache.scatter_rows(0, rows, staged)


@pytest.mark.cuda
@CUDA_SKIP
def test_staged_destinations_survive_pinned_buffer_reuse() -> None:
    """More loads than pinned buffers, staged while the stream is still busy: each
    load's ids reach the device intact (a buffer is rewritten only after the copy
    out of it ran), so every scatter lands in its own blocks."""
    num_layers = 2
    tensors = one_allocation(PACKED_KV_LAYOUT, num_layers, device="cuda")
    cache = BlockMajorCache(tensors, detect_layout(tensors, NB, PACKED_KV_LAYOUT))
    row_nbytes = cache.layout.layer_block_nbytes
    expected = [cache.gather(layer, long(range(NB))).cpu() for layer in range(2)]
    loads = []
    for i in range(40):
        dst = [(i + k) % NB for k in range(3)] if i % 2 else [(5 * i) % NB]
        rows = torch.randint(
            0, 256, (len(dst) * num_layers, row_nbytes), dtype=torch.uint8
        )
        expected = expected_after_scatter(expected, 0, rows, dst)
        loads.append((dst, rows.to("cuda")))  # before the stream gets busy
    busy = torch.randn(2048, 2048, device="cuda")
    for dst, rows in loads:
        for _ in range(4):  # keep the stream busy, so the copies queue up
            busy = busy @ busy
            busy = busy / busy.norm()
        cache.scatter_rows(0, rows, cache.destinations(dst))
    for layer in range(num_layers):
        got = cache.gather(layer, long(range(NB))).cpu()
        assert torch.equal(got, expected[layer])
