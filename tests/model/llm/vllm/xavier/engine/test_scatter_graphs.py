"""A chunk's span scatter replayed as a CUDA graph writes exactly what the eager
scatter writes, for loads whose chunks come from one reused buffer (the receive
slab), and falls back to the eager scatter whenever it cannot replay."""

from __future__ import annotations

import pytest
import torch

from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.layout import (
    KV_FIRST_LAYOUT,
    PACKED_KV_NHD_LAYOUT,
    detect_layout,
)
from xinference.model.llm.vllm.xavier.engine.scatter_graphs import (
    GRAPHS_ENV,
    ScatterGraphs,
    graphs_requested,
)

from .._support import CUDA_SKIP
from .test_blocks import NB, expected_after_scatter, layer_tensor, long

pytestmark = pytest.mark.timeout(120)

NUM_LAYERS = 3


def test_graphs_need_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        ScatterGraphs(lambda index, rows: None, torch.device("cpu"))
    layers = [layer_tensor(KV_FIRST_LAYOUT) for _ in range(NUM_LAYERS)]
    layout = detect_layout(layers, NB, KV_FIRST_LAYOUT)
    # a CPU cache scatters eagerly, even when asked for graphs
    assert BlockMajorCache(layers, layout, scatter_graphs=True).scatter_graphs is None


def test_graphs_are_opt_in_through_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    assert not graphs_requested()
    monkeypatch.setenv(GRAPHS_ENV, "1")
    assert graphs_requested()
    monkeypatch.setenv(GRAPHS_ENV, "0")
    assert not graphs_requested()
    monkeypatch.setenv(GRAPHS_ENV, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        graphs_requested()


def span_cache(layout: str, scatter_graphs: bool = True) -> BlockMajorCache:
    """Separate per-layer CUDA tensors, as vLLM allocates them on a GPU, each
    filled with a distinct pattern."""
    layers = [layer_tensor(layout).cuda() for _ in range(NUM_LAYERS)]
    for i, layer in enumerate(layers):
        layer.view(torch.int16).copy_(
            (torch.arange(layer.numel(), dtype=torch.int16) + 100 * i)
            .view(layer.shape)
            .cuda()
        )
    cache = BlockMajorCache(
        layers, detect_layout(layers, NB, layout), scatter_graphs=scatter_graphs
    )
    if cache.scatter_path != "span":
        pytest.skip("the allocator's addresses do not allow a piece span here")
    return cache


def every_layer(cache: BlockMajorCache) -> list[torch.Tensor]:
    return [cache.gather(layer, long(range(NB))).cpu() for layer in range(NUM_LAYERS)]


# Destinations of consecutive loads: key counts repeat (so shapes are captured and
# replayed) with other blocks each time.
LOADS = [[4], [1], [0, 5], [3, 2], [5], [2, 0], [1, 3, 4], [4, 1, 3], [0]]


def run_loads(
    cache: BlockMajorCache, loads: list[list[int]], busy: bool
) -> list[torch.Tensor]:
    """Scatter each load through one source buffer, refilled per load, as the
    receive slab is; the expected layers afterwards."""
    row_bytes = cache.layout.layer_block_nbytes
    slab = torch.empty(
        (max(map(len, loads)) * NUM_LAYERS, row_bytes), dtype=torch.uint8
    )
    slab = slab.cuda()
    expected = every_layer(cache)
    work = torch.randn(1024, 1024, device="cuda")
    generator = torch.Generator().manual_seed(7)
    for dst in loads:
        rows = torch.randint(
            0,
            256,
            (len(dst) * NUM_LAYERS, row_bytes),
            dtype=torch.uint8,
            generator=generator,
        )
        expected = expected_after_scatter(expected, 0, rows, dst)
        source = slab[: rows.shape[0]]
        source.copy_(rows.cuda())
        if busy:  # keep the stream busy, so that replays queue behind work
            for _ in range(3):
                work = work @ work
                work = work / work.norm()
        cache.scatter_rows(0, source, cache.destinations(dst))
        # the slab's next fill waits for this scatter, as the transport's does
        torch.cuda.current_stream().synchronize()
    return expected


@pytest.mark.cuda
@CUDA_SKIP
@pytest.mark.parametrize("layout", [KV_FIRST_LAYOUT, PACKED_KV_NHD_LAYOUT])
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_replayed_scatters_write_what_eager_ones_write(layout: str, busy: bool):
    cache = span_cache(layout)
    expected = run_loads(cache, LOADS, busy)
    for got, want in zip(every_layer(cache), expected, strict=True):
        assert torch.equal(got, want)
    graphs = cache.scatter_graphs
    assert graphs is not None and graphs.disabled is None
    # one, two and three keys: each shape's first chunk ran eagerly, its second
    # was captured, and it and every later one replayed
    assert graphs.captures == 3
    assert graphs.replays == len(LOADS) - 3


@pytest.mark.cuda
@CUDA_SKIP
def test_graphs_off_scatter_eagerly_to_the_same_blocks():
    on, off = span_cache(KV_FIRST_LAYOUT), span_cache(
        KV_FIRST_LAYOUT, scatter_graphs=False
    )
    assert off.scatter_graphs is None
    for cache in (on, off):
        expected = run_loads(cache, LOADS, busy=False)
        for got, want in zip(every_layer(cache), expected, strict=True):
            assert torch.equal(got, want)


@pytest.mark.cuda
@CUDA_SKIP
def test_least_recently_replayed_graphs_are_dropped():
    cache = span_cache(KV_FIRST_LAYOUT)
    assert cache.scatter_graphs is not None
    cache.scatter_graphs = graphs = ScatterGraphs(
        cache.scatter_graphs.kernel, cache.device, max_graphs=2
    )
    # key counts 1, 2, 3 twice each: three captures, the third dropping the
    # one-key graph; one key again is a first sight again, then a capture
    loads = [[0], [1], [2, 3], [4, 5], [1, 2, 3], [3, 4, 5], [2], [5]]
    expected = run_loads(cache, loads, busy=False)
    for got, want in zip(every_layer(cache), expected, strict=True):
        assert torch.equal(got, want)
    assert graphs.captures == 4 and graphs.replays == 4
    assert len(graphs) == 2


@pytest.mark.cuda
@CUDA_SKIP
def test_a_failed_capture_turns_graphs_off_and_the_chunk_scatters_eagerly():
    cache = span_cache(KV_FIRST_LAYOUT)
    assert cache.scatter_graphs is not None
    eager = cache.scatter_graphs.kernel

    def refuses_capture(index: torch.Tensor, rows: torch.Tensor) -> None:
        torch.cuda.synchronize()  # not allowed while a stream is capturing
        eager(index, rows)

    cache.scatter_graphs = graphs = ScatterGraphs(refuses_capture, cache.device)
    expected = run_loads(cache, LOADS, busy=False)
    for got, want in zip(every_layer(cache), expected, strict=True):
        assert torch.equal(got, want)
    assert graphs.disabled is not None and "capturing" in graphs.disabled
    assert graphs.captures == 0 and graphs.replays == 0
