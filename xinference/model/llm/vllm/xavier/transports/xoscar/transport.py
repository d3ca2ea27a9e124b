"""``XoscarSlabTransport``: the seed's device-tier transport behind the seam.

The loader asks the holder (holder op ``push_rows``) to write each chunk into the
loader's persistent receive slab with ``xo.copy_to``: a NIXL WRITE between
``nixl://`` pools, through ``GPUTransfer`` (persistent slabs, a 256 KiB prefix view
chosen by ``SlabSelector``). The grant needs no hint: the holder locates the rows
itself when it pushes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...aio import with_deadline
from ...hashing import BlockHash
from ...stats import TransportStats
from ...wire import TransportHint
from ..base import HolderCall, HolderOp, RowScatter, TransportContext
from .gpu_transfer import GPUTransfer, PushRequest, chunk_row_index


class XoscarSlabTransport:
    """``DeviceTierTransport`` over ``GPUTransfer`` (see the module docstring)."""

    # The next WRITE into the receive slab is ordered after the scatter's device
    # work only by xoscar's channel synchronising the device when it prepares the
    # copy (``gpu_transfer``'s docstring): an implementation detail of xoscar, not
    # a promise, so the caller completes the scatter's work before it returns.
    guards_scatter_source = False

    def __init__(self, context: TransportContext) -> None:
        if context.rpc_timeout_s <= 0:
            raise ValueError(
                f"rpc_timeout_s must be positive, got {context.rpc_timeout_s}"
            )
        self._context = context
        # The holder's copy must end before our wait on its push does, so that a
        # slow copy surfaces as the holder's error rather than our timeout.
        self._runtime = GPUTransfer(
            context.address,
            context.device,
            context.geometry,
            copy_timeout_s=context.rpc_timeout_s * 0.9,
        )
        self._loads = 0

    @property
    def runtime(self) -> GPUTransfer:
        return self._runtime

    async def load(
        self,
        holder: HolderCall,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[BlockHash],
        scatter: RowScatter,
        *,
        hint: TransportHint | None = None,
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        # The holder pushes into our slab: neither the hint nor the destination
        # blocks apply.
        async def push(req: PushRequest) -> None:
            await with_deadline(holder("push_rows", req), self._context.rpc_timeout_s)

        if not keys:
            return
        await self._runtime.load_rows(holder_rank, push, lease_id, keys, scatter)
        self._loads += 1

    def hint(self, first_rows: Sequence[int | None]) -> TransportHint | None:
        return None

    def holder_ops(self) -> Mapping[str, HolderOp]:
        return {"push_rows": self._push_rows}

    async def _push_rows(self, req: PushRequest) -> None:
        """Write rows of leased device-tier snapshots into ``req.dest``."""
        num_layers = self._context.geometry.num_layers
        if req.num_rows <= 0:
            return
        first_key = req.first_row // num_layers
        last_key = (req.first_row + req.num_rows - 1) // num_layers
        if first_key < 0 or last_key >= len(req.keys):
            raise ValueError(
                f"rows {req.first_row}..{req.first_row + req.num_rows - 1} are "
                f"outside the {len(req.keys)} keys of the request"
            )
        first_rows = self._context.locate_rows(
            req.lease_id, req.keys[first_key : last_key + 1]
        )
        row_index = chunk_row_index(
            first_rows, num_layers, req.first_row - first_key * num_layers, req.num_rows
        )
        await self._runtime.serve_push(req, self._context.store_rows, row_index)

    def stats(self) -> TransportStats:
        counts = self._runtime.counters
        return TransportStats(
            sent_copies=counts.copies,
            sent_wire_bytes=counts.wire_bytes,
            sent_useful_bytes=counts.useful_bytes,
            received_copies=counts.received_copies,
            received_wire_bytes=counts.received_wire_bytes,
            received_useful_bytes=counts.received_useful_bytes,
            loads=self._loads,
            registration_changes=counts.registration_changes,
            local_registration_changes=counts.local_registration_changes,
            remote_registration_changes=counts.remote_registration_changes,
            retired_receive_slabs=counts.retired_receive_slabs,
        )

    async def close(self) -> None:
        await self._runtime.close()


async def create(context: TransportContext) -> XoscarSlabTransport:
    return XoscarSlabTransport(context)
