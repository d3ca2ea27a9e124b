"""Test actors for GPUTransfer: one replica's side of a real cross-process transfer.

Sub-pool processes import this module by name, which is why the tests tree is a
package. Each ``TransferPeer`` owns a ``GPUTransfer``, a source tensor it serves rows
from (standing in for a store tier) and a destination tensor it scatters loaded rows
into (standing in for the engine cache). A key names a slot: ``slot_key(s)`` is
snapshot ``s``, rows ``s * L .. s * L + L - 1`` of either tensor.

``instrument_registrations`` is test-only instrumentation: it wraps NIXL's
``nixl_agent.register_memory`` in the actor's process with a counter and calls the
real method. Nothing in the transfer is replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.gpu_transfer import (
    GPUTransfer,
    chunk_row_index,
    full_slab_bytes,
)
from xinference.model.llm.vllm.xavier.messages import KVGeometry, PushRequest
from xinference.model.llm.vllm.xavier.nixl_registrations import (
    install_registration_counter,
    registration_calls,
)
from xinference.model.llm.vllm.xavier.slab_selector import (
    FullSlabSelector,
    SlabPolicy,
    SlabSelector,
    SmallestFitSelector,
)

HOLDER_UID = "transfer-test-holder"
LOADER_UID = "transfer-test-loader"
HOLDER_RANK = 0


def slot_key(slot: int) -> bytes:
    return slot.to_bytes(16, "big")


def key_slot(key: bytes) -> int:
    return int.from_bytes(key, "big")


def make_policy(name: str, full_bytes: int) -> SlabPolicy:
    """``streak`` (the runtime's), ``smallest`` (the old choice) or ``full``."""
    policies = {
        "streak": SlabSelector,
        "smallest": SmallestFitSelector,
        "full": FullSlabSelector,
    }
    return policies[name](full_bytes)


def scatter_into(
    dest: torch.Tensor, key_first_rows: list[int], num_layers: int
) -> Callable[[int, torch.Tensor], None]:
    """A scatter callback writing a load's global rows into ``dest``'s snapshot rows."""

    def scatter(first_row: int, rows: torch.Tensor) -> None:
        index = chunk_row_index(key_first_rows, num_layers, first_row, rows.shape[0])
        dest.index_copy_(0, index.to(dest.device), rows)

    return scatter


class TransferPeer(xo.StatelessActor):
    def __init__(
        self, geometry: KVGeometry, device: str, num_slots: int, policy: str
    ) -> None:
        super().__init__()
        self._geometry = geometry
        self._device = device
        self._policy = policy
        rows = (num_slots * geometry.num_layers, geometry.layer_block_nbytes)
        self.source_rows = torch.zeros(rows, dtype=torch.uint8, device=device)
        self.dest_rows = torch.zeros(rows, dtype=torch.uint8, device=device)
        # (address, uid) of every destination ref a push asked us to write
        self.seen_dests: set[tuple[str, bytes]] = set()

    async def __post_create__(self) -> None:
        # xo.buffer_ref needs the actor's address, known only after construction.
        self.transfer = self._new_transfer(self._policy)

    def _new_transfer(self, policy: str) -> GPUTransfer:
        return GPUTransfer(
            self.address,
            self._device,
            self._geometry,
            selector=make_policy(policy, full_slab_bytes(self._geometry)),
        )

    # ---- data -------------------------------------------------------------------

    def write_source(self, first_row: int, data: bytes) -> None:
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = flat.view(-1, self._geometry.layer_block_nbytes)
        self.source_rows[first_row : first_row + rows.shape[0]].copy_(rows)

    def read_dest(self, first_row: int, num_rows: int) -> bytes:
        rows = self.dest_rows[first_row : first_row + num_rows]
        return rows.cpu().numpy().tobytes()

    def clear_dest(self) -> None:
        self.dest_rows.zero_()

    # ---- the two halves of a transfer -------------------------------------------

    async def push_rows(self, req: PushRequest) -> None:
        self.seen_dests.add((req.dest.address, req.dest.uid))
        num_layers = self._geometry.num_layers
        index = chunk_row_index(
            [key_slot(k) * num_layers for k in req.keys],
            num_layers,
            req.first_row,
            req.num_rows,
        )
        await self.transfer.serve_push(req, self.source_rows, index)

    async def load(self, holder_address: str, batches: Sequence[Sequence[int]]) -> int:
        """Load each batch of slots into the same slots of ``dest_rows``; rows."""
        holder = await xo.actor_ref(holder_address, HOLDER_UID)
        num_layers = self._geometry.num_layers
        loaded = 0
        for slots in batches:
            scatter = scatter_into(
                self.dest_rows, [s * num_layers for s in slots], num_layers
            )

            loaded += await self.transfer.load_rows(
                HOLDER_RANK,
                holder.push_rows,
                "lease-test",
                [slot_key(s) for s in slots],
                scatter,
            )
        return loaded

    async def push_into_wrong_view(self, holder_address: str, slots: list[int]) -> None:
        """Ask for a full-slab write into our small view: both ends must refuse."""
        holder = await xo.actor_ref(holder_address, HOLDER_UID)
        gt = self.transfer
        num_rows = len(slots) * self._geometry.num_layers
        await holder.push_rows(
            PushRequest(
                lease_id="lease-test",
                keys=tuple(slot_key(s) for s in slots),
                first_row=0,
                num_rows=num_rows,
                wire_bytes=gt.full_bytes,
                dest=gt.recv_refs[gt.small_bytes],
            )
        )

    # ---- introspection ----------------------------------------------------------

    def instrument_registrations(self) -> None:
        install_registration_counter()

    def registration_calls(self) -> int:
        return registration_calls()

    def counters(self) -> dict[str, int]:
        return self.transfer.counters.as_dict()

    def get_seen_dests(self) -> set[tuple[str, bytes]]:
        return set(self.seen_dests)

    def transfer_info(self) -> dict[str, Any]:
        from xoscar.core import BufferRef

        gt = self.transfer
        registry = BufferRef._ref_to_buffers
        return {
            "address": self.address,
            "full_bytes": gt.full_bytes,
            "small_bytes": gt.small_bytes,
            "rows_per_copy": gt.rows_per_copy,
            "view_sizes": gt.view_sizes,
            # size -> (data_ptr, numel, storage data_ptr)
            "send": {
                n: (v.data_ptr(), v.numel(), v.untyped_storage().data_ptr())
                for n, v in gt.send_views.items()
            },
            "recv": {
                n: (v.data_ptr(), v.numel(), v.untyped_storage().data_ptr())
                for n, v in gt.recv_views.items()
            },
            # size -> (id of the ref object, (address, uid), the registry's buffer is
            # the very view object)
            "refs": {
                n: (id(r), (r.address, r.uid), registry[r] is gt.recv_views[n])
                for n, r in gt.recv_refs.items()
            },
            "object_ids": {
                "send": {n: id(v) for n, v in gt.send_views.items()},
                "recv": {n: id(v) for n, v in gt.recv_views.items()},
            },
            "registry_refs_here": sum(
                1 for r in list(registry.keys()) if r.address == self.address
            ),
            "device": str(gt.device),
        }


@contextlib.asynccontextmanager
async def transfer_pair(
    geometry: KVGeometry,
    device: str = "cpu",
    num_slots: int = 8,
    loader_policy: str = "streak",
) -> AsyncIterator[tuple[Any, Any, str]]:
    """(holder, loader, holder address): two processes on ``nixl://`` addresses.

    Both processes count their NIXL registrations from before the first copy.
    """
    pool = await xo.create_actor_pool(
        "127.0.0.1", n_process=2, external_address_schemes=["nixl"] * 3
    )
    async with pool:
        holder_address, loader_address = list(pool.sub_processes)
        holder = await xo.create_actor(
            TransferPeer,
            geometry,
            device,
            num_slots,
            "streak",
            address=holder_address,
            uid=HOLDER_UID,
        )
        loader = await xo.create_actor(
            TransferPeer,
            geometry,
            device,
            num_slots,
            loader_policy,
            address=loader_address,
            uid=LOADER_UID,
        )
        await holder.instrument_registrations()
        await loader.instrument_registrations()
        yield holder, loader, holder_address
