"""The engine's KV cache as rows of whole blocks: gather, scatter, and where the
bytes lie.

``BlockMajorCache`` holds integer views of vLLM's per-layer tensors (no copy) and
moves whole blocks along the block axis, so a block of one layer is one ``uint8`` row
of ``layout.layer_block_nbytes`` bytes whatever the layout (``layout.py`` names the
layouts and their row order). A chunk of whole snapshots is written with one copy
when the layers allow it: ``stacked`` (equally spaced views of one storage, as vLLM
allocates on CPU), ``span`` (every block piece a whole number of pieces from the
lowest layer: per-layer allocations on a GPU, or vLLM's cross-layer allocation),
else one copy per layer.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..wire import KVGeometry
from .device import PinnedIds, host_to_device
from .layout import (
    WIDE_DTYPES,
    KVLayout,
    consecutive_snapshots,
    dtype_name,
    wide_view,
    write_snapshot_rows,
)
from .scatter_graphs import ScatterGraphs


class BlockDestinations:
    """A load's destination blocks, checked once (in range, no repeats) by
    ``BlockMajorCache.destinations`` and put on the cache's device at most once,
    when a chunk first needs them there (``index``): a ``scatter_rows`` of each
    chunk then neither checks nor copies them again. A chunk replayed as a CUDA
    graph takes its ids from ``ids`` and never needs ``index``."""

    __slots__ = ("ids", "_stage", "_index")

    def __init__(
        self, ids: tuple[int, ...], stage: Callable[[Sequence[int]], torch.Tensor]
    ) -> None:
        self.ids = ids
        self._stage = stage
        self._index: torch.Tensor | None = None

    @property
    def index(self) -> torch.Tensor:
        """The ids as a 1-D ``torch.long`` tensor on the cache's device."""
        if self._index is None:
            self._index = self._stage(self.ids)
        return self._index


class BlockMajorCache:
    """The engine's per-layer KV tensors, addressed as rows of whole blocks.

    Holds integer views of the engine tensors (no copy; the widest integer type the
    layout allows, see ``wide_view``), so ``scatter`` writes through to the engine's
    memory. Rows in and out are ``uint8``. Works for any strides whose last dimension
    is contiguous, including the non-contiguous per-layer views of ``kv_first``.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        layout: KVLayout,
        *,
        scatter_graphs: bool = False,
    ) -> None:
        if not tensors:
            raise ValueError("no KV cache tensors")
        self.layout = layout
        # The layers with their per-block axes in row order (``KVLayout.row_view``),
        # in the engine's dtype: what a transport that places rows itself addresses.
        self.row_layers = [layout.row_view(t) for t in tensors]
        # Integer views: only the last dimension changes length; the block axis and
        # every other axis keep their meaning. One element type for every layer.
        widths = [wide_view(t).element_size() for t in self.row_layers]
        self._element = next(d for d in WIDE_DTYPES if d.itemsize == min(widths))
        self._layers = [t.view(self._element) for t in self.row_layers]
        expected = (
            layout.block_shape[: layout.block_axis]
            + (layout.num_blocks,)
            + layout.block_shape[layout.block_axis :]
        )
        for layer, tensor in enumerate(self.row_layers):
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"KV cache layer {layer} has shape {tuple(tensor.shape)}, the "
                    f"layout says {expected}"
                )
            if dtype_name(tensor.dtype) != layout.dtype:
                raise ValueError(
                    f"KV cache layer {layer} is {tensor.dtype}, the layout says "
                    f"{layout.dtype}"
                )
        self.device = tensors[0].device
        # The per-block shape in those elements, for reshaping rows back into blocks.
        self._element_block_shape = tuple(
            s for i, s in enumerate(self._layers[0].shape) if i != layout.block_axis
        )
        # Destination block ids reach the device through pinned buffers, without a
        # blocking copy (``destinations``).
        self._pinned_ids = (
            PinnedIds(self.device) if self.device.type == "cuda" else None
        )
        # Every layer as one tensor, when the engine allocated them as equally
        # spaced views of one storage (vLLM on CPU does): then ``scatter_rows``
        # writes a chunk of whole snapshots with one copy instead of one per layer,
        # which is what a GPU load's time is made of (each copy is a kernel launch).
        # Otherwise (vLLM on a GPU allocates each layer on its own) every block
        # piece as a row of one view over the layers' address range, if their
        # addresses allow it: one index computation and one copy per chunk.
        self._stacked = _stacked_layers(self._layers)
        self._span = (
            None
            if self._stacked is not None
            else _PieceSpan.build(self._layers, layout.block_axis, self._element)
        )
        # With ``scatter_graphs``, on a GPU: a chunk's span scatter replayed as one
        # CUDA graph (the ids copy, the row arithmetic and the copy in one launch)
        # once its shape repeats.
        self.scatter_graphs = (
            ScatterGraphs(self._span.scatter, self.device)
            if scatter_graphs and self._span is not None and self.device.type == "cuda"
            else None
        )

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def scatter_path(self) -> str:
        """How ``scatter_rows`` writes a chunk of whole snapshots: ``stacked`` or
        ``span`` (one copy), or ``per layer``."""
        if self._stacked is not None:
            return "stacked"
        return "span" if self._span is not None else "per layer"

    @property
    def geometry(self) -> KVGeometry:
        return self.layout.geometry(self.num_layers)

    def layer_bytes(self, layer: int) -> torch.Tensor:
        """One layer as ``uint8`` in the engine's layout (a view: shared memory)."""
        return self._layers[layer].view(torch.uint8)

    def gather(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` of ``layer`` as a new contiguous ``(n, R)`` uint8."""
        index = self._check_index(block_ids)
        axis = self.layout.block_axis
        picked = self._layers[layer].index_select(axis, index)
        if axis != 0:
            picked = picked.movedim(axis, 0)
        per_row = self.layout.layer_block_nbytes // self._element.itemsize
        return picked.reshape(index.numel(), per_row).view(torch.uint8)

    def gather_snapshots(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Whole snapshots of blocks ``block_ids``: ``(n * L, R)`` uint8 rows on
        the cache's device, row ``i * L + l`` being layer ``l`` of ``block_ids[i]``.

        The counterpart of ``scatter_rows`` for whole snapshots, by the same path:
        one gather through the piece span or the stacked view, else one per layer
        (each a kernel launch on a GPU, and staging runs on the engine's thread).
        """
        index = self._check_index(block_ids)
        n, num_layers = index.numel(), self.num_layers
        row_nbytes = self.layout.layer_block_nbytes
        if self._span is not None:
            picked = self._span.gather(index)
        elif self._stacked is not None:
            axis = self.layout.block_axis
            # (L, ..., n, ...) -> (n, L, ...): each layer's block in its own order
            picked = self._stacked.index_select(axis + 1, index).movedim(axis + 1, 0)
        else:
            picked = torch.stack(
                [self.gather(layer, index) for layer in range(num_layers)], dim=1
            )
        return picked.reshape(n * num_layers, -1).view(torch.uint8).view(-1, row_nbytes)

    def copy_blocks_to_rows(
        self, block_ids: torch.Tensor, rows: torch.Tensor, first_rows: Sequence[int]
    ) -> None:
        """Copy every layer of blocks ``block_ids`` into snapshot rows: layer ``l``
        of ``block_ids[i]`` to ``rows[first_rows[i] + l]`` (``rows`` uint8, maybe on
        another device). Copies are queued on the current stream: one gather
        (``gather_snapshots``) and one copy where the layout allows, or, into rows
        on the cache's device that follow each other (the staging ring's usual
        case) through the piece span, one gather straight into them: no
        temporary as large as the copy on the engine's device, outside vLLM's
        memory budget, and half the bytes moved."""
        if self._gathers_into(rows, first_rows):
            self._gather_into(self._check_index(block_ids), rows, first_rows)
            return
        snapshots = self.gather_snapshots(block_ids).to(rows.device)
        # The staging ring's slots usually follow each other: then one slice copy.
        write_snapshot_rows(
            rows,
            first_rows,
            wide_view(snapshots, wide_view(rows).dtype),
            self.num_layers,
        )

    def copy_listed_blocks_to_rows(
        self, block_ids: Sequence[int], rows: torch.Tensor, first_rows: Sequence[int]
    ) -> None:
        """``copy_blocks_to_rows`` for ids given as a list (the staging ring's,
        on the engine's thread at every step that fills blocks): checked as a
        list and, on a GPU, put on the device through a pinned buffer kept for
        it, with no tensor made and read back on the host first."""
        ids = [int(b) for b in block_ids]
        if self._gathers_into(rows, first_rows):
            self._check_ids(ids, unique=False)
            self._gather_into(self._stage_ids(ids), rows, first_rows)
            return
        self.copy_blocks_to_rows(torch.tensor(ids, dtype=torch.long), rows, first_rows)

    def _gathers_into(self, rows: torch.Tensor, first_rows: Sequence[int]) -> bool:
        """Whether ``rows`` at ``first_rows`` take one gather straight into them."""
        return (
            self._span is not None
            and rows.device == self.device
            and rows.is_contiguous()
            and consecutive_snapshots(first_rows, self.num_layers)
        )

    def _gather_into(
        self, index: torch.Tensor, rows: torch.Tensor, first_rows: Sequence[int]
    ) -> None:
        assert self._span is not None
        first = first_rows[0] if first_rows else 0
        count = len(first_rows) * self.num_layers
        self._span.gather_into(index, rows[first : first + count])

    def scatter(self, layer: int, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` ``(n, R)`` uint8 into blocks ``block_ids`` of ``layer``.

        ``rows`` may live on another device; it is copied to the cache's device.
        """
        index = self._check_index(block_ids, unique=True)
        n = index.numel()
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (
            n,
            self.layout.layer_block_nbytes,
        ):
            raise ValueError(
                f"rows must be uint8 ({n}, {self.layout.layer_block_nbytes}), got "
                f"{rows.dtype} {tuple(rows.shape)}"
            )
        if n == 0:
            return
        self._scatter_layer(layer, index, rows.to(self.device))

    def _scatter_layer(
        self, layer: int, index: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """``scatter`` without checks: ``index`` is valid and on the cache's device."""
        elements = wide_view(rows, self._element)
        blocks = elements.reshape((index.numel(),) + self._element_block_shape)
        axis = self.layout.block_axis
        if axis != 0:
            blocks = blocks.movedim(0, axis)
        self._layers[layer].index_copy_(axis, index, blocks)

    def destinations(self, block_ids: Sequence[int]) -> BlockDestinations:
        """``block_ids`` checked (in range, no repeats) once, for every
        ``scatter_rows`` of a load, and put on the device when a chunk first
        needs them there. On a GPU the ids go through a pinned buffer with a copy
        that does not block (no stream synchronisation); the scatters queued after
        it on the same stream see them."""
        ids = tuple(int(b) for b in block_ids)
        self._check_ids(ids, unique=True)
        return BlockDestinations(ids, self._stage_ids)

    def _stage_ids(self, ids: Sequence[int]) -> torch.Tensor:
        if self._pinned_ids is not None:
            return self._pinned_ids.to_device(ids)
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def scatter_rows(
        self,
        first_row: int,
        rows: torch.Tensor,
        destinations: torch.Tensor | BlockDestinations,
    ) -> None:
        """Write consecutive global rows into engine blocks.

        Global row ``r`` is layer ``r % num_layers`` of the ``r // num_layers``-th
        snapshot, whose engine block is ``destinations[r // num_layers]``; ``rows``
        ``(n, R)`` uint8 holds rows ``first_row .. first_row + n - 1`` (a transfer
        chunk). ``BlockDestinations`` were checked once per load and reach the
        device at most once; a tensor of ids is checked and copied to the device
        per call (a blocking copy on a GPU). A chunk of whole snapshots is one
        copy in stacked layers or over the piece span (on a GPU, with
        ``BlockDestinations`` and rows already there, a CUDA graph replay once the
        chunk's shape repeats), anything else one per layer.
        """
        num_layers, n = self.num_layers, rows.shape[0]
        if rows.dtype != torch.uint8 or rows.dim() != 2:
            raise ValueError(f"rows must be 2-D uint8, got {rows.dtype} {rows.shape}")
        if rows.shape[1] != self.layout.layer_block_nbytes:
            raise ValueError(
                f"rows must be {self.layout.layer_block_nbytes} bytes, got "
                f"{rows.shape[1]}"
            )
        if n == 0:
            return
        first_key = first_row // num_layers
        last_key = (first_row + n - 1) // num_layers
        if isinstance(destinations, BlockDestinations):
            count = len(destinations.ids)
        else:
            count = destinations.numel()
        if first_row < 0 or last_key >= count:
            raise ValueError(
                f"rows {first_row}..{first_row + n - 1} need destinations for keys "
                f"{first_key}..{last_key}, got {count} destinations"
            )
        whole = first_row % num_layers == 0 and n % num_layers == 0
        if isinstance(destinations, BlockDestinations):
            if whole and self._replay(destinations.ids[first_key : last_key + 1], rows):
                return
            index = destinations.index[first_key : last_key + 1]
        else:
            # One host-to-device copy of the ids per chunk.
            index = self._check_index(
                destinations[first_key : last_key + 1], unique=True
            )
        rows = rows.to(self.device)
        if whole:
            self._scatter_snapshots(index, rows)
            return
        for layer in range(num_layers):
            # Rows of this layer: every num_layers-th row from the first one.
            offset = (layer - first_row) % num_layers
            if offset >= n:
                continue
            key = (first_row + offset) // num_layers - first_key
            count = len(range(offset, n, num_layers))
            self._scatter_layer(
                layer, index[key : key + count], rows[offset::num_layers]
            )

    def _replay(self, ids: Sequence[int], rows: torch.Tensor) -> bool:
        """Whole snapshots ``rows`` (already on the device) into blocks ``ids``
        as a CUDA graph replay; False when the chunk must be scattered eagerly."""
        graphs = self.scatter_graphs
        return (
            graphs is not None
            and rows.device == self.device
            and graphs.scatter(ids, rows)
        )

    def _scatter_snapshots(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole snapshots ``(keys * L, R)`` into blocks ``index`` of every layer:
        one copy through the piece span or the stacked view, else one per layer
        (each copy is a kernel launch on a GPU)."""
        if self._span is not None:
            self._span.scatter(index, rows)
            return
        keys, num_layers = index.numel(), self.num_layers
        elements = wide_view(rows, self._element)
        blocks = elements.reshape((keys, num_layers) + self._element_block_shape)
        blocks = blocks.movedim(0, 1)  # (L, keys, *block)
        axis = self.layout.block_axis
        if axis != 0:
            blocks = blocks.movedim(1, axis + 1)
        if self._stacked is not None:
            self._stacked.index_copy_(axis + 1, index, blocks)
            return
        for layer, source in zip(self._layers, blocks.unbind(0), strict=True):
            layer.index_copy_(axis, index, source)

    def _check_index(
        self, block_ids: torch.Tensor, unique: bool = False
    ) -> torch.Tensor:
        """``block_ids`` checked (in range; ``unique``: no repeats) and on the
        cache's device. Checked as a Python list: a handful of ids, and tensor
        reductions cost more than that on a load's path."""
        if block_ids.dtype != torch.long or block_ids.dim() != 1:
            raise ValueError(
                f"block ids must be a 1-D torch.long tensor, got {block_ids.dtype} "
                f"with shape {tuple(block_ids.shape)}"
            )
        self._check_ids(block_ids.tolist(), unique)
        return host_to_device(block_ids, self.device)

    def _check_ids(self, ids: Sequence[int], unique: bool) -> None:
        """Every id in range; with ``unique``, none repeated (index_copy_ with
        repeated indices keeps an unspecified one of them)."""
        if ids:
            low, high = min(ids), max(ids)
            if low < 0 or high >= self.layout.num_blocks:
                bad = low if low < 0 else high
                raise IndexError(
                    f"block id {bad} is out of range for {self.layout.num_blocks} "
                    "KV cache blocks"
                )
        if unique and len(set(ids)) != len(ids):
            raise ValueError(f"duplicate destination blocks in {ids}")


def _stacked_layers(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``(L, *layer shape)`` over the layers' memory, or None unless the layers are
    same-shaped views of one storage, equally spaced and not overlapping."""
    first = layers[0]
    shape, strides = tuple(first.shape), first.stride()
    if any(s < 0 for s in strides):
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    step = (
        layers[1].storage_offset() - first.storage_offset()
        if len(layers) > 1
        else extent
    )
    if step < extent:
        return None
    storage = first.untyped_storage().data_ptr()
    for i, layer in enumerate(layers):
        if (
            layer.untyped_storage().data_ptr() != storage
            or tuple(layer.shape) != shape
            or layer.stride() != strides
            or layer.dtype != first.dtype
            or layer.storage_offset() != first.storage_offset() + i * step
        ):
            return None
    return first.as_strided(
        (len(layers),) + shape, (step,) + tuple(strides), first.storage_offset()
    )


def _contiguous_pieces(block: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """Byte offsets (from ``block``'s start, in row-major order of its elements) of
    the contiguous pieces of a ``uint8`` view, and the length of each piece."""
    shape, strides = block.shape, block.stride()
    dense = 1
    split = len(shape)
    # The trailing dimensions that are laid out densely form one piece.
    while split > 0 and (strides[split - 1] == dense or shape[split - 1] == 1):
        dense *= shape[split - 1]
        split -= 1
    lead_shape, lead_strides = shape[:split], strides[:split]
    offsets = tuple(
        sum(i * s for i, s in zip(index, lead_strides, strict=True))
        for index in itertools.product(*(range(n) for n in lead_shape))
    )
    return offsets, dense


@dataclass(frozen=True, slots=True)
class BlockPieces:
    """Where the blocks of per-layer KV tensors lie, piece by piece.

    Piece ``s`` of block ``b`` in layer ``l`` starts at byte address
    ``layer_bases[l] + b * block_stride + segment_offsets[s]`` and is
    ``segment_nbytes`` long; a row is the pieces in order. One piece per block in
    block-major layouts, two (K, V) in the K/V-first layout. ``layer_extent``: the
    bytes from a layer's first to one past its last.
    """

    layer_bases: tuple[int, ...]
    block_stride: int
    segment_offsets: tuple[int, ...]
    segment_nbytes: int
    num_blocks: int
    layer_extent: int

    @classmethod
    def of(cls, layers: Sequence[torch.Tensor], block_axis: int) -> BlockPieces:
        """Describe ``layers`` (any dtype) whose block axis is ``block_axis``;
        ValueError unless they are laid out alike on one device."""
        if not layers:
            raise ValueError("no KV cache layers to describe")
        byte_layers = [
            t if t.dtype == torch.uint8 else t.view(torch.uint8) for t in layers
        ]
        first = byte_layers[0]
        for layer, tensor in enumerate(byte_layers):
            if tensor.shape != first.shape or tensor.stride() != first.stride():
                raise ValueError(
                    f"KV cache layer {layer} has shape {tuple(tensor.shape)} and "
                    f"strides {tensor.stride()}, layer 0 {tuple(first.shape)} and "
                    f"{first.stride()}: layers must be laid out alike"
                )
            if tensor.device != first.device:
                raise ValueError("KV cache layers must be on one device")
        offsets, segment = _contiguous_pieces(first.select(block_axis, 0))
        return cls(
            layer_bases=tuple(t.data_ptr() for t in byte_layers),
            block_stride=first.stride(block_axis),
            segment_offsets=offsets,
            segment_nbytes=segment,
            num_blocks=first.shape[block_axis],
            layer_extent=1
            + sum(
                (n - 1) * s for n, s in zip(first.shape, first.stride(), strict=True)
            ),
        )


class _PieceSpan:
    """Every block piece of every layer as a row of one 2-D view.

    A piece is a contiguous run of a block's bytes in one layer (``BlockPieces``).
    When every piece starts a whole number of pieces after the lowest layer's start,
    the address range from there to the end of the highest layer can be viewed as
    ``(units, piece)``, and a chunk of whole snapshots is written with one
    ``index_copy_`` whose row indices one broadcast addition computes on the device.
    The view spans memory between the layers that is not ours: only rows computed
    from checked block ids are written, and the layers are checked either not to
    overlap (one allocation per layer) or to interleave block by block (one
    allocation for all layers) without two pieces sharing a row.
    """

    def __init__(
        self, span: torch.Tensor, piece_rows: torch.Tensor, block_step: int
    ) -> None:
        self._span = span  # (units, piece elements)
        self._piece_rows = piece_rows  # (layers, pieces per block): rows of block 0
        self._block_step = block_step  # rows from one block to the next

    @classmethod
    def build(
        cls, layers: Sequence[torch.Tensor], block_axis: int, element: torch.dtype
    ) -> _PieceSpan | None:
        """The span over ``layers`` (same shape, in ``element``), or None when
        they are laid out differently or their addresses do not fall on whole
        pieces."""
        if min(layers[0].stride()) < 0:
            return None
        try:
            pieces = BlockPieces.of(layers, block_axis)
        except ValueError:
            return None
        piece, bases = pieces.segment_nbytes, pieces.layer_bases
        low = min(bases)
        if piece % element.itemsize or any(
            x % piece
            for x in (
                pieces.block_stride,
                *pieces.segment_offsets,
                *(b - low for b in bases),
            )
        ):
            return None
        ordered = sorted(bases)
        first_rows = [
            (b + o - low) // piece for b in bases for o in pieces.segment_offsets
        ]
        apart = all(
            b - a >= pieces.layer_extent
            for a, b in zip(ordered, ordered[1:], strict=False)
        )
        # Layers interleaved block by block (vLLM's cross-layer allocation): every
        # row of block 0 distinct and inside one block stride, so block b's rows
        # are block 0's shifted by b strides and no row belongs to two pieces.
        interleaved = (
            len(set(first_rows)) == len(first_rows)
            and max(first_rows) < pieces.block_stride // piece
        )
        if not (apart or interleaved):
            return None  # overlapping layers: a row could belong to two of them
        units = (ordered[-1] + pieces.layer_extent - low) // piece
        device = layers[0].device
        span = _raw_bytes(low, units * piece, device)
        piece_rows = torch.tensor(first_rows, dtype=torch.long, device=device).view(
            len(bases), len(pieces.segment_offsets)
        )
        return cls(
            span.view(element).view(units, piece // element.itemsize),
            piece_rows,
            pieces.block_stride // piece,
        )

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Whole snapshots of blocks ``index`` (checked, on the device), in the
        span's element type: ``(keys, L * R / element size)``, layers in order."""
        sources = torch.add(
            self._piece_rows, index.view(-1, 1, 1), alpha=self._block_step
        )
        return self._span.index_select(0, sources.view(-1)).view(index.numel(), -1)

    def gather_into(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """``gather`` written into ``rows`` ``(keys * L, R)`` uint8 (contiguous,
        on the device) instead of a new tensor."""
        sources = torch.add(
            self._piece_rows, index.view(-1, 1, 1), alpha=self._block_step
        )
        # a view (never wide_view's copy): the gather must land in ``rows``
        out = rows.view(self._span.dtype).view(-1, self._span.shape[1])
        torch.index_select(self._span, 0, sources.view(-1), out=out)

    def scatter(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole snapshots ``rows`` ``(keys * L, R)`` uint8 into blocks ``index``
        (checked, on the device) of every layer."""
        targets = torch.add(
            self._piece_rows, index.view(-1, 1, 1), alpha=self._block_step
        )
        source = wide_view(rows, self._span.dtype).reshape(-1, self._span.shape[1])
        self._span.index_copy_(0, targets.view(-1), source)


class _CudaBytes:
    """``__cuda_array_interface__`` of a device address range, for ``as_tensor``."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def _raw_bytes(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A ``uint8`` tensor over memory that something else owns (no copy)."""
    if device.type == "cuda":
        return torch.as_tensor(_CudaBytes(address, nbytes), device=device)
    if device.type == "cpu":
        buffer: Any = (ctypes.c_uint8 * nbytes).from_address(address)
        return torch.frombuffer(buffer, dtype=torch.uint8)
    raise ValueError(f"cannot view raw memory on {device}")
