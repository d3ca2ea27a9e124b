"""A holder for the engine-process read tests and ``benchmark/direct_load_phases.py``:
a real snapshot store (device tier on the CPU or a GPU, generation words in host
memory) served by the serving NIXL transport, as a transfer actor serves it; the
engine-process reader that has met it, and the lease-free loads it serves.
Sub-pool processes import this module by name."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector.direct_reads import DirectReads
from xinference.model.llm.vllm.xavier.connector.lease_free import LEASE_FREE_PREFIX
from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.device import fence
from xinference.model.llm.vllm.xavier.store.tiered import TieredKVSnapshotStore
from xinference.model.llm.vllm.xavier.transports.base import TransportContext
from xinference.model.llm.vllm.xavier.transports.nixl import transport as nixl
from xinference.model.llm.vllm.xavier.wire import (
    DEVICE_TIER,
    KVGeometry,
    LeaseGrant,
    LoadRequest,
    TransportHint,
)

HOLDER_UID = "direct-reads-holder"
HOLDER_RANK = 0


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


def lease_free_load(
    load_id: str, keys: list[int], locations: list[tuple[int, int]], blocks: list[int]
) -> LoadRequest:
    """The load of snapshots ``keys`` (at ``locations``, as the holder published
    them) into engine ``blocks``, granted lease-free as the scheduler grants it."""
    n = len(keys)
    grant = LeaseGrant(
        lease_id=f"{LEASE_FREE_PREFIX}{load_id}",
        holder_rank=HOLDER_RANK,
        keys=tuple(key(i) for i in keys),
        tiers=(DEVICE_TIER,) * n,
        logical_dtypes=("bfloat16",) * n,
        transport_hint=TransportHint(None, tuple(row for row, _ in locations)),
        generations=tuple(generation for _, generation in locations),
    )
    return LoadRequest(load_id, grant, "unused", tuple(blocks))


def reader(
    address: str, cache: BlockMajorCache, name: str, timeout_s: float = 60.0
) -> tuple[BackgroundLoop, DirectReads]:
    """An engine-process reader of ``cache`` (its own loop) that has met the
    holder at ``address``; raises what the meeting raised, or TimeoutError."""
    loop = BackgroundLoop(f"direct-reads-{name}")

    def holder_calls(holder_address: str, rank: int) -> Any:
        async def call(op: str, *args: Any) -> Any:
            ref = await xo.actor_ref(address, HOLDER_UID)
            return await ref.transport_call(op, *args)

        return call

    reads = DirectReads(loop, cache, name, holder_calls, rpc_timeout_s=10.0)
    reads.prepare(HOLDER_RANK, address)
    deadline = time.monotonic() + timeout_s
    while not reads.ready(HOLDER_RANK):
        meeting = reads._meeting[HOLDER_RANK]
        if meeting.done() and meeting.exception() is not None:
            raise meeting.exception()  # type: ignore[misc]
        if time.monotonic() > deadline:
            raise TimeoutError("the engine agent never met the holder")
        time.sleep(0.05)
    return loop, reads
