"""The seam between the transfer actor and whatever moves device-tier rows.

The actor asks for rows of leased snapshots (``load``) and serves them to peers
(``serve``); how the bytes move is the transport's business. Today's transport is
``XoscarSlabTransport``: the seed's persistent slabs and ``xo.copy_to``
(``gpu_transfer.GPUTransfer``). A direct NIXL agent transport can take its place
behind the same protocol.

Rows follow ``docs/internals.md``: for a list of keys, global row ``r`` is layer
``r % L`` of ``keys[r // L]``; ``scatter(first_row, rows)`` receives consecutive
global rows as a ``(n, R)`` ``uint8`` tensor that is valid only during the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .aio import with_deadline
from .gpu_transfer import GPUTransfer, GPUTransferCounters
from .hashing import BlockHash
from .messages import KVGeometry, PushRequest

# (first global row, rows (n, R) uint8) -> None; may raise to stop the load.
RowScatter = Callable[[int, torch.Tensor], None]


class DeviceTierTransport(Protocol):
    """Moves rows of device-tier snapshots between transfer actors."""

    async def load(
        self,
        holder_ref: Any,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[BlockHash],
        scatter: RowScatter,
        *,
        dst_block_ids: Sequence[int] | None = None,
        source: Any = None,
    ) -> None:
        """Loader side: bring every layer of ``keys`` (leased on the holder under
        ``lease_id``) and hand them to ``scatter`` in chunks. Returns or raises only
        once the holder can no longer write into this side's memory.

        ``dst_block_ids`` (one engine block per key) lets a transport place rows in
        the engine blocks itself instead of calling ``scatter``; ``source`` is a
        transport's own description of where the leased rows are (from the grant),
        sparing it a round trip to the holder. Both are optional hints."""
        ...

    async def serve(
        self, req: PushRequest, source_rows: torch.Tensor, row_index: torch.Tensor
    ) -> None:
        """Holder side, called by the actor's peer-facing ``push_rows``:
        ``row_index[i]`` is the row of ``source_rows`` for the request's i-th row."""
        ...

    def counters(self) -> dict[str, int]:
        """Cumulative transfer counters (wire/useful bytes, copies, registrations)."""
        ...

    async def close(self) -> None:
        """Wait for transfers in progress, then release buffers (idempotent)."""
        ...


class XoscarSlabTransport:
    """``DeviceTierTransport`` over ``GPUTransfer``: the holder writes each chunk
    into the loader's persistent receive slab with ``xo.copy_to`` (NIXL on
    ``nixl://`` pools), asked through the holder actor's ``push_rows``."""

    def __init__(
        self,
        address: str,
        device: torch.device | str,
        geometry: KVGeometry,
        rpc_timeout_s: float,
    ) -> None:
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be positive, got {rpc_timeout_s}")
        self._rpc_timeout_s = rpc_timeout_s
        # The holder's copy must end before our wait on its push does, so that a
        # slow copy surfaces as the holder's error rather than our timeout.
        self._runtime = GPUTransfer(
            address, device, geometry, copy_timeout_s=rpc_timeout_s * 0.9
        )

    @property
    def runtime(self) -> GPUTransfer:
        return self._runtime

    async def load(
        self,
        holder_ref: Any,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[BlockHash],
        scatter: RowScatter,
        *,
        dst_block_ids: Sequence[int] | None = None,
        source: Any = None,
    ) -> None:
        # The holder pushes into our slab: neither hint applies.
        async def push(req: PushRequest) -> None:
            await with_deadline(holder_ref.push_rows(req), self._rpc_timeout_s)

        await self._runtime.load_rows(holder_rank, push, lease_id, keys, scatter)

    async def serve(
        self, req: PushRequest, source_rows: torch.Tensor, row_index: torch.Tensor
    ) -> None:
        await self._runtime.serve_push(req, source_rows, row_index)

    def counters(self) -> dict[str, int]:
        counters: GPUTransferCounters = self._runtime.counters
        return counters.as_dict()

    async def close(self) -> None:
        await self._runtime.close()


async def create_device_tier_transport(
    name: str,
    address: str,
    device: torch.device | str,
    geometry: KVGeometry,
    rpc_timeout_s: float,
    *,
    agent_name: str,
    store_rows: torch.Tensor,
    engine_layers: Sequence[torch.Tensor] | None = None,
    engine_block_axis: int | None = None,
) -> DeviceTierTransport:
    """The transport named by ``XavierConfig.transport``, started.

    ``nixl`` registers ``store_rows`` (the device tier) and a receive slab with an
    agent of its own; ``engine_layers`` are registered only for engine placement.
    """
    if name == "nixl":
        from .nixl_transport import PLACEMENT_SLAB, NixlDirectTransport

        # Slab placement in serving: a READ that outlives its deadline (a stalled
        # peer over TCP) then lands in a retired slab, never in engine blocks that
        # vLLM has meanwhile handed to a recomputation. Engine placement (no
        # scatter) stays available to the benchmark and to callers that accept it.
        return await NixlDirectTransport.create(
            agent_name,
            geometry,
            store_rows,
            rpc_timeout_s=rpc_timeout_s,
            placement=PLACEMENT_SLAB,
            engine_layers=engine_layers,
            engine_block_axis=engine_block_axis,
        )
    return make_device_tier_transport(name, address, device, geometry, rpc_timeout_s)


def make_device_tier_transport(
    name: str,
    address: str,
    device: torch.device | str,
    geometry: KVGeometry,
    rpc_timeout_s: float,
) -> DeviceTierTransport:
    """The transport named by ``XavierConfig.transport``."""
    if name == "xoscar":
        return XoscarSlabTransport(address, device, geometry, rpc_timeout_s)
    raise ValueError(
        f"device-tier transport {name!r} is not available; this build has 'xoscar'"
    )
