"""Which layout the engine's per-layer KV tensors have, and the bytes of a row.

vLLM keeps one KV tensor per layer, in a shape that depends on the attention backend:

- ``packed_kv``: ``(num_blocks, kv_heads, block_size, 2 * head_size)``, block axis 0
  (vLLM's CPU backend, and FlashAttention on a GPU from vLLM 0.26 on, whatever its
  memory order);
- ``kv_first``: ``(2, num_blocks, block_size, kv_heads, head_size)``, block axis 1;
- ``block_first``: ``(num_blocks, 2, block_size, kv_heads, head_size)``, block axis 0.

Xavier moves whole blocks: a block of one layer is one row of ``R =
layer_block_nbytes`` bytes, listing the block's bytes in the order of the per-block
shape (the layer shape without the block axis), whatever the strides. That is what
makes two layouts exchangeable: ``kv_first`` and ``block_first`` both give ``(2,
block_size, heads, head)`` and identical rows; ``packed_kv`` does not (see
``row_format``). Only raw bytes move; the logical dtype travels beside them and is
checked on arrival, so every BF16 bit pattern survives.

One exception to the per-block shape's order: ``packed_kv`` stored tokens before
heads (FlashAttention's NHD memory order, vLLM 0.26 on a GPU) is named
``packed_kv_nhd``, and its rows list a block's bytes in that memory order
(``KVLayout.row_view``). A block of one layer is then one contiguous range of the
engine's memory, not 2 x tokens pieces, and in vLLM's cross-layer cache a block of
every layer is one contiguous snapshot, so a load can READ straight into it. Its
rows differ from ``packed_kv``'s (another ``row_format``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..wire import KVGeometry
from .device import host_to_device

PACKED_KV_LAYOUT = "packed_kv"
PACKED_KV_NHD_LAYOUT = "packed_kv_nhd"  # packed_kv, tokens before heads in memory
KV_FIRST_LAYOUT = "kv_first"
BLOCK_FIRST_LAYOUT = "block_first"
# the shapes an engine's tensors are recognised by (``packed_kv_nhd`` is
# ``packed_kv``'s shape, told apart by its strides)
LAYOUTS = (PACKED_KV_LAYOUT, KV_FIRST_LAYOUT, BLOCK_FIRST_LAYOUT)

# layout name -> (number of dimensions, block axis)
_SHAPES: dict[str, tuple[int, int]] = {
    PACKED_KV_LAYOUT: (4, 0),
    PACKED_KV_NHD_LAYOUT: (4, 0),
    KV_FIRST_LAYOUT: (5, 1),
    BLOCK_FIRST_LAYOUT: (5, 0),
}
# layout name -> the order of a row's bytes (the per-block shape's axes)
_ROW_FORMATS: dict[str, str] = {
    PACKED_KV_LAYOUT: "heads,tokens,kv*head",
    PACKED_KV_NHD_LAYOUT: "tokens,heads,kv*head",
    KV_FIRST_LAYOUT: "kv,tokens,heads,head",
    BLOCK_FIRST_LAYOUT: "kv,tokens,heads,head",
}
# ``packed_kv_nhd``: the axes that swap between the engine's logical shape
# (blocks, heads, tokens, kv*head) and the row order (blocks, tokens, heads, ...)
_NHD_SWAP = (1, 2)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the logical dtype names on the wire)."""
    return str(dtype).removeprefix("torch.")


# Widest first. Bytes are bytes: copying them as 8-byte integers is exact.
WIDE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def wide_view(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same bytes as ``tensor`` (any dtype), viewed as ``dtype`` or else the widest
    integer type its shape, strides and offset allow.

    Why: a row copy of 1-byte elements counts 8x the elements of the same bytes as
    int64, which crosses ATen's parallel grain sooner, and on a busy CPU starting a
    parallel region costs far more than copying a block serially. A tensor that
    cannot take ``dtype`` is copied first.
    """
    if dtype is not None:
        try:
            return tensor.view(dtype)
        except RuntimeError:
            return tensor.contiguous().view(dtype)
    for candidate in WIDE_DTYPES:
        if candidate.itemsize < tensor.element_size():
            continue
        try:
            return tensor.view(candidate)
        except RuntimeError:
            continue
    return tensor.view(torch.uint8)


def row_format(layout: str) -> str:
    """The byte order of a row in ``layout``; replicas exchange rows only if equal.

    An unknown name is its own format, so it is compatible only with itself.
    """
    return _ROW_FORMATS.get(layout, layout)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one engine lays out its per-layer KV tensors (identical for all layers)."""

    name: str
    num_blocks: int
    block_axis: int
    block_shape: tuple[
        int, ...
    ]  # one layer's block: the layer shape minus the block axis
    dtype: str  # logical dtype name, e.g. "bfloat16"
    layer_block_nbytes: int

    @property
    def block_size(self) -> int:
        """Tokens per block: the first axis of the per-block shape in
        ``packed_kv_nhd``, the second in every other layout."""
        return self.block_shape[0 if self.name == PACKED_KV_NHD_LAYOUT else 1]

    def row_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """A layer tensor in the engine's logical shape, viewed so that its
        per-block axes come in row order (no copy; the same tensor except for
        ``packed_kv_nhd``, whose heads and tokens axes swap)."""
        if self.name == PACKED_KV_NHD_LAYOUT:
            return tensor.transpose(*_NHD_SWAP)
        return tensor

    def geometry(self, num_layers: int) -> KVGeometry:
        return KVGeometry(
            num_layers=num_layers,
            layer_block_nbytes=self.layer_block_nbytes,
            logical_dtype=self.dtype,
            block_size=self.block_size,
        )


def detect_layout(
    tensors: Sequence[torch.Tensor], num_blocks: int, layout_hint: str | None = None
) -> KVLayout:
    """Recognise the layout of the engine's per-layer KV tensors.

    ``num_blocks`` is the engine's block count (from vLLM's cache config); the block
    axis is where it appears. A shape where it could be either of two axes (say
    ``num_blocks == 2`` in a five-dimensional layout) is refused unless
    ``layout_hint`` names the layout.
    """
    if not tensors:
        raise ValueError("no KV cache tensors to describe")
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    first = tensors[0]
    for layer, tensor in enumerate(tensors):
        if tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise ValueError(
                f"KV cache layer {layer} is {tuple(tensor.shape)} {tensor.dtype}, "
                f"layer 0 is {tuple(first.shape)} {first.dtype}: layers of different "
                "shapes or dtypes (hybrid models) are not supported"
            )
        if tensor.device != first.device:
            raise ValueError(
                f"KV cache layer {layer} is on {tensor.device}, layer 0 on {first.device}"
            )
    shape = tuple(first.shape)

    if layout_hint is not None:
        if layout_hint not in _SHAPES:
            raise ValueError(
                f"unknown KV layout {layout_hint!r}; expected one of {LAYOUTS}"
            )
        if not _fits(layout_hint, shape, num_blocks):
            raise ValueError(
                f"KV cache shape {shape} does not fit layout {layout_hint!r} with "
                f"{num_blocks} blocks"
            )
        name = layout_hint
    else:
        candidates = [n for n in LAYOUTS if _fits(n, shape, num_blocks)]
        if not candidates:
            raise ValueError(
                f"unrecognised KV cache shape {shape} for {num_blocks} blocks; "
                f"expected one of the layouts {LAYOUTS}"
            )
        if len(candidates) > 1:
            raise ValueError(
                f"ambiguous KV cache shape {shape} for {num_blocks} blocks: it fits "
                f"{candidates}; pass the layout name explicitly"
            )
        (name,) = candidates

    if first.stride()[-1] != 1 and first.shape[-1] != 1:
        # A uint8 view of a wider dtype needs unit stride in the last dimension.
        raise ValueError(
            f"KV cache tensors must be contiguous in the last dimension, got strides "
            f"{first.stride()}"
        )
    if name == PACKED_KV_LAYOUT and _tokens_before_heads(first):
        name = PACKED_KV_NHD_LAYOUT
    if name == PACKED_KV_NHD_LAYOUT:
        shape = tuple(first.transpose(*_NHD_SWAP).shape)
    block_axis = _SHAPES[name][1]
    block_shape = shape[:block_axis] + shape[block_axis + 1 :]
    return KVLayout(
        name=name,
        num_blocks=num_blocks,
        block_axis=block_axis,
        block_shape=block_shape,
        dtype=dtype_name(first.dtype),
        layer_block_nbytes=_numel(block_shape) * first.element_size(),
    )


def _tokens_before_heads(packed: torch.Tensor) -> bool:
    """Whether a ``packed_kv`` tensor is stored tokens before heads (NHD). With
    one head or one token either order lists the same bytes: not NHD then."""
    heads, tokens = _NHD_SWAP
    return (
        packed.shape[heads] > 1
        and packed.shape[tokens] > 1
        and packed.stride(tokens) > packed.stride(heads)
    )


def _fits(name: str, shape: tuple[int, ...], num_blocks: int) -> bool:
    ndim, block_axis = _SHAPES[name]
    if len(shape) != ndim or shape[block_axis] != num_blocks:
        return False
    if name == KV_FIRST_LAYOUT:
        return shape[0] == 2
    if name == BLOCK_FIRST_LAYOUT:
        return shape[1] == 2
    return True


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def slot_rows_index(first_rows: Sequence[int], num_layers: int) -> torch.Tensor:
    """Row indices of whole snapshots: ``num_layers`` rows from each first row."""
    firsts = torch.tensor(list(first_rows), dtype=torch.long)
    return (firsts.view(-1, 1) + torch.arange(num_layers)).view(-1)


def consecutive_snapshots(first_rows: Sequence[int], num_layers: int) -> bool:
    """Whether snapshots starting at ``first_rows`` follow each other row for row
    (then their rows are one slice, and a copy needs no index)."""
    return all(
        later - earlier == num_layers
        for earlier, later in zip(first_rows, first_rows[1:], strict=False)
    )


def read_snapshot_rows(
    source: torch.Tensor, first_rows: Sequence[int], num_layers: int
) -> torch.Tensor:
    """The rows of whole snapshots starting at ``first_rows`` of ``source``, in
    order, in ``source``'s widest element type: a view when they follow each
    other, else one gather (its index queued without waiting for the device)."""
    wide = wide_view(source)
    if consecutive_snapshots(first_rows, num_layers):
        first = first_rows[0] if first_rows else 0
        return wide[first : first + len(first_rows) * num_layers]
    index = host_to_device(slot_rows_index(first_rows, num_layers), source.device)
    return wide.index_select(0, index)


def write_snapshot_rows(
    target: torch.Tensor,
    first_rows: Sequence[int],
    rows: torch.Tensor,
    num_layers: int,
) -> None:
    """Write ``rows`` (whole snapshots, in order, on ``target``'s device and of
    its width) into the snapshots starting at ``first_rows`` of ``target``: one
    slice copy when they follow each other, else one indexed copy."""
    wide = target.view(rows.dtype)  # a view, or an error: never a copy
    if consecutive_snapshots(first_rows, num_layers):
        first = first_rows[0] if first_rows else 0
        wide[first : first + len(first_rows) * num_layers].copy_(rows)
        return
    index = host_to_device(slot_rows_index(first_rows, num_layers), target.device)
    wide.index_copy_(0, index, rows)


# Past this many runs, a copy within one device gathers and scatters (two kernel
# launches) instead of copying run by run.
MAX_RUN_COPIES = 32


def snapshot_runs(
    source_first_rows: Sequence[int], target_first_rows: Sequence[int], num_layers: int
) -> list[tuple[int, int, int]]:
    """``(source row, target row, rows)`` of the longest runs of snapshots that
    follow each other on both sides, in order."""
    runs: list[tuple[int, int, int]] = []
    for source, target in zip(source_first_rows, target_first_rows, strict=True):
        if runs:
            last_source, last_target, rows = runs[-1]
            if (source, target) == (last_source + rows, last_target + rows):
                runs[-1] = (last_source, last_target, rows + num_layers)
                continue
        runs.append((source, target, num_layers))
    return runs


def copy_snapshot_rows(
    source: torch.Tensor,
    source_first_rows: Sequence[int],
    target: torch.Tensor,
    target_first_rows: Sequence[int],
    num_layers: int,
) -> None:
    """Whole snapshots from ``source`` rows to ``target`` rows of equal width, on
    any two devices: snapshot ``i`` from ``source_first_rows[i]`` to
    ``target_first_rows[i]``, queued without waiting (callers fence).

    One slice copy per run of snapshots that follow each other on both sides,
    straight from source to target: between a GPU and page-locked host memory
    each is one DMA transfer, with no temporary and no host-side copy (a
    demotion, the bulk of the write path's bytes). Many short runs within one
    device are gathered and scattered instead."""
    if len(source_first_rows) != len(target_first_rows):
        raise ValueError(
            f"{len(source_first_rows)} source snapshots for "
            f"{len(target_first_rows)} target snapshots"
        )
    if not source_first_rows:
        return
    runs = snapshot_runs(source_first_rows, target_first_rows, num_layers)
    if len(runs) > MAX_RUN_COPIES and source.device == target.device:
        rows = read_snapshot_rows(source, source_first_rows, num_layers)
        write_snapshot_rows(target, target_first_rows, rows, num_layers)
        return
    wide = wide_view(source, wide_view(target).dtype)
    into = target.view(wide.dtype)
    for source_row, target_row, count in runs:
        into[target_row : target_row + count].copy_(
            wide[source_row : source_row + count], non_blocking=True
        )
