"""Descriptor lists for one NIXL READ, and where engine blocks lie.

A READ moves a list of (local address, remote address, length) descriptors.
``plan_slab_read`` reads a chunk of leased rows into the receive slab, one
descriptor per run of consecutive holder rows; ``plan_engine_read`` reads whole
snapshots straight into engine blocks, one descriptor per contiguous piece of a
block (``EngineBlockMap``), or, where a block of every layer is one contiguous range
in the store's row order (``EngineBlockMap.whole_blocks``: vLLM's cross-layer
allocation), one descriptor per run of keys that continue each other on both sides.
Pure arithmetic on addresses: no NIXL call here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...engine.blocks import BlockPieces
from .wire import NixlRegion, _device_id, _mem_type


@dataclass(frozen=True, slots=True)
class EngineBlockMap:
    """Addresses of every (block, layer) piece of the engine's KV cache (the fields
    of ``layout.BlockPieces``), with the allocations NIXL registers for them."""

    mem_type: str
    device_id: int
    regions: tuple[NixlRegion, ...]  # the distinct allocations the layers live in
    layer_bases: tuple[int, ...]
    block_stride: int
    segment_offsets: tuple[int, ...]
    segment_nbytes: int
    num_blocks: int
    # Every block's bytes for all layers form one contiguous range in the store's
    # row order: each block of a layer one piece, layer ``l`` of a block ``l`` rows
    # after its layer 0, blocks not overlapping. vLLM's cross-layer allocation is
    # laid out so; per-layer allocations are not (unless the model has one layer).
    # A snapshot then lands with one descriptor, and keys whose holder rows and
    # engine blocks both continue each other with one descriptor per run.
    whole_blocks: bool = False

    @classmethod
    def from_layers(
        cls, layers: Sequence[torch.Tensor], block_axis: int, row_bytes: int
    ) -> EngineBlockMap:
        """Describe per-layer KV tensors whose block axis is ``block_axis``."""
        pieces = BlockPieces.of(layers, block_axis)
        nbytes = pieces.segment_nbytes * len(pieces.segment_offsets)
        if nbytes != row_bytes:
            raise ValueError(
                f"an engine block of one layer has {nbytes} bytes, the geometry says "
                f"{row_bytes}"
            )
        regions: dict[int, NixlRegion] = {}
        for tensor in layers:
            storage = tensor.untyped_storage()
            regions.setdefault(
                storage.data_ptr(),
                NixlRegion(
                    _mem_type(tensor.device),
                    storage.data_ptr(),
                    storage.nbytes(),
                    _device_id(tensor.device),
                ),
            )
        device = layers[0].device
        return cls(
            mem_type=_mem_type(device),
            device_id=_device_id(device),
            regions=tuple(regions.values()),
            layer_bases=pieces.layer_bases,
            block_stride=pieces.block_stride,
            segment_offsets=pieces.segment_offsets,
            segment_nbytes=pieces.segment_nbytes,
            num_blocks=pieces.num_blocks,
            whole_blocks=_whole_blocks(pieces),
        )


def _whole_blocks(pieces: BlockPieces) -> bool:
    """Whether every block's bytes for all layers form one contiguous range in
    the store's row order (``EngineBlockMap.whole_blocks``)."""
    seg, offsets = pieces.segment_nbytes, pieces.segment_offsets
    row = seg * len(offsets)
    if offsets != tuple(i * seg for i in range(len(offsets))):
        return False
    first = pieces.layer_bases[0]
    if any(b != first + i * row for i, b in enumerate(pieces.layer_bases)):
        return False
    return pieces.block_stride >= row * len(pieces.layer_bases)


@dataclass(frozen=True, slots=True)
class RowIndices:
    """A READ as indices into two descriptor lists NIXL prepared once (one
    descriptor per row on each side): local row ``local[i]`` <- remote row
    ``remote[i]``. NIXL joins rows that continue each other on both sides;
    ``descriptors`` is how many remain."""

    local_list: Any  # a prepared descriptor list of this agent's memory
    local: np.ndarray
    remote_list: Any  # a prepared descriptor list of the peer's memory
    remote: np.ndarray
    descriptors: int


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Matching local and remote descriptors ``(address, length, device id)`` as
    ``(n, 3)`` uint64 arrays; ``nbytes`` is their total length. Or, with ``rows``,
    row indices into prepared lists (``local`` and ``remote`` then stay empty):
    no descriptor list is built on a load's path."""

    local: np.ndarray
    remote: np.ndarray
    nbytes: int
    rows: RowIndices | None = None

    @property
    def descriptors(self) -> int:
        if self.rows is not None:
            return self.rows.descriptors
        return int(self.local.shape[0])


def _u64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def _merged_plan(
    local: np.ndarray,
    remote: np.ndarray,
    length: np.ndarray,
    local_device: int,
    remote_device: int,
) -> ReadPlan:
    """Join neighbouring descriptors that continue each other on both sides."""
    local, remote, length = local.ravel(), remote.ravel(), length.ravel()
    if local.size:
        continues = (local[:-1] + length[:-1] == local[1:]) & (
            remote[:-1] + length[:-1] == remote[1:]
        )
        starts = np.flatnonzero(np.concatenate(([True], ~continues)))
        length = np.add.reduceat(length, starts)
        local, remote = local[starts], remote[starts]
    n = local.size
    return ReadPlan(
        local=np.stack([local, length, np.full(n, local_device, np.uint64)], axis=1),
        remote=np.stack([remote, length, np.full(n, remote_device, np.uint64)], axis=1),
        nbytes=int(length.sum()),
    )


def plan_slab_read(
    first_rows: Sequence[int],
    num_layers: int,
    row_bytes: int,
    store: NixlRegion,
    slab: NixlRegion,
    first_row: int,
    num_rows: int,
) -> ReadPlan:
    """Global rows ``first_row .. first_row + num_rows - 1`` of the keys whose layer 0
    sits at ``first_rows`` in the holder's ``store``, into the slab's first bytes.

    A key's layers are consecutive holder rows, so the plan is built per key (a
    load's time is counted in microseconds; this is on its path): one descriptor
    per run of keys whose rows continue each other in the holder.
    """
    if num_rows * row_bytes > slab.nbytes:
        raise ValueError(f"{num_rows} rows do not fit a {slab.nbytes}-byte slab")
    local: list[int] = []
    remote: list[int] = []
    length: list[int] = []
    offset = 0

    def add(holder_row: int, count: int) -> None:
        nonlocal offset
        address = store.address + holder_row * row_bytes
        nbytes = count * row_bytes
        if length and remote[-1] + length[-1] == address:
            length[-1] += nbytes  # the slab side always continues
        else:
            local.append(slab.address + offset)
            remote.append(address)
            length.append(nbytes)
        offset += nbytes

    end = first_row + num_rows
    key, layer = divmod(first_row, num_layers)
    if layer:  # a chunk may start inside a key
        count = min(num_layers - layer, num_rows)
        add(first_rows[key] + layer, count)
        key += 1
    whole_end = end // num_layers
    if key < whole_end:
        # whole keys: one descriptor per run of keys stored back to back
        run_start = run_end = first_rows[key]
        for row in first_rows[key + 1 : whole_end]:
            if row != run_end + num_layers:
                add(run_start, run_end - run_start + num_layers)
                run_start = row
            run_end = row
        add(run_start, run_end - run_start + num_layers)
        key = whole_end
    if key * num_layers < end and key * num_layers >= first_row:
        add(first_rows[key], end - key * num_layers)  # a chunk may end inside one
    n = len(length)
    return ReadPlan(
        local=_u64([local, length, [slab.device_id] * n]).T.copy(),
        remote=_u64([remote, length, [store.device_id] * n]).T.copy(),
        nbytes=offset,
    )


def row_descriptors(region: NixlRegion, row_bytes: int) -> np.ndarray:
    """One ``(address, length, device id)`` descriptor per whole row of ``region``,
    for a list NIXL prepares once (``RowIndices``)."""
    rows = region.nbytes // row_bytes
    out = np.empty((rows, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(region.address) + np.arange(
        rows, dtype=np.uint64
    ) * np.uint64(row_bytes)
    out[:, 1] = row_bytes
    out[:, 2] = region.device_id
    return out


_EMPTY = np.empty((0, 3), dtype=np.uint64)


_counting = np.arange(0, dtype=np.int64)


def _first_n(n: int) -> np.ndarray:
    """``arange(n)`` as a view of one array kept across loads (never written)."""
    global _counting
    if _counting.size < n:
        _counting = np.arange(max(n, 2 * _counting.size), dtype=np.int64)
    return _counting[:n]


def plan_slab_rows(
    first_rows: Sequence[int],
    num_layers: int,
    row_bytes: int,
    first_row: int,
    num_rows: int,
    slab_list: Any,
    store_list: Any,
) -> ReadPlan:
    """``plan_slab_read``'s READ as row indices: global rows ``first_row ..
    first_row + num_rows - 1`` into slab rows ``0 .. num_rows - 1``.

    On a load's path: a handful of array operations whatever the chunk's size."""
    end = first_row + num_rows
    first_key, last_key = first_row // num_layers, (end - 1) // num_layers
    firsts = np.fromiter(
        first_rows[first_key : last_key + 1], np.int64, last_key + 1 - first_key
    )
    # every row of those keys, then the chunk's part of them
    holder = (firsts[:, None] + _first_n(num_layers)[None, :]).ravel()
    skip = first_row - first_key * num_layers
    holder = holder[skip : skip + num_rows]
    # a key that does not follow the previous one in the holder starts a descriptor
    breaks = int(np.count_nonzero(firsts[1:] - firsts[:-1] != num_layers))
    return ReadPlan(
        local=_EMPTY,
        remote=_EMPTY,
        nbytes=num_rows * row_bytes,
        rows=RowIndices(
            slab_list, _first_n(num_rows), store_list, holder, descriptors=1 + breaks
        ),
    )


def plan_engine_read(
    first_rows: Sequence[int],
    dst_blocks: Sequence[int],
    num_layers: int,
    row_bytes: int,
    store: NixlRegion,
    engine: EngineBlockMap,
) -> ReadPlan:
    """Every layer of each key straight into its engine block, piece by piece;
    pieces that continue each other on both sides are one descriptor.

    Raises ``ValueError`` unless ``dst_blocks`` names one distinct block of the
    engine per key. With ``engine.whole_blocks`` (a snapshot is one engine range),
    computed per key rather than per piece: a load's time is counted in
    microseconds, and a 64-key load of a 48-layer model would otherwise be 3,072
    pieces to merge."""
    consecutive = _check_engine_blocks(dst_blocks, len(first_rows), engine.num_blocks)
    if engine.whole_blocks and len(engine.layer_bases) == num_layers:
        return _whole_block_plan(
            first_rows, dst_blocks, consecutive, num_layers, row_bytes, store, engine
        )
    first = _u64(first_rows)[:, None, None]
    blocks = _u64(dst_blocks)[:, None, None]
    layers = np.arange(num_layers, dtype=np.uint64)[None, :, None]
    pieces = np.arange(len(engine.segment_offsets), dtype=np.uint64)[None, None, :]
    seg = np.uint64(engine.segment_nbytes)
    remote = (
        np.uint64(store.address)
        + (first + layers) * np.uint64(row_bytes)
        + pieces * seg
    )
    local = (
        _u64(engine.layer_bases)[None, :, None]
        + blocks * np.uint64(engine.block_stride)
        + _u64(engine.segment_offsets)[None, None, :]
    )
    remote, local = np.broadcast_arrays(remote, local)
    length = np.full(local.shape, seg, dtype=np.uint64)
    return _merged_plan(local, remote, length, engine.device_id, store.device_id)


def is_run(values: Sequence[int], step: int) -> bool:
    """Whether ``values`` go up by ``step`` from the first (at C speed: the
    comparison of two lists, no Python loop)."""
    if not values:
        return True
    first = values[0]
    return list(values) == list(range(first, first + len(values) * step, step))


def _check_engine_blocks(blocks: Sequence[int], num_keys: int, num_blocks: int) -> bool:
    """Raise ``ValueError`` unless ``blocks`` are ``num_keys`` distinct engine
    blocks; return whether they are consecutive (the common case, checked first:
    it needs no set)."""
    if len(blocks) != num_keys:
        raise ValueError(f"{len(blocks)} destination blocks for {num_keys} keys")
    if not blocks:
        return True
    if min(blocks) < 0 or max(blocks) >= num_blocks:
        bad = [b for b in blocks if not 0 <= b < num_blocks]
        raise ValueError(
            f"destination blocks {bad} are out of range for {num_blocks} engine "
            "blocks"
        )
    if is_run(blocks, 1):
        return True
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"duplicate destination blocks in {list(blocks)}")
    return False


def _descriptors(
    addresses: list[int], lengths: list[int], device_id: int
) -> np.ndarray:
    if len(addresses) == 1:  # a load of one run, the common case: half the cost
        one = (addresses[0], lengths[0], device_id)
        return np.array(one, dtype=np.uint64).reshape(1, 3)
    out = np.empty((len(addresses), 3), dtype=np.uint64)
    out[:, 0] = addresses
    out[:, 1] = lengths
    out[:, 2] = device_id
    return out


def _whole_block_plan(
    first_rows: Sequence[int],
    dst_blocks: Sequence[int],
    blocks_consecutive: bool,
    num_layers: int,
    row_bytes: int,
    store: NixlRegion,
    engine: EngineBlockMap,
) -> ReadPlan:
    """``plan_engine_read`` where a snapshot is one engine range: one descriptor
    per run of keys whose holder rows and engine blocks both continue each other.

    Python, not numpy: for the few to a few hundred keys of a load, numpy's
    per-call overhead costs more than this loop. A load whose keys form one run on
    both sides (the common case) skips the loop: two list comparisons."""
    snapshot = num_layers * row_bytes
    base, stride = engine.layer_bases[0], engine.block_stride
    nbytes = len(dst_blocks) * snapshot
    # consecutive blocks continue each other only when nothing lies between them
    blocks_continue = stride == snapshot
    if blocks_continue and blocks_consecutive and is_run(first_rows, num_layers):
        local = [base + dst_blocks[0] * stride]
        remote = [store.address + first_rows[0] * row_bytes]
        length = [nbytes]
    else:
        local, remote, length = [], [], []
        last_row = last_block = -2
        for row, block in zip(first_rows, dst_blocks, strict=True):
            if (
                blocks_continue
                and row == last_row + num_layers
                and block == last_block + 1
            ):
                length[-1] += snapshot
            else:
                local.append(base + block * stride)
                remote.append(store.address + row * row_bytes)
                length.append(snapshot)
            last_row, last_block = row, block
    return ReadPlan(
        local=_descriptors(local, length, engine.device_id),
        remote=_descriptors(remote, length, store.device_id),
        nbytes=nbytes,
    )
