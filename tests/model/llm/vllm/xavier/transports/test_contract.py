"""One load contract, every device-tier transport.

``DeviceTierTransport`` (``transport.py``) promises the transfer actor: ``load``
brings every layer of the leased keys, hands them to ``scatter`` as consecutive
chunks of global rows (``(n, R)`` raw ``uint8``, in order, none missing), moves at
least the useful bytes (exactly them where the transport says so), returns only once
nothing writes into this side's memory any more, and stays usable after a load that
failed. The same tests run over ``xoscar`` (``XoscarSlabTransport``: the holder
writes into our slab with ``xo.copy_to``) and ``nixl`` (``NixlDirectTransport``: we
READ the holder's rows), each between two real processes (``transport_peers.py``).

The last tests run the contract through the transfer actor itself, once per transport
the actor offers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch
import xoscar as xo

from xinference.model.llm.vllm.xavier.actor.transfer_actor import (
    TransferActorConfig,
    XavierTransferActor,
    transfer_actor_uid,
)
from xinference.model.llm.vllm.xavier.config import TRANSPORTS
from xinference.model.llm.vllm.xavier.engine.layout import PACKED_KV_LAYOUT
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.stats import TransportStats
from xinference.model.llm.vllm.xavier.tracker import tracker_uid
from xinference.model.llm.vllm.xavier.wire import KVGeometry, LoadRequest, StageItem

from .._support import (
    MODEL,
    Cluster,
    EngineSpec,
    SyntheticEngine,
    all_bf16_patterns,
    cluster,
    load_blocks,
    new_id,
    reserve_and_start,
    stage_and_register,
)
from .peers import PeerSpec, transport_pair

__all__ = ["cluster"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(300)]

KiB = 1024
# 2 layers of 4 KiB rows: a snapshot is 8 KiB, a chunk (the slab of either
# transport: 64 snapshots, 512 KiB) 128 rows, so 100 blocks take two chunks.
GEOMETRY = KVGeometry(
    num_layers=2, layer_block_nbytes=4 * KiB, logical_dtype="bfloat16"
)
NUM_SLOTS = 128
DEVICE_TRANSPORTS = ["xoscar", "nixl"]


def random_bytes(nbytes: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return data.numpy().tobytes()


def snapshot(data: bytes, slot: int) -> bytes:
    n = GEOMETRY.block_nbytes
    return data[slot * n : (slot + 1) * n]


@pytest.fixture(params=DEVICE_TRANSPORTS)
async def pair(request):
    """(holder, loader, holder address) for one transport, 128 holder slots."""
    spec = PeerSpec(request.param, GEOMETRY, num_slots=NUM_SLOTS)
    async with transport_pair(spec) as peers:
        yield peers


# ---- the transport contract -----------------------------------------------------------


async def test_every_bf16_bit_pattern_survives(pair) -> None:
    holder, loader, holder_address = pair
    patterns = all_bf16_patterns().view(torch.uint8).numpy().tobytes()
    n = len(patterns) // GEOMETRY.block_nbytes
    assert n == 16
    await holder.write_source(40 * GEOMETRY.num_layers, patterns)
    await loader.load(holder_address, list(range(40, 40 + n)), dst_slots=list(range(n)))
    assert await loader.read_dest(0, n * GEOMETRY.num_layers) == patterns
    assert await loader.get_scatter_dtypes() == {"torch.uint8"}


@pytest.mark.parametrize("num_blocks", [1, 16, 64, 100])
async def test_a_load_arrives_whole_in_consecutive_chunks(pair, num_blocks) -> None:
    """Keys from scattered holder slots; the rows reach scatter in order, in chunks
    no larger than the transport's, covering every row once, with the right bytes;
    the counters add up."""
    holder, loader, holder_address = pair
    data = random_bytes(NUM_SLOTS * GEOMETRY.block_nbytes, seed=num_blocks)
    await holder.write_source(0, data)
    slots = [(7 * i + 3) % NUM_SLOTS for i in range(num_blocks)]  # distinct: 7 odd
    before = await loader.counters()

    await loader.load(holder_address, slots, dst_slots=list(range(num_blocks)))

    calls = await loader.take_scatter_calls()
    chunk = await loader.rows_per_chunk()
    total = num_blocks * GEOMETRY.num_layers
    assert calls[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(calls[:-1], calls[1:], strict=True))
    assert sum(n for _, n in calls) == total
    assert all(0 < n <= chunk for _, n in calls)
    assert len(calls) == -(-total // chunk)
    got = await loader.read_dest(0, total)
    assert got == b"".join(snapshot(data, s) for s in slots)

    after = await loader.counters()
    useful = num_blocks * GEOMETRY.block_nbytes
    assert after["received_useful_bytes"] - before["received_useful_bytes"] == useful
    assert after["received_wire_bytes"] - before["received_wire_bytes"] >= useful
    assert after["received_copies"] - before["received_copies"] == len(calls)
    assert after["registration_changes"] == 0


async def test_the_nixl_transport_moves_exactly_the_payload(pair) -> None:
    """Where the two differ: NIXL reads exactly the useful bytes; xoscar copies
    whole slab views (the seed's padding, which its selector keeps bounded)."""
    holder, loader, holder_address = pair
    await holder.write_source(0, random_bytes(NUM_SLOTS * GEOMETRY.block_nbytes, 1))
    for n in (1, 3, 64):
        await loader.load(holder_address, list(range(n)))
    counters = await loader.counters()
    if await loader.transport_name() == "nixl":
        assert counters["received_wire_bytes"] == counters["received_useful_bytes"]
        assert counters["descriptors"] > 0
    else:
        assert counters["received_wire_bytes"] > counters["received_useful_bytes"]


async def test_every_transport_fills_the_counters_the_metrics_read(pair) -> None:
    """The metrics read one stats type; a transport that left the load counters at
    zero would make a series silently flat under it."""
    holder, loader, holder_address = pair
    await holder.write_source(0, random_bytes(3 * GEOMETRY.block_nbytes, 4))
    before = await loader.counters()
    await loader.load(holder_address, [0, 1, 2])
    after = await loader.counters()
    assert set(after) == {f.name for f in dataclasses.fields(TransportStats)}
    assert after["loads"] - before["loads"] == 1
    assert after["received_copies"] > before["received_copies"]
    useful = after["received_useful_bytes"] - before["received_useful_bytes"]
    assert useful == 3 * GEOMETRY.block_nbytes
    assert after["received_wire_bytes"] - before["received_wire_bytes"] >= useful


async def test_an_empty_load_moves_nothing(pair) -> None:
    holder, loader, holder_address = pair
    before = await loader.counters()
    await loader.load(holder_address, [])
    assert await loader.take_scatter_calls() == []
    assert await loader.counters() == before


async def test_a_failing_scatter_fails_the_load_and_the_next_load_works(pair) -> None:
    """A consumer that raises mid-load (say, a cancelled request) ends the load with
    its error; nothing is left half-held, and the next load is whole and exact."""
    holder, loader, holder_address = pair
    data = random_bytes(NUM_SLOTS * GEOMETRY.block_nbytes, seed=21)
    await holder.write_source(0, data)
    slots = list(range(100))
    with pytest.raises(RuntimeError, match="scatter refused row 130"):
        await loader.load(holder_address, slots, fail_at_row=130)
    await loader.take_scatter_calls()
    await loader.clear_dest()
    await loader.load(holder_address, slots[:70])
    assert await loader.read_dest(0, 140) == data[: 70 * GEOMETRY.block_nbytes]


async def test_concurrent_loads_from_one_holder_do_not_mix(pair) -> None:
    holder, loader, holder_address = pair
    data = random_bytes(NUM_SLOTS * GEOMETRY.block_nbytes, seed=22)
    await holder.write_source(0, data)
    first = [(5 * i) % NUM_SLOTS for i in range(40)]
    second = [(3 * i + 1) % NUM_SLOTS for i in range(40)]
    await asyncio.gather(
        loader.load(holder_address, first, dst_slots=list(range(40))),
        loader.load(holder_address, second, dst_slots=list(range(40, 80))),
    )
    assert await loader.read_dest(0, 80) == b"".join(snapshot(data, s) for s in first)
    assert await loader.read_dest(80, 80) == b"".join(snapshot(data, s) for s in second)


# ---- through the transfer actor -------------------------------------------------------

SPEC = EngineSpec(PACKED_KV_LAYOUT, num_layers=2, num_blocks=64)


async def replica(
    cluster: Cluster, rank: int, engine: SyntheticEngine, transport: str
) -> Any:
    """A transfer actor with ``transport`` and a device tier of 32 snapshots, its
    engine caches mapped as the connector maps them."""
    config = TransferActorConfig(
        model_uid=MODEL,
        rank=rank,
        tracker_address=cluster.tracker_address,
        tracker_uid=tracker_uid(MODEL),
        gpu_cache_bytes=32 * engine.geometry.block_nbytes,
        cpu_capacity_blocks=64,
        transport=transport,
        rpc_timeout_s=20.0,
    )
    ref = await xo.create_actor(
        XavierTransferActor,
        config,
        address=cluster.sub_pool(rank),
        uid=transfer_actor_uid(MODEL, rank),
    )
    await ref.map_engine_caches(
        engine.handles, engine.spec.num_blocks, MODEL, engine.spec.block_size
    )
    return ref


def prompt_keys(n: int, salt: int) -> list[bytes]:
    tokens = [salt * 100_000 + i for i in range(n * SPEC.block_size)]
    return hash_full_blocks(tokens, SPEC.block_size, f"transport-contract-{salt}")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_actor_loads_device_tier_blocks_exactly(cluster, transport) -> None:
    """All BF16 patterns staged on the holder's device tier reach the loader's
    engine blocks bit for bit, whichever transport the deployment chose."""
    source, target = SyntheticEngine(SPEC), SyntheticEngine(SPEC)
    holder = await replica(cluster, 0, source, transport)
    loader = await replica(cluster, 1, target, transport)
    patterns = all_bf16_patterns()
    n = patterns.numel() // source.block_elements()
    blocks = source.fill_blocks(range(2, 2 + n), patterns)
    keys = prompt_keys(n, salt=1)
    assert (
        await stage_and_register(
            holder, [StageItem(k, b) for k, b in zip(keys, blocks, strict=True)]
        )
        == n
    )
    dst_blocks = list(range(63, 63 - n, -1))
    grant, result = await load_blocks(
        loader, holder, keys, dst_blocks, target.identity()
    )
    assert result.ok, result.error
    assert set(grant.tiers) == {"device"}
    loaded = torch.cat([target.read_block(b).reshape(-1) for b in dst_blocks])
    assert torch.equal(loaded.view(torch.int16), patterns.view(torch.int16))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_actor_refuses_a_logical_dtype_mismatch(cluster, transport) -> None:
    """Bytes travel raw, so a snapshot recorded as another dtype is refused before
    anything moves; a correct request for the same keys then loads exactly."""
    source, target = SyntheticEngine(SPEC), SyntheticEngine(SPEC)
    holder = await replica(cluster, 0, source, transport)
    loader = await replica(cluster, 1, target, transport)
    keys = prompt_keys(2, salt=2)
    source.fill_random([4, 5], seed=3)
    await stage_and_register(holder, [StageItem(keys[0], 4), StageItem(keys[1], 5)])
    lease_id = new_id("lease")
    grant = await holder.reserve(keys, lease_id, target.identity())
    wrong = dataclasses.replace(grant, logical_dtypes=("float16",) * len(grant.keys))
    with pytest.raises(ValueError, match="dtype"):
        await loader.start_load(
            LoadRequest(new_id("load"), wrong, holder.address, (10, 11))
        )
    _, load_id = await reserve_and_start(
        loader, holder, keys, [10, 11], target.identity()
    )
    result = await loader.wait_load(load_id, 60)
    assert result.ok, result.error
    assert source.blocks_equal(target, [4, 5], [10, 11])
