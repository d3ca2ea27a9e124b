"""A holder for the engine-process read tests: a real snapshot store (device tier
on the CPU or a GPU, generation words in host memory) served by the serving NIXL
transport, as a transfer actor serves it. Sub-pool processes import this module by
name."""

from __future__ import annotations

import os
from typing import Any

import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.engine.device import fence
from xinference.model.llm.vllm.xavier.store.tiered import TieredKVSnapshotStore
from xinference.model.llm.vllm.xavier.transports.base import TransportContext
from xinference.model.llm.vllm.xavier.transports.nixl import transport as nixl
from xinference.model.llm.vllm.xavier.wire import KVGeometry

HOLDER_UID = "direct-reads-holder"


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class StoreHolder(xo.StatelessActor):
    def __init__(
        self, geometry: KVGeometry, device_slots: int, device: str = "cpu"
    ) -> None:
        super().__init__()
        self._geometry = geometry
        self._device = torch.device(device)
        self.store = TieredKVSnapshotStore(
            geometry, self._device, device_slots * geometry.block_nbytes, 16
        )
        self.transport: Any = None

    async def __post_create__(self) -> None:
        store = self.store
        self.transport = await nixl.create(
            TransportContext(
                address=self.address,
                device=self._device,
                geometry=self._geometry,
                rpc_timeout_s=10.0,
                agent_name=f"direct-test-{os.getpid()}",
                store_rows=store.device_rows,
                locate_rows=store.locate_device_rows,
                generation_words=store.generations.words,
            )
        )

    async def __pre_destroy__(self) -> None:
        await self.transport.close()

    def put(self, i: int) -> tuple[int, int] | None:
        """Stage and publish snapshot ``i``: every byte of it is ``i``; returns
        its published device-tier location (row, generation)."""
        (slot,) = self.store.begin_stage_batch([key(i)], "bfloat16")
        rows = self.store.rows(slot.tier)
        rows[slot.first_row : slot.first_row + self._geometry.num_layers] = i
        fence(self._device)  # what publish requires on a GPU
        self.store.mark_layers_written(key(i), range(self._geometry.num_layers))
        self.store.publish(key(i))
        return self.store.device_location(key(i))

    def serves_generation_words(self) -> bool:
        """What the transfer actor asks before it publishes locations."""
        return bool(self.transport.serves_generation_words)

    def pid(self) -> int:
        return os.getpid()

    async def transport_call(self, op: str, *args: Any) -> Any:
        return await self.transport.holder_ops()[op](*args)
