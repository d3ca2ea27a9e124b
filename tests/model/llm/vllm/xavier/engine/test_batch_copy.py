"""CUDA's batched copies through the driver (``engine.batch_copy``): the bytes land
where the addresses say, on the current stream, and where there is no CUDA device
there is no copier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xinference.model.llm.vllm.xavier.engine.batch_copy import (
    BatchCopier,
    BatchScatter,
)

from .._support import CUDA_SKIP


def test_no_copier_without_a_cuda_device() -> None:
    assert BatchCopier.open(torch.device("cpu")) is None


@pytest.mark.cuda
@CUDA_SKIP
def test_a_batch_moves_every_piece_to_its_address() -> None:
    device = torch.device("cuda")
    copier = BatchCopier.open(device)
    assert copier is not None, "this driver cannot batch copies (CUDA 12.8 or later)"
    generator = torch.Generator().manual_seed(7)
    source = torch.randint(0, 256, (64 * 1024,), dtype=torch.uint8, generator=generator)
    source = source.to(device)
    target = torch.zeros(128 * 1024, dtype=torch.uint8, device=device)
    # 64 pieces of 1 KiB to a shuffled set of 1 KiB slots, every other one
    slots = torch.randperm(64, generator=generator).tolist()
    s, t = source.data_ptr(), target.data_ptr()
    copier.copy(
        np.array([t + 2048 * slot for slot in slots], dtype=np.uint64),
        np.array([s + 1024 * i for i in range(64)], dtype=np.uint64),
        np.full(64, 1024, dtype=np.uint64),
    )
    torch.cuda.synchronize()
    expected = torch.zeros_like(target)
    for i, slot in enumerate(slots):
        expected[2048 * slot : 2048 * slot + 1024] = source[1024 * i : 1024 * (i + 1)]
    assert torch.equal(target, expected)


@pytest.mark.cuda
@CUDA_SKIP
def test_a_batch_runs_after_the_work_queued_before_it_on_the_stream() -> None:
    """Stream order: the batch reads what a kernel queued just before wrote, and
    a copy queued after it sees the batch's bytes, with no synchronisation."""
    device = torch.device("cuda")
    copier = BatchCopier.open(device)
    assert copier is not None
    layers = [torch.zeros(4, 256, dtype=torch.uint8, device=device) for _ in range(3)]
    scatter = BatchScatter(
        copier,
        [layer.data_ptr() for layer in layers],
        block_stride=256,
        segment_offsets=[0, 128],
        segment_nbytes=128,
    )
    rows = torch.empty(6, 256, dtype=torch.uint8, device=device)
    for round_ in range(20):
        rows.fill_(round_)  # a kernel queued before the batch
        scatter.scatter(0, [3, 1], rows)  # two keys of three layers
        after = torch.stack([layer[[3, 1]] for layer in layers]).cpu()
        assert torch.all(after == round_), round_
