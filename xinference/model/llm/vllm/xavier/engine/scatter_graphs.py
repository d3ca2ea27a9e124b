"""A chunk's scatter into engine blocks as one CUDA graph replay.

Writing a chunk of loaded snapshots into per-layer engine caches (the piece span in
``blocks.py``) is three kernels: the destination ids copied to the device, the row
arithmetic, one ``index_copy_``. On the lent H200 hosts the Python and torch calls
around those kernels took 100-200 us of a 200-400 us slab load; the kernels
themselves take a few. Captured once per shape, the same kernels are one
``replay``: the chunk's ids are written into a pinned buffer that the graph's first
node copies from, and nothing else runs on the host.

A graph bakes in every address it touches: the pinned ids, the device ids, the
source rows and the engine's layers. The layers live as long as the cache; the ids
buffers as long as this object; the source rows are part of the shape key, so a
chunk from another buffer gets its own graph. A shape is captured the second time
it is seen: the first chunk runs eagerly, which also loads the kernels that the
capture needs, and one-off shapes never pay a capture.

Off unless ``XAVIER_SCATTER_GRAPHS=1``: written and tested without a GPU at hand,
it stays opt-in until its CUDA tests and the scatter benchmark have run on one.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .device import DeviceWorkMark

logger = logging.getLogger(__name__)

# "1": transfer actors replay repeated scatters as CUDA graphs; "0" (the default):
# every chunk scatters eagerly.
GRAPHS_ENV = "XAVIER_SCATTER_GRAPHS"


def graphs_requested() -> bool:
    """Whether ``XAVIER_SCATTER_GRAPHS`` asks for scatter graphs."""
    text = os.environ.get(GRAPHS_ENV, "0").strip()
    if text not in ("0", "1"):
        raise ValueError(f"{GRAPHS_ENV} must be 0 or 1, got {text!r}")
    return text == "1"


# What a graph captures: scatter(index on the device, source rows).
ScatterKernel = Callable[[torch.Tensor, torch.Tensor], None]

# A shape: (source address, source shape, source strides, keys).
_Shape = tuple[int, tuple[int, ...], tuple[int, ...], int]

# Graphs kept (least recently replayed dropped first). A load through the receive
# slab has one source buffer and at most a few chunk sizes; the bound is for loads
# whose key counts vary widely.
MAX_GRAPHS = 64
# The most keys one chunk may have to be replayed (its ids buffers' size); a
# larger chunk runs eagerly. The receive slab's chunks are 64 keys of
# Qwen2.5-0.5B.
MAX_KEYS = 1024


class ScatterGraphs:
    """Replays of ``kernel(index, rows)`` captured as CUDA graphs, one per shape.

    Not thread-safe: one thread (the transfer actor's event loop) scatters.
    """

    def __init__(
        self,
        kernel: ScatterKernel,
        device: torch.device,
        *,
        max_graphs: int = MAX_GRAPHS,
        max_keys: int = MAX_KEYS,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        if max_graphs < 1 or max_keys < 1:
            raise ValueError("max_graphs and max_keys must be at least 1")
        self.device = device
        self._kernel = kernel
        self._max_graphs = max_graphs
        self._max_keys = max_keys
        # The ids buffers every graph reads, made at the first capture (a cache
        # that never replays, such as the engine process's, never allocates them).
        self._host_ids: torch.Tensor | None = None
        self._device_ids: torch.Tensor | None = None
        self._host_view: Any = None
        # The last replay has read the pinned ids: only then may they be rewritten.
        self._replayed = DeviceWorkMark(device)
        self._graphs: OrderedDict[_Shape, Any] = OrderedDict()
        self._seen: OrderedDict[_Shape, None] = OrderedDict()
        self._pool: Any = None  # one memory pool for every graph's temporaries
        self._disabled: str | None = None
        self.captures = 0
        self.replays = 0

    @property
    def kernel(self) -> ScatterKernel:
        """What each graph replays (the eager scatter)."""
        return self._kernel

    def __len__(self) -> int:
        """Graphs kept."""
        return len(self._graphs)

    @property
    def disabled(self) -> str | None:
        """Why chunks no longer replay (a capture failed), or None."""
        return self._disabled

    def summary(self) -> str:
        """Captures and replays so far, for logs and benchmark reports."""
        text = f"{self.captures} graphs captured, {self.replays} replays"
        return text if self._disabled is None else f"{text}; off: {self._disabled}"

    def scatter(self, ids: Sequence[int], rows: torch.Tensor) -> bool:
        """Queue ``kernel`` over ``ids`` and ``rows`` (on the device) as a replay
        on the current stream; False when the caller must run it eagerly: the
        shape's first sight, too many keys, or graphs disabled after a failure.

        ``ids`` must already be checked: the graph writes wherever they point.
        """
        n = len(ids)
        if self._disabled is not None or not 0 < n <= self._max_keys:
            return False
        shape: _Shape = (rows.data_ptr(), tuple(rows.shape), rows.stride(), n)
        graph = self._graphs.get(shape)
        if graph is None:
            if shape not in self._seen:
                self._remember(shape)
                return False
            graph = self._capture(shape, rows)
            if graph is None:
                return False
        else:
            self._graphs.move_to_end(shape)
        self._replayed.wait()
        self._host_view[:n] = ids
        graph.replay()
        self._replayed.mark()
        self.replays += 1
        return True

    def _remember(self, shape: _Shape) -> None:
        self._seen[shape] = None
        if len(self._seen) > 4 * self._max_graphs:
            self._seen.popitem(last=False)

    def _capture(self, shape: _Shape, rows: torch.Tensor) -> Any:
        """The graph of ``shape``, or None (graphs disabled) when capturing fails.

        Capturing synchronises the device once (torch's ``graph`` does); the
        error mode is the thread's own, so the NIXL progress thread's CUDA calls
        during the capture do not invalidate it.
        """
        n = shape[-1]
        try:
            with torch.cuda.device(self.device):
                if self._host_ids is None or self._device_ids is None:
                    self._host_ids = torch.empty(
                        self._max_keys, dtype=torch.long, pin_memory=True
                    )
                    self._host_view = self._host_ids.numpy()
                    self._device_ids = torch.empty_like(
                        self._host_ids, device=self.device
                    )
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph, pool=self._pool, capture_error_mode="thread_local"
                ):
                    index = self._device_ids[:n]
                    index.copy_(self._host_ids[:n], non_blocking=True)
                    self._kernel(index, rows)
        except RuntimeError as error:
            self._disabled = f"capturing a scatter graph failed: {error}"
            logger.warning("%s; chunks scatter without graphs", self._disabled)
            return None
        self._seen.pop(shape, None)
        self._graphs[shape] = graph
        if len(self._graphs) > self._max_graphs:
            self._graphs.popitem(last=False)
        self.captures += 1
        return graph
