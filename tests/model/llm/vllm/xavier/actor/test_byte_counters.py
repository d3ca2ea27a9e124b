"""Byte counters count every tier's loads, over real pools and real transports.

A user who loads from a peer's CPU tier (the default without a device budget) once
saw ``xavier_received_*_bytes_total`` and the stats' transport section read 0 while
megabytes moved: only the device-tier transport counted bytes. Here each tier's
loads are checked in the stats (``transport`` for the device tier,
``cpu_tier_transport`` for the CPU tier, on the loader and on the holder) and in the
Prometheus series, which add both tiers.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from xinference.core.messages import ReplicaStats
from xinference.core.metrics import ReplicaSample, render
from xinference.model.llm.vllm.xavier.wire import CPU_TIER, DEVICE_TIER

from .._support import (
    ON_SHARED_POOLS,
    load_blocks,
    shared_cluster,
    shared_pools,
    stage_and_register,
)
from .test_transfer_actor import SPEC, holder_and_loader, prompt_keys, stage_items

__all__ = ["shared_cluster", "shared_pools"]  # the fixtures, imported for pytest

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(180)]

NUM_BLOCKS = 8


def received_bytes_series(stats, rank: int) -> dict[str, float]:
    """The loader's received-bytes series as a scrape shows them."""
    sample = ReplicaSample(
        ReplicaStats(
            model_uid="m",
            rank=rank,
            block_size=SPEC.block_size,
            requests_total=0,
            requests_in_flight=0,
            prompt_tokens_total=0,
            cached_prompt_tokens_total=0,
            generated_tokens_total=0,
            xavier=stats,
        )
    )
    text = render([sample]).decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("xavier_received_")
    }


@pytest.mark.parametrize(
    "transport, budget_blocks, tiers",
    [
        pytest.param("nixl", 32, {DEVICE_TIER: NUM_BLOCKS}, id="device-tier-nixl"),
        pytest.param("xoscar", 32, {DEVICE_TIER: NUM_BLOCKS}, id="device-tier-xoscar"),
        pytest.param("nixl", None, {CPU_TIER: NUM_BLOCKS}, id="cpu-tier"),
        pytest.param("nixl", 2, {DEVICE_TIER: 2, CPU_TIER: 6}, id="both-tiers"),
    ],
)
@ON_SHARED_POOLS
async def test_received_and_sent_bytes_count_each_tier(
    cluster, transport, budget_blocks, tiers
):
    """Eight blocks staged on the holder (on its device tier, its CPU tier, or two
    on the device tier and six demoted), loaded by the other replica: each tier's
    counters carry exactly its snapshots' bytes, and the scrape their sum."""
    # bf16 K and V of every layer of one block
    block_nbytes = (
        SPEC.num_layers * SPEC.kv_heads * SPEC.block_size * 2 * SPEC.head_size * 2
    )
    budget = None if budget_blocks is None else budget_blocks * block_nbytes
    (_, target), holder, loader = await holder_and_loader(
        cluster, budget, transport=transport
    )
    keys = prompt_keys(NUM_BLOCKS, salt=3)
    src_blocks = list(range(1, 1 + NUM_BLOCKS))
    for i in range(0, NUM_BLOCKS, 2):  # two blocks a step, as an engine stages
        items = stage_items(keys[i : i + 2], src_blocks[i : i + 2])
        assert await stage_and_register(holder, items) == 2
    grant, result = await load_blocks(
        loader, holder, keys, list(range(20, 20 + NUM_BLOCKS)), target.identity()
    )
    assert result.ok, result.error
    assert {t: grant.tiers.count(t) for t in set(grant.tiers)} == tiers

    loaded = await loader.stats()
    served = await holder.stats()
    device_bytes = tiers.get(DEVICE_TIER, 0) * block_nbytes
    cpu_bytes = tiers.get(CPU_TIER, 0) * block_nbytes
    # the device tier's transport: exactly the payload useful, at least it on the wire
    assert loaded.transport.received_useful_bytes == device_bytes
    assert loaded.transport.received_wire_bytes >= device_bytes
    # the CPU tier's replies: the rows and nothing else
    cpu = loaded.cpu_tier_transport
    assert cpu.received_useful_bytes == cpu.received_wire_bytes == cpu_bytes
    assert cpu.received_copies == (1 if cpu_bytes else 0)
    assert cpu.loads == (1 if cpu_bytes else 0)
    assert cpu.transfer_failures == cpu.transfer_timeouts == 0
    assert served.cpu_tier_transport.sent_useful_bytes == cpu_bytes
    assert served.cpu_tier_transport.sent_wire_bytes == cpu_bytes

    series = received_bytes_series(loaded, 1)
    assert series["xavier_received_useful_bytes_total"] == device_bytes + cpu_bytes
    assert series["xavier_received_wire_bytes_total"] >= device_bytes + cpu_bytes
