"""Many device-to-device copies queued with one driver call: CUDA's batched memcpy.

Why: a load through the receive slab ends by writing each of its rows into an engine
block of one layer. With per-layer allocations (vLLM's default on a GPU) that is a
piece per (key, layer): through torch it takes the ids' copy to the device, an index
computation and an ``index_copy_``, each a call with its own launch cost, and on the
lent hosts each of those costs 5-10 us of Python and driver time. The driver's
``cuMemcpyBatchAsync`` (CUDA 12.8 and later) takes the addresses from host arrays
instead: the pieces' addresses are arithmetic on the host (``numpy``), and one call
queues every copy of the chunk on the stream. Nothing is copied to the device first.

The batch is stream-ordered like any copy (``srcAccessOrder`` STREAM): it runs after
the work queued before it on the stream and before the work queued after it, so a
``DeviceWorkMark`` recorded afterwards covers it. (On torch's default stream, the
legacy one, which batches refuse, it goes to the per-thread default stream, which
is ordered with the legacy stream both ways.) Copies within one batch may run in
any order; the pieces of a chunk never overlap.

Reached through ``ctypes`` on the driver library that torch has already loaded,
with the entry point of the CUDA version the driver implements: ``_v2`` (CUDA 13,
without the failure index) where the driver exports it, else the CUDA 12.8 one.
``BatchCopier.open`` returns None (callers keep their torch path) unless the
driver has the call and a test copy on the device moved the right bytes.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# cuda.h: CUmemcpySrcAccessOrder, CUmemLocationType
_SRC_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE = 1
# cuda.h: CU_STREAM_PER_THREAD. Batched copies refuse the legacy default stream
# (handle 0, torch's default); the per-thread default stream is ordered with it
# both ways (it is a blocking stream), so a batch queued there still runs after
# the work torch queued before it and before the work queued after it.
_STREAM_PER_THREAD = 0x2


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_U64_ARRAY = np.ctypeslib.ndpointer(dtype=np.uint64, flags="C_CONTIGUOUS")


class BatchCopier:
    """Queues batches of device-to-device copies on one CUDA device."""

    def __init__(self, function: Any, with_fail_index: bool, device: int) -> None:
        self._function = function
        self._with_fail_index = with_fail_index
        location = _MemLocation(_LOCATION_DEVICE, device)
        self._attributes = _MemcpyAttributes(
            _SRC_ACCESS_ORDER_STREAM, location, location, 0
        )
        self._attribute_starts = (ctypes.c_size_t * 1)(0)  # one set for every copy
        self._fail_index = ctypes.c_size_t(0)
        self.device = torch.device("cuda", device)

    @classmethod
    def open(cls, device: torch.device) -> BatchCopier | None:
        """A copier for ``device``, or None where the driver cannot batch copies
        (or a test copy came out wrong: then we say why in the log)."""
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else 0
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        for name, with_fail_index in (
            ("cuMemcpyBatchAsync_v2", False),
            ("cuMemcpyBatchAsync", True),
        ):
            function = getattr(driver, name, None)
            if function is None:
                continue
            arguments = [_U64_ARRAY, _U64_ARRAY, _U64_ARRAY, ctypes.c_size_t]
            arguments += [ctypes.POINTER(_MemcpyAttributes)]
            arguments += [ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
            if with_fail_index:
                arguments += [ctypes.POINTER(ctypes.c_size_t)]
            function.argtypes = arguments + [ctypes.c_void_p]
            function.restype = ctypes.c_int
            copier = cls(function, with_fail_index, index)
            try:
                copier._self_test()
            except (RuntimeError, OSError) as exc:
                logger.warning(
                    "CUDA batched copies (%s) failed their test on %s, not used: %s",
                    name,
                    device,
                    exc,
                )
                return None
            return copier
        return None

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        """Queue ``sizes[i]`` bytes from device address ``srcs[i]`` to ``dsts[i]``
        for every ``i`` (``uint64`` arrays, contiguous; ranges must not overlap)
        on the current stream."""
        count = len(sizes)
        if count == 0:
            return
        stream = (
            torch.cuda.current_stream(self.device).cuda_stream or _STREAM_PER_THREAD
        )
        extra: tuple[Any, ...] = (
            (ctypes.byref(self._fail_index),) if self._with_fail_index else ()
        )
        status = self._function(
            dsts,
            srcs,
            sizes,
            count,
            ctypes.byref(self._attributes),
            self._attribute_starts,
            1,
            *extra,
            ctypes.c_void_p(stream),
        )
        if status != 0:
            raise RuntimeError(
                f"cuMemcpyBatchAsync of {count} copies failed with CUresult {status}"
            )

    def _self_test(self) -> None:
        """Two pieces, swapped, between two small tensors: the bytes must land
        where the addresses say."""
        with torch.cuda.device(self.device):
            source = torch.arange(256, dtype=torch.uint8, device=self.device)
            target = torch.zeros(256, dtype=torch.uint8, device=self.device)
            s, t = source.data_ptr(), target.data_ptr()
            self.copy(
                np.array([t + 128, t], dtype=np.uint64),
                np.array([s, s + 128], dtype=np.uint64),
                np.array([128, 128], dtype=np.uint64),
            )
            torch.cuda.synchronize(self.device)
            if not torch.equal(target, source.roll(128)):
                raise RuntimeError("a test batch moved the wrong bytes")


class BatchScatter:
    """Rows into engine blocks as one batch of copies per chunk: a copy per piece
    of each row, from the row's bytes to the piece's place in its layer's block,
    every address computed on the host. Piece ``s`` of block ``b`` in layer ``l``
    starts at ``layer_bases[l] + b * block_stride + segment_offsets[s]`` and is
    ``segment_nbytes`` long; a row is its pieces in order (``blocks.BlockPieces``)."""

    def __init__(
        self,
        copier: BatchCopier,
        layer_bases: Sequence[int],
        block_stride: int,
        segment_offsets: Sequence[int],
        segment_nbytes: int,
    ) -> None:
        self._copier = copier
        self._segment = segment_nbytes
        self._per_row = len(segment_offsets)
        self._block_stride = np.uint64(block_stride)
        # (layers, pieces per row): where each piece of block 0 starts
        self._targets = np.array(
            [[base + o for o in segment_offsets] for base in layer_bases],
            dtype=np.uint64,
        )
        self._offsets = np.zeros(0, dtype=np.uint64)
        self._sizes = np.zeros(0, dtype=np.uint64)

    def scatter(self, first_row: int, ids: Sequence[int], rows: torch.Tensor) -> None:
        """Global rows ``first_row ..`` (``rows``: ``(n, R)`` uint8 on the device)
        into blocks ``ids`` (checked: the blocks of keys ``first_row // layers``
        onwards) of their layers; queued on the current stream."""
        num_layers = self._targets.shape[0]
        rows = rows.contiguous()
        n = rows.shape[0]
        blocks = np.asarray(ids, dtype=np.uint64) * self._block_stride
        if first_row % num_layers == 0 and n % num_layers == 0:
            # whole snapshots: every layer's pieces, key after key
            dsts = (blocks[:, None, None] + self._targets[None]).ravel()
        else:
            position = np.arange(first_row, first_row + n)
            keys = position // num_layers - first_row // num_layers
            dsts = (
                blocks[keys][:, None] + self._targets[position % num_layers]
            ).ravel()
        count = n * self._per_row
        if self._offsets.size < count:
            self._offsets = np.arange(count, dtype=np.uint64) * np.uint64(self._segment)
            self._sizes = np.full(count, self._segment, dtype=np.uint64)
        srcs = np.uint64(rows.data_ptr()) + self._offsets[:count]
        self._copier.copy(dsts, srcs, self._sizes[:count])
