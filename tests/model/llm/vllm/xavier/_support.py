"""Shared helpers of the transfer-actor tests: real pools, a synthetic engine.

- ``nixl_pool`` / the ``cluster`` fixture: a real xoscar pool whose main process is
  the test process and whose sub-pools are separate processes on ``nixl://``
  addresses (``xo.copy_to`` between them is a real NIXL DRAM WRITE), with the block
  tracker in the main pool. ``shared_pools`` / ``shared_cluster`` (also named
  ``cluster`` for the tests) keep the pools for a whole module, with a tracker and
  replicas of each test's own (its tests run on the module's loop:
  ``ON_SHARED_POOLS``).
- ``SyntheticEngine``: what a vLLM worker holds, without vLLM. It allocates
  per-layer KV tensors in a given layout in the test process, as views of one
  allocation like vLLM's CPU backend, shares them with ``device.export_tensors``
  (the transfer actors in the sub-pools map them), and reads and writes whole
  blocks.
- ``exchange_with_child``: the body of a spawned process for the device tests.

Sub-pools and spawned children import this module by name, which is why the tests
tree is a package.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.actor.transfer_actor import (
    TransferActorConfig,
    XavierTransferActor,
    transfer_actor_uid,
)
from xinference.model.llm.vllm.xavier.config import DEFAULT_TRANSPORT
from xinference.model.llm.vllm.xavier.engine.blocks import BlockMajorCache
from xinference.model.llm.vllm.xavier.engine.device import (
    SharedTensorHandles,
    export_tensors,
    import_tensors,
)
from xinference.model.llm.vllm.xavier.engine.layout import (
    BLOCK_FIRST_LAYOUT,
    KV_FIRST_LAYOUT,
    PACKED_KV_LAYOUT,
    PACKED_KV_NHD_LAYOUT,
    detect_layout,
)
from xinference.model.llm.vllm.xavier.tracker import (
    BlockTrackerActor,
    tracker_uid,
)
from xinference.model.llm.vllm.xavier.wire import (
    LeaseGrant,
    LoadRequest,
    LoadResult,
    ReplicaIdentity,
    StageItem,
)

MODEL = "xavier-test-model"

CUDA_SKIP = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)"
)
# Parametrize a test over these to run it on CPU and, where there is one, on CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA_SKIP])]


def all_bf16_patterns() -> torch.Tensor:
    """The 65,536 BF16 values, one per bit pattern (NaNs and infinities included)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16)


@dataclass(frozen=True)
class EngineSpec:
    layout: str
    num_layers: int = 2
    num_blocks: int = 64
    kv_heads: int = 2
    block_size: int = 16
    head_size: int = 32
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"


class SyntheticEngine:
    """Per-layer KV tensors in ``spec.layout``, like a vLLM worker's.

    ``kv_first`` is built the way a GPU runner can end up with it: allocated
    block-first and permuted, so each layer is a non-contiguous view.
    """

    def __init__(self, spec: EngineSpec, share: bool = True) -> None:
        self.spec = spec
        nb, h, bs, d = spec.num_blocks, spec.kv_heads, spec.block_size, spec.head_size
        per_layer = nb * h * bs * 2 * d
        self._flat = torch.zeros(
            spec.num_layers * per_layer, dtype=spec.dtype, device=spec.device
        )
        layers = [
            self._flat[i * per_layer : (i + 1) * per_layer]
            for i in range(spec.num_layers)
        ]
        if spec.layout == PACKED_KV_LAYOUT:
            self.tensors = [t.view(nb, h, bs, 2 * d) for t in layers]
        elif spec.layout == PACKED_KV_NHD_LAYOUT:  # FlashAttention's, vLLM 0.26
            self.tensors = [t.view(nb, bs, h, 2 * d).transpose(1, 2) for t in layers]
        elif spec.layout == BLOCK_FIRST_LAYOUT:
            self.tensors = [t.view(nb, 2, bs, h, d) for t in layers]
        elif spec.layout == KV_FIRST_LAYOUT:
            self.tensors = [t.view(nb, 2, bs, h, d).transpose(0, 1) for t in layers]
        else:
            raise ValueError(f"unknown layout {spec.layout!r}")
        self.handles: SharedTensorHandles | None = (
            export_tensors(self.tensors) if share else None
        )
        self.cache = BlockMajorCache(
            self.tensors, detect_layout(self.tensors, nb, spec.layout)
        )

    @property
    def geometry(self):
        return self.cache.geometry

    def identity(self, model: str = MODEL) -> ReplicaIdentity:
        return ReplicaIdentity(model, self.geometry, self.spec.layout)

    def block_elements(self) -> int:
        """Elements of one snapshot (every layer of one block)."""
        return self.geometry.block_nbytes // self._flat.element_size()

    def read_block(self, block_id: int) -> torch.Tensor:
        """``(L, R)`` uint8: every layer of one block, read through the engine."""
        index = torch.tensor([block_id], dtype=torch.long)
        layers = [
            self.cache.gather(layer, index) for layer in range(self.spec.num_layers)
        ]
        return torch.cat(layers).cpu()

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        """Write ``(L, R)`` uint8 into every layer of one block."""
        index = torch.tensor([block_id], dtype=torch.long)
        for layer in range(self.spec.num_layers):
            self.cache.scatter(layer, index, data[layer : layer + 1])

    def fill_blocks(self, block_ids: Iterable[int], values: torch.Tensor) -> list[int]:
        """Write consecutive runs of ``values`` (of the engine dtype) into blocks."""
        ids = list(block_ids)
        size = self.block_elements()
        flat = values.reshape(-1)
        if flat.numel() != size * len(ids):
            raise ValueError(f"{flat.numel()} values for {len(ids)} blocks of {size}")
        r = self.geometry.layer_block_nbytes
        for i, block_id in enumerate(ids):
            chunk = flat[i * size : (i + 1) * size].contiguous().view(torch.uint8)
            self.write_block(block_id, chunk.reshape(self.spec.num_layers, r))
        return ids

    def fill_random(self, block_ids: Iterable[int], seed: int) -> list[int]:
        ids = list(block_ids)
        gen = torch.Generator().manual_seed(seed)
        bits = torch.randint(
            -(2**15), 2**15, (len(ids) * self.block_elements(),), generator=gen
        )
        return self.fill_blocks(ids, bits.to(torch.int16).view(self.spec.dtype))

    def blocks_equal(
        self, other: SyntheticEngine, mine: Sequence[int], theirs: Sequence[int]
    ) -> bool:
        return all(
            torch.equal(self.read_block(a), other.read_block(b))
            for a, b in zip(mine, theirs, strict=True)
        )


@contextlib.asynccontextmanager
async def nixl_pool(n_process: int) -> AsyncIterator[list[str]]:
    """A real pool: this process plus ``n_process`` sub-pool processes, every one on
    a ``nixl://`` address. Yields the addresses, the main pool's first."""
    pool = await xo.create_actor_pool(
        "127.0.0.1",
        n_process=n_process,
        external_address_schemes=["nixl"] * (n_process + 1),
    )
    async with pool:
        config = await xo.get_pool_config(pool.external_address)
        yield list(config.get_external_addresses())


class Cluster:
    """Replicas of one model, each a transfer actor in its own sub-pool process."""

    def __init__(self, addresses: list[str], tracker: Any) -> None:
        self.addresses = addresses
        self.tracker = tracker
        self.tracker_address = addresses[0]
        self.replicas: list[Any] = []  # the transfer actors added, in order

    def sub_pool(self, rank: int) -> str:
        return self.addresses[1 + rank]

    async def add_replica(
        self,
        rank: int,
        engine: SyntheticEngine,
        gpu_cache_bytes: int | None,
        cpu_capacity_blocks: int | None,
        rpc_timeout_s: float = 20.0,
        map_caches: bool = True,
        lease_ttl_s: float = 300.0,
        transport: str = DEFAULT_TRANSPORT,
    ) -> Any:
        """A transfer actor for ``engine`` in sub-pool ``rank``, its caches mapped
        the way the connector's worker side maps them."""
        config = TransferActorConfig(
            model_uid=MODEL,
            rank=rank,
            tracker_address=self.tracker_address,
            tracker_uid=tracker_uid(MODEL),
            gpu_cache_bytes=gpu_cache_bytes,
            cpu_capacity_blocks=cpu_capacity_blocks,
            rpc_timeout_s=rpc_timeout_s,
            lease_ttl_s=lease_ttl_s,
            transport=transport,
        )
        ref = await xo.create_actor(
            XavierTransferActor,
            config,
            address=self.sub_pool(rank),
            uid=transfer_actor_uid(MODEL, rank),
        )
        self.replicas.append(ref)
        if map_caches:
            identity = await ref.map_engine_caches(
                engine.handles, engine.spec.num_blocks, MODEL, engine.spec.block_size
            )
            assert identity == engine.identity()
        return ref


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """Two sub-pool processes (ranks 0 and 1) and the tracker in the main pool."""
    async with nixl_pool(2) as addresses:
        tracker = await xo.create_actor(
            BlockTrackerActor, address=addresses[0], uid=tracker_uid(MODEL)
        )
        yield Cluster(addresses, tracker)


# The mark of a test that uses ``shared_cluster``: it runs on the module's loop,
# the one the shared pools live on.
ON_SHARED_POOLS = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_pools() -> AsyncIterator[list[str]]:
    """The pools of ``cluster`` for a whole module: starting the sub-pool
    processes costs more than most tests."""
    async with nixl_pool(2) as addresses:
        yield addresses


@pytest_asyncio.fixture(loop_scope="module", name="cluster")
async def shared_cluster(shared_pools: list[str]) -> AsyncIterator[Cluster]:
    """``cluster`` on the module's pools: a tracker of the test's own, and the
    replicas the test adds and that tracker destroyed after it, so the next test
    starts from empty actors in the same processes."""
    tracker = await xo.create_actor(
        BlockTrackerActor, address=shared_pools[0], uid=tracker_uid(MODEL)
    )
    made = Cluster(shared_pools, tracker)
    try:
        yield made
    finally:
        for ref in reversed(made.replicas):  # each drains and closes first
            with contextlib.suppress(xo.ActorNotExist):
                await xo.destroy_actor(ref)
        await xo.destroy_actor(tracker)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def stage_and_register(actor: Any, items: Sequence[StageItem]) -> int:
    """Stage on ``actor`` and wait until the tracker knows the published keys (the
    actor tells it in the background), as a test that asks the tracker next needs."""
    staged: int = await actor.stage(list(items))
    await actor.wait_tracker_updates()
    return staged


async def reserve_and_start(
    loader: Any,
    holder: Any,
    keys: Sequence[bytes],
    dst_blocks: Sequence[int],
    requester: ReplicaIdentity,
    load_id: str | None = None,
) -> tuple[LeaseGrant, str]:
    """What the connector does: lease on the holder, then start the load."""
    lease_id = new_id("lease")
    grant = await holder.reserve(list(keys), lease_id, requester)
    load_id = load_id or new_id("load")
    await loader.start_load(
        LoadRequest(
            load_id, grant, holder.address, tuple(dst_blocks[: len(grant.keys)])
        )
    )
    return grant, load_id


async def load_blocks(
    loader: Any,
    holder: Any,
    keys: Sequence[bytes],
    dst_blocks: Sequence[int],
    requester: ReplicaIdentity,
    timeout: float = 60.0,
) -> tuple[LeaseGrant, LoadResult]:
    grant, load_id = await reserve_and_start(
        loader, holder, keys, dst_blocks, requester
    )
    return grant, await loader.wait_load(load_id, timeout)


def wait_until_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Block until every thread of ``pid`` is stopped (state T, after SIGSTOP), so
    that nothing in it (UCX's progress thread included) can still serve a peer."""
    deadline = time.monotonic() + timeout_s
    states: set[str] = set()
    while time.monotonic() < deadline:
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                states.add(stat.read().rsplit(")", 1)[1].split()[0])
        if states <= {"T", "t"}:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s: {states}")


# ---- the other process of the device tests ------------------------------------------


def exchange_with_child(handles: SharedTensorHandles, conn: Any) -> None:
    """Child process: import, report what it sees, write, then read the parent's write.

    Protocol (tensors a, b, c as exported by the test): send the imported values and
    whether a and b share one storage; write a[0, 0] = 7 and c[1, 2] = 3.5; wait for
    "go"; send b[1, 3] (which the parent has written meanwhile).
    """
    try:
        a, b, c = import_tensors(handles)
        same_storage = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        conn.send(
            (
                [t.float().cpu().tolist() for t in (a, b, c)],
                same_storage,
                [str(t.device) for t in (a, b, c)],
            )
        )
        a[0, 0] = 7
        c[1, 2] = 3.5
        if a.is_cuda:
            torch.cuda.synchronize()
        conn.send("written")
        if conn.recv() != "go":
            return
        conn.send(float(b[1, 3]))
    except BaseException as exc:  # report to the parent instead of dying silently
        conn.send(f"child error: {exc!r}")
    finally:
        conn.close()
