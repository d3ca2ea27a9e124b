"""Moving snapshot rows between replicas through persistent slabs and ``xo.copy_to``.

Each replica owns one ``GPUTransfer`` with two slabs allocated once: a send slab that
the holder gathers rows into before writing them to a peer, and a receive slab that
peers write into before the loader scatters the rows into its engine cache. Separate
slabs let a replica serve a peer while it loads from another.

Each slab has a prefix view of ``min(full, 256 KiB)`` bytes on the same allocation
(offset 0, same data pointer). Every receive view has exactly one xoscar buffer ref,
made here and kept for the runtime's life: xoscar's ``BufferRef`` registry holds its
buffers weakly, and its NIXL channel keeps a registration only while each copy uses
the very same local buffer object and remote ref as the copy before it on that
channel. Persistent objects are what let a steady stream of copies reuse one
registration; ``SlabSelector`` decides when a copy goes through the small view.

Bytes travel as ``uint8``, so every dtype arrives bit-exact; the caller checks the
logical dtype recorded with each snapshot (``check_logical_dtype``).

The same code runs with CPU tensors (NIXL DRAM, as in CI) and CUDA tensors (VRAM).

Ordering, and why it is safe without fences of our own (xoscar 0.12.2, NIXL 1.5):

* Gather before write: ``index_select`` into the send slab may run asynchronously on
  the holder's CUDA stream. ``copy_to`` registers its local buffers first, and
  xoscar's NIXL channel synchronises every CUDA device of those buffers there
  (``_register`` calls ``_synchronize``) before the WRITE is posted.
* Write before scatter: the holder's ``copy_to`` returns only after the WRITE reached
  a terminal state and the receiver's channel answered "finish" (which synchronises
  the receiver's device). The holder then answers the loader's push call, and only
  after that answer does ``load_rows`` call ``scatter``, on the loader's event loop.
* Scatter before the next write into the receive slab: the receive lock is held from
  the push until ``scatter`` has returned. ``scatter`` may only have *launched* device
  work; the next WRITE into the slab is preceded by the receiver channel's "prepare",
  which registers (and so synchronises) the receive view's device first.
* Next gather after write: the send lock is held until ``copy_to`` has returned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import xoscar as xo

from ...engine.layout import wide_view
from ...hashing import BlockHash
from ...wire import KVGeometry
from .slab_selector import DEFAULT_SMALL_BYTES, SlabPolicy, SlabSelector

logger = logging.getLogger(__name__)

MAX_FULL_SLAB_BYTES = 16 * 1024**2
FULL_SLAB_BLOCKS = 64
SMALL_VIEW_BYTES = DEFAULT_SMALL_BYTES
# xoscar's NIXL channel drops its cached registration after a copy above this size
# (``_REGISTRATION_CACHE_BYTES`` in xoscar/backends/communication/nixl.py).
XOSCAR_REGISTRATION_CACHE_BYTES = 256 * 1024**2
DEFAULT_COPY_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class PushRequest:
    """Ask a holder to write rows of leased device-tier snapshots into our slab.

    Rows enumerate (key, layer) pairs over ``keys`` in order: global row ``r`` is
    layer ``r % num_layers`` of ``keys[r // num_layers]``; the request covers rows
    ``first_row .. first_row + num_rows - 1``. The holder writes exactly
    ``wire_bytes`` (>= the payload) into ``dest``, a buffer ref of that size.
    """

    lease_id: str
    keys: tuple[BlockHash, ...]
    first_row: int
    num_rows: int
    wire_bytes: int
    dest: Any  # xoscar BufferRef of the receiver's slab view of exactly wire_bytes


PushFn = Callable[[PushRequest], Awaitable[None]]
ScatterFn = Callable[[int, torch.Tensor], None]


def full_slab_bytes(geometry: KVGeometry) -> int:
    """The slab size: one layer's block at least, else min(16 MiB, 64 snapshots)."""
    return max(
        geometry.layer_block_nbytes,
        min(MAX_FULL_SLAB_BYTES, FULL_SLAB_BLOCKS * geometry.block_nbytes),
    )


def small_view_bytes(full_bytes: int) -> int:
    return min(full_bytes, SMALL_VIEW_BYTES)


class LogicalDtypeMismatch(ValueError):
    """A snapshot's recorded dtype differs from the engine cache's."""


def check_logical_dtype(expected: str, actual: str) -> None:
    """Raise unless a snapshot's recorded logical dtype is the one the engine uses.

    Bytes travel raw, so a mismatch would not fail any copy: it would silently
    reinterpret KV. It is a fault, never a miss.
    """
    if expected != actual:
        raise LogicalDtypeMismatch(
            f"KV snapshot logical dtype mismatch: the engine cache is {expected!r} but "
            f"the snapshot was recorded as {actual!r}; refusing to reinterpret its bytes"
        )


def chunk_row_index(
    key_first_rows: Sequence[int], num_layers: int, first_row: int, num_rows: int
) -> torch.Tensor:
    """Tensor rows of global rows ``first_row .. first_row + num_rows - 1``.

    Global row ``r`` is layer ``r % num_layers`` of the ``r // num_layers``-th key,
    whose snapshot starts at tensor row ``key_first_rows[r // num_layers]``. The
    result is a CPU ``torch.long`` tensor (empty when ``num_rows`` is 0).
    """
    if num_layers <= 0 or first_row < 0 or num_rows < 0:
        raise ValueError(
            f"bad chunk: num_layers={num_layers}, first_row={first_row}, "
            f"num_rows={num_rows}"
        )
    if first_row + num_rows > len(key_first_rows) * num_layers:
        raise ValueError(
            f"rows {first_row}..{first_row + num_rows - 1} exceed the "
            f"{len(key_first_rows)} keys x {num_layers} layers of the request"
        )
    rows = torch.arange(first_row, first_row + num_rows, dtype=torch.long)
    bases = torch.as_tensor(list(key_first_rows), dtype=torch.long)
    if num_rows == 0:
        return rows
    return bases[rows // num_layers] + rows % num_layers


@dataclass(slots=True)
class GPUTransferCounters:
    """Cumulative counts of one runtime.

    ``copies``, ``wire_bytes`` and ``useful_bytes`` count the copies this runtime
    *sent* (``serve_push``): wire bytes are what crossed (the view's size), useful
    bytes the rows asked for. The ``received_*`` fields count the same from the
    loader's side (``load_rows``).

    Registration changes are counted on the sending side, for both endpoints of each
    copy, the way xoscar's NIXL channel decides (see ``_ChannelRegistrations``):
    ``local_registration_changes`` are re-registrations of our send view,
    ``remote_registration_changes`` those of the peer's receive view.
    """

    copies: int = 0
    wire_bytes: int = 0
    useful_bytes: int = 0
    local_registration_changes: int = 0
    remote_registration_changes: int = 0
    received_copies: int = 0
    received_wire_bytes: int = 0
    received_useful_bytes: int = 0
    retired_receive_slabs: int = 0

    @property
    def registration_changes(self) -> int:
        return self.local_registration_changes + self.remote_registration_changes

    def as_dict(self) -> dict[str, int]:
        stats = asdict(self)
        stats["registration_changes"] = self.registration_changes
        return stats


class _ChannelRegistrations:
    """The sender's mirror of xoscar's NIXL registration cache, one entry per peer.

    xoscar keeps one NIXL channel per (sending process, receiver address). On every
    ``copy_to`` the sending end re-registers its local buffers unless they are the
    very same objects (``is``) as in the channel's previous copy, and the receiving
    end does the same with the buffers its refs resolve to; both ends drop the
    registration after a copy above ``XOSCAR_REGISTRATION_CACHE_BYTES``. A receive
    ref resolves to one buffer object for its life, so comparing refs by
    (address, uid) stands for comparing the receiver's buffer objects.

    Exact as long as this runtime is the only ``copy_to`` user on those channels. A
    failed copy forgets the peer: the channel may have been closed (xoscar closes it
    on a transport error), so the next copy is counted as registering both ends.
    """

    def __init__(self) -> None:
        # receiver address -> (local buffer object, (receiver address, ref uid))
        self._last: dict[str, tuple[torch.Tensor, tuple[str, bytes]]] = {}

    def record(self, local: torch.Tensor, dest: Any, nbytes: int) -> tuple[bool, bool]:
        """(local end re-registers, remote end re-registers) for this copy."""
        peer = dest.address
        remote = (dest.address, dest.uid)
        previous = self._last.get(peer)
        local_changed = previous is None or previous[0] is not local
        remote_changed = previous is None or previous[1] != remote
        if nbytes > XOSCAR_REGISTRATION_CACHE_BYTES:
            self._last.pop(peer, None)
        else:
            self._last[peer] = (local, remote)
        return local_changed, remote_changed

    def forget(self, peer: str) -> None:
        self._last.pop(peer, None)


def _prefix_views(slab: torch.Tensor, small_bytes: int) -> dict[int, torch.Tensor]:
    """{size: view}: the slab itself and, if smaller, its ``small_bytes`` prefix."""
    views = {slab.numel(): slab}
    if small_bytes < slab.numel():
        views[small_bytes] = slab[:small_bytes]
    return views


def _gather_rows(
    source_rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor
) -> None:
    """``out[i] = source_rows[index[i]]``, copied as wide integers where possible:
    1-byte elements cross ATen's parallel grain 8x sooner (see ``wide_view``)."""
    source = wide_view(source_rows)
    try:
        target = out.view(source.dtype)
    except RuntimeError:  # the slab prefix is not aligned for it: copy bytes
        source, target = source_rows, out
    torch.index_select(source, 0, index, out=target)


class GPUTransfer:
    """Persistent slabs, their buffer refs, and the two halves of a row transfer.

    Construct it inside an actor (``address`` is the actor pool's external address,
    a ``nixl://`` one for NIXL transfers): ``xo.buffer_ref`` needs the pool's
    context. ``device`` is where the slabs live and must be where the rows are.
    """

    def __init__(
        self,
        address: str,
        device: torch.device | str,
        geometry: KVGeometry,
        *,
        selector: SlabPolicy | None = None,
        copy_timeout_s: float = DEFAULT_COPY_TIMEOUT_S,
    ) -> None:
        if copy_timeout_s <= 0:
            raise ValueError(f"copy_timeout_s must be positive, got {copy_timeout_s}")
        self.address = address
        self.geometry = geometry
        self.row_bytes = geometry.layer_block_nbytes
        self.full_bytes = full_slab_bytes(geometry)
        self.small_bytes = small_view_bytes(self.full_bytes)
        self.rows_per_copy = self.full_bytes // self.row_bytes
        self.copy_timeout_s = copy_timeout_s
        self.selector: SlabPolicy = selector or SlabSelector(
            self.full_bytes, SMALL_VIEW_BYTES
        )

        # Zeroed once: the padding of a small batch sent through a larger view
        # never carries uninitialised memory.
        send_slab = torch.zeros(self.full_bytes, dtype=torch.uint8, device=device)
        self.device = send_slab.device  # "cuda" resolved to "cuda:N"
        # view size in bytes -> that view (the full slab, or its prefix)
        self.send_views = _prefix_views(send_slab, self.small_bytes)
        self.recv_views: dict[int, torch.Tensor] = {}
        # view size in bytes -> the one buffer ref peers write that view through.
        # Keeping the views alive here keeps the weakly held registry entries alive.
        self.recv_refs: dict[int, Any] = {}
        # Receive slabs a peer may still write into after a failed push, with their
        # refs: kept alive (never reused, never freed) so a late write lands in memory
        # nobody reads. One per failed push; failures are rare and logged.
        self._retired_recv: list[tuple[dict[int, torch.Tensor], dict[int, Any]]] = []
        self._new_receive_slab()
        # One lock per slab, shared by both of its views: they are the same memory.
        self.send_lock = asyncio.Lock()
        self.recv_lock = asyncio.Lock()
        self.counters = GPUTransferCounters()
        self._registrations = _ChannelRegistrations()
        self._closed = False
        logger.info(
            "GPUTransfer at %s on %s: slab %d bytes (%d rows of %d), view %d bytes",
            address,
            self.device,
            self.full_bytes,
            self.rows_per_copy,
            self.row_bytes,
            self.small_bytes,
        )

    def _new_receive_slab(self) -> None:
        """Allocate the receive slab, its prefix view and their buffer refs."""
        recv_slab = torch.zeros(self.full_bytes, dtype=torch.uint8, device=self.device)
        self.recv_views = _prefix_views(recv_slab, self.small_bytes)
        self.recv_refs = {
            size: xo.buffer_ref(self.address, view)
            for size, view in self.recv_views.items()
        }

    def _retire_receive_slab(self, source_rank: int, error: BaseException) -> None:
        """After a failed push the holder may still be writing into our slab (its
        copy outlives our deadline): retire the slab instead of reusing it."""
        self._retired_recv.append((self.recv_views, self.recv_refs))
        self._new_receive_slab()
        self.counters.retired_receive_slabs += 1
        logger.warning(
            "push from rank %d failed (%r); retired the receive slab (%d retired, "
            "%d bytes each) so that a late write cannot corrupt the next load",
            source_rank,
            error,
            len(self._retired_recv),
            self.full_bytes,
        )

    @property
    def view_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.recv_views))

    # ---- receiver (loader) side -------------------------------------------------

    async def load_rows(
        self,
        source_rank: int,
        push: PushFn,
        lease_id: str,
        keys: Sequence[BlockHash],
        scatter: ScatterFn,
    ) -> int:
        """Copy every layer of ``keys`` from a holder, chunk by chunk; rows loaded.

        For each chunk (consecutive global rows, at most ``rows_per_copy``) the
        selector picks the view, ``push`` asks the holder to write the chunk into it
        (normally an actor call to the holder's ``serve_push``), and
        ``scatter(first_row, rows)`` receives the chunk as a ``(num_rows, row_bytes)``
        ``uint8`` view of the receive slab. That view is valid only during the call:
        copy out of it, do not keep it.

        ``push`` must return or raise only once the holder can no longer write into
        our slab. xoscar's actor calls give that: a cancelled call is forwarded to the
        holder, whose ``copy_to`` does not abandon a WRITE in flight. Its deadline is
        the caller's (wrap the actor call, not this coroutine).
        """
        self._check_open()
        keys = tuple(keys)
        total_rows = len(keys) * self.geometry.num_layers
        for first_row in range(0, total_rows, self.rows_per_copy):
            num_rows = min(self.rows_per_copy, total_rows - first_row)
            nbytes = num_rows * self.row_bytes
            async with self.recv_lock:
                self._check_open()
                # Selected under the lock, so the selector sees copies in the order
                # they reach the channel.
                wire_bytes = self.selector.select(source_rank, nbytes)
                view = self.recv_views.get(wire_bytes)
                if view is None or wire_bytes < nbytes:
                    raise ValueError(
                        f"slab policy chose {wire_bytes} bytes for a {nbytes}-byte "
                        f"chunk; the views are {self.view_sizes}"
                    )
                try:
                    await push(
                        PushRequest(
                            lease_id=lease_id,
                            keys=keys,
                            first_row=first_row,
                            num_rows=num_rows,
                            wire_bytes=wire_bytes,
                            dest=self.recv_refs[wire_bytes],
                        )
                    )
                except BaseException as exc:
                    self._retire_receive_slab(source_rank, exc)
                    raise
                scatter(first_row, view[:nbytes].view(num_rows, self.row_bytes))
            self.counters.received_copies += 1
            self.counters.received_wire_bytes += wire_bytes
            self.counters.received_useful_bytes += nbytes
        return total_rows

    # ---- sender (holder) side ---------------------------------------------------

    async def serve_push(
        self,
        req: PushRequest,
        source_rows: torch.Tensor,
        row_index: torch.Tensor | Sequence[int],
    ) -> None:
        """Gather ``req``'s rows into the send view and write it to ``req.dest``.

        ``source_rows`` is a ``(rows, row_bytes)`` ``uint8`` tensor on this runtime's
        device (a store tier); ``row_index`` holds, for each of the request's
        ``num_rows`` rows in order, its row in ``source_rows`` (``chunk_row_index``
        builds it). Exactly ``req.wire_bytes`` bytes are copied, a view size that
        both ends share; a request of zero rows copies nothing.
        """
        self._check_open()
        view = self._check_request(req)
        self._check_source(source_rows)
        index = self._index_tensor(row_index, req.num_rows, source_rows.shape[0])
        if req.num_rows == 0:
            return
        nbytes = req.num_rows * self.row_bytes
        async with self.send_lock:
            self._check_open()
            rows = view[:nbytes].view(req.num_rows, self.row_bytes)
            _gather_rows(source_rows, index, rows)
            local_changed, remote_changed = self._registrations.record(
                view, req.dest, req.wire_bytes
            )
            try:
                # xo.wait_for, not asyncio.wait_for: the latter waits for the
                # cancelled copy, which a stopped loader never lets end.
                await xo.wait_for(
                    xo.copy_to([view], [req.dest]), timeout=self.copy_timeout_s
                )
            except BaseException:
                self._registrations.forget(req.dest.address)
                raise
            # Counted after the copy: registrations happen within copy_to, and a
            # failed copy's counts are replaced by "both ends next time" above.
            self.counters.local_registration_changes += local_changed
            self.counters.remote_registration_changes += remote_changed
            self.counters.copies += 1
            self.counters.wire_bytes += req.wire_bytes
            self.counters.useful_bytes += nbytes

    def _check_request(self, req: PushRequest) -> torch.Tensor:
        view = self.send_views.get(req.wire_bytes)
        if view is None:
            raise ValueError(
                f"wire_bytes={req.wire_bytes} is not a slab view size here "
                f"{self.view_sizes}; do both replicas use the same KV geometry?"
            )
        total_rows = len(req.keys) * self.geometry.num_layers
        if (
            req.first_row < 0
            or req.num_rows < 0
            or req.first_row + req.num_rows > total_rows
        ):
            raise ValueError(
                f"rows {req.first_row}..{req.first_row + req.num_rows - 1} are outside "
                f"the {total_rows} rows of {len(req.keys)} keys"
            )
        if req.num_rows * self.row_bytes > req.wire_bytes:
            raise ValueError(
                f"{req.num_rows} rows of {self.row_bytes} bytes do not fit a "
                f"{req.wire_bytes}-byte view"
            )
        return view

    def _check_source(self, source_rows: torch.Tensor) -> None:
        if (
            source_rows.dtype != torch.uint8
            or source_rows.dim() != 2
            or source_rows.shape[1] != self.row_bytes
        ):
            raise ValueError(
                f"source rows must be a (rows, {self.row_bytes}) uint8 tensor, got "
                f"{tuple(source_rows.shape)} {source_rows.dtype}"
            )
        if source_rows.device != self.device:
            raise ValueError(
                f"source rows are on {source_rows.device}, the slabs on {self.device}"
            )

    def _index_tensor(
        self, row_index: torch.Tensor | Sequence[int], num_rows: int, limit: int
    ) -> torch.Tensor:
        """A ``torch.long`` index on our device, checked before any device work.

        An out-of-range index would be a device-side assert on CUDA, which poisons
        the whole context; checking here turns it into a clear error.
        """
        if isinstance(row_index, torch.Tensor):
            if row_index.dtype != torch.long or row_index.dim() != 1:
                raise ValueError(
                    f"row_index must be a 1-D torch.long tensor, got "
                    f"{row_index.dim()}-D {row_index.dtype}"
                )
            index = row_index
        else:
            index = torch.as_tensor(list(row_index), dtype=torch.long)
        if index.numel() != num_rows:
            raise ValueError(
                f"row_index has {index.numel()} rows, the request {num_rows}"
            )
        if num_rows:
            low, high = (int(v) for v in torch.aminmax(index))
            if low < 0 or high >= limit:
                raise IndexError(
                    f"row_index spans {low}..{high}, outside the {limit} source rows"
                )
        return index.to(self.device)

    # ---- lifecycle --------------------------------------------------------------

    async def close(self) -> None:
        """Wait for the copies in progress, then drop slabs and refs (idempotent)."""
        if self._closed:
            return
        self._closed = True
        async with self.send_lock, self.recv_lock:
            self.recv_refs.clear()
            self.send_views.clear()
            self.recv_views.clear()
        logger.info("GPUTransfer at %s closed: %s", self.address, self.counters)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"GPUTransfer at {self.address} is closed")
