"""TieredKVSnapshotStore: sizing, staging, publish, leases, demotion, drops, bits.

Everything runs with ``device="cpu"`` (the device tier is then a CPU tensor, the code
path is the same); one test marked ``cuda`` runs the demotion path on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xinference.model.llm.vllm.xavier.stats import StoreStats
from xinference.model.llm.vllm.xavier.store import demotions
from xinference.model.llm.vllm.xavier.store.tiered import (
    StageSlot,
    TieredKVSnapshotStore,
)
from xinference.model.llm.vllm.xavier.wire import CPU_TIER, DEVICE_TIER, KVGeometry

GEOMETRY = KVGeometry(num_layers=3, layer_block_nbytes=16, logical_dtype="bfloat16")
BLOCK = GEOMETRY.block_nbytes  # 48 bytes
L, R = GEOMETRY.num_layers, GEOMETRY.layer_block_nbytes

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (none visible)"
)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> torch.Tensor:
    """Distinct bytes per snapshot and per layer, shape (L, R)."""
    return (
        ((torch.arange(L * R, dtype=torch.int64) * 7 + i * 31) % 256)
        .to(torch.uint8)
        .view(L, R)
    )


def make_store(device_blocks: float, cpu_blocks: int, device="cpu"):
    return TieredKVSnapshotStore(
        GEOMETRY,
        device=device,
        device_budget_bytes=int(device_blocks * BLOCK),
        cpu_capacity_blocks=cpu_blocks,
    )


def write_layers(store, slot: StageSlot, data: torch.Tensor, layers) -> None:
    rows = store.rows(slot.tier)
    for layer in layers:
        rows[slot.first_row + layer].copy_(data[layer])
    store.mark_layers_written(slot.key, layers)


def put(store, i: int) -> StageSlot:
    """Stage, write every layer of payload(i), publish."""
    slot = store.begin_stage(key(i), "bfloat16")
    assert slot is not None, f"snapshot {i} was not placed"
    write_layers(store, slot, payload(i), range(L))
    store.publish(key(i))
    return slot


def read(store, i: int) -> tuple[str, torch.Tensor]:
    """Tier and bytes of snapshot i, through a short lease."""
    lease_id = f"read-{i}"
    grants = store.lease(lease_id, [key(i)])
    assert len(grants) == 1, f"snapshot {i} is not published"
    tier, first_row, _ = grants[0]
    data = store.rows(tier)[first_row : first_row + L].cpu().clone()
    store.release(lease_id)
    return tier, data


def tier_of(store, i: int) -> str:
    return read(store, i)[0]


def touch(store, i: int) -> None:
    """Use snapshot i once (a lease refreshes recency)."""
    assert store.lease("touch", [key(i)])
    store.release("touch")


# ---- sizing and validation -----------------------------------------------------------


def test_device_budget_rounds_down_to_whole_snapshots():
    store = make_store(device_blocks=2.5, cpu_blocks=4)
    assert store.stats().device_capacity_blocks == 2
    assert store.stats().cpu_capacity_blocks == 4
    assert store.device_rows.shape == (2 * L, R)
    assert store.device_rows.dtype == torch.uint8
    assert store.cpu_rows.shape == (4 * L, R)
    assert store.cpu_rows.device.type == "cpu"


def test_budget_below_one_snapshot_gives_an_empty_device_tier():
    store = make_store(device_blocks=0.9, cpu_blocks=2)
    assert store.device_rows.shape == (0, R)
    assert store.stats().device_capacity_blocks == 0


@pytest.mark.parametrize(
    "budget, cpu, message",
    [
        (-1, 4, "device_budget_bytes must be non-negative"),
        (BLOCK, -1, "cpu_capacity_blocks must be non-negative"),
        (BLOCK - 1, 0, "no capacity"),
    ],
)
def test_invalid_capacities_are_refused(budget, cpu, message):
    with pytest.raises(ValueError, match=message):
        TieredKVSnapshotStore(GEOMETRY, "cpu", budget, cpu)


def test_logical_dtypes_exists_from_construction():
    """The seed's review found logical_dtypes created lazily; it must exist at once."""
    assert make_store(1, 1).logical_dtypes == {}


# ---- staging and publish -------------------------------------------------------------


def test_new_snapshots_fill_the_device_tier_first():
    store = make_store(device_blocks=2, cpu_blocks=2)
    first, second = put(store, 1), put(store, 2)
    assert (first.tier, first.slot, first.first_row) == (DEVICE_TIER, 0, 0)
    assert (second.tier, second.slot, second.first_row) == (DEVICE_TIER, 1, L)
    assert store.contains(key(1)) and store.contains(key(2))
    assert store.logical_dtypes == {key(1): "bfloat16", key(2): "bfloat16"}
    assert torch.equal(read(store, 2)[1], payload(2))


def test_publish_is_atomic():
    """A snapshot with a layer missing is invisible; publish refuses it until the
    last layer is written, then it is visible with every byte."""
    store = make_store(device_blocks=2, cpu_blocks=2)
    slot = store.begin_stage(key(1), "bfloat16")
    assert slot is not None
    write_layers(store, slot, payload(1), [0, 2])
    assert not store.contains(key(1))
    assert store.lease("early", [key(1)]) == []
    assert key(1) not in store.logical_dtypes
    with pytest.raises(ValueError, match=r"1 layer\(s\) not written yet \(layers 1\)"):
        store.publish(key(1))
    assert not store.contains(key(1))

    write_layers(store, slot, payload(1), [1])
    store.publish(key(1))
    assert store.contains(key(1))
    assert torch.equal(read(store, 1)[1], payload(1))
    assert store.stats().published == 1


def test_abort_after_partial_writes_leaves_no_trace():
    """A copy from the engine cache fails after two of three layers; the caller
    aborts. The key is unknown again, the slot is reused, and the key can be staged
    anew and published."""
    store = make_store(device_blocks=1, cpu_blocks=1)
    slot = store.begin_stage(key(1), "bfloat16")
    assert slot is not None
    write_layers(store, slot, payload(99), [0, 1])
    store.abort_stage(key(1))

    assert not store.contains(key(1))
    assert key(1) not in store.logical_dtypes
    stats = store.stats()
    assert stats.staging_snapshots == 0 and stats.published == 0
    assert stats.device_snapshots == 0 and stats.demotions == 0
    with pytest.raises(KeyError, match="not being staged"):
        store.mark_layers_written(key(1), [2])

    again = put(store, 1)
    assert (again.tier, again.slot) == (slot.tier, slot.slot)
    assert torch.equal(read(store, 1)[1], payload(1))


def test_published_snapshots_are_immutable():
    """Staging a published key again returns None and leaves its bytes alone;
    writing, publishing or aborting it again raises."""
    store = make_store(device_blocks=2, cpu_blocks=2)
    put(store, 1)
    assert store.begin_stage(key(1), "float16") is None
    assert store.logical_dtypes[key(1)] == "bfloat16"
    with pytest.raises(ValueError, match="published and immutable"):
        store.mark_layers_written(key(1), [0])
    with pytest.raises(ValueError, match="published and immutable"):
        store.publish(key(1))
    with pytest.raises(ValueError, match="published and immutable"):
        store.abort_stage(key(1))
    assert torch.equal(read(store, 1)[1], payload(1))
    assert store.stats().skips == 0  # a duplicate is not a skip


def test_staging_a_key_twice_returns_none():
    store = make_store(device_blocks=2, cpu_blocks=2)
    first = store.begin_stage(key(1), "bfloat16")
    assert first is not None
    assert store.begin_stage(key(1), "bfloat16") is None
    assert store.stats().staging_snapshots == 1


def test_mark_layers_written_validates_before_recording():
    """A call with one bad layer records none of its layers."""
    store = make_store(device_blocks=1, cpu_blocks=1)
    slot = store.begin_stage(key(1), "bfloat16")
    assert slot is not None
    with pytest.raises(ValueError, match="out of range 0..2"):
        store.mark_layers_written(key(1), [0, 3])
    with pytest.raises(ValueError, match="out of range"):
        store.mark_layers_written(key(1), [-1])
    with pytest.raises(ValueError, match="duplicate layers"):
        store.mark_layers_written(key(1), [1, 1])
    store.mark_layers_written(key(1), [0])  # 0 was not recorded by the bad call
    with pytest.raises(ValueError, match=r"layers \[0\] .* already written"):
        store.mark_layers_written(key(1), [0, 1])
    with pytest.raises(KeyError, match="not being staged"):
        store.mark_layers_written(key(2), [0])
    with pytest.raises(KeyError, match="not being staged"):
        store.publish(key(2))
    with pytest.raises(KeyError, match="not being staged"):
        store.abort_stage(key(2))


def test_empty_logical_dtype_is_refused():
    with pytest.raises(ValueError, match="logical_dtype"):
        make_store(1, 1).begin_stage(key(1), "")


def test_unknown_tier_name_is_refused():
    with pytest.raises(ValueError, match="unknown tier"):
        make_store(1, 1).rows("disk")


# ---- demotion, drops, skips ----------------------------------------------------------


def test_full_device_tier_demotes_its_least_recently_used_snapshot():
    """Device holds 1 and 2; 1 is used again, so 2 is the LRU and moves to CPU
    when 3 arrives; its bytes move intact."""
    store = make_store(device_blocks=2, cpu_blocks=4)
    put(store, 1)
    put(store, 2)
    touch(store, 1)
    slot3 = put(store, 3)
    assert slot3.tier == DEVICE_TIER
    assert tier_of(store, 2) == CPU_TIER
    assert tier_of(store, 1) == DEVICE_TIER
    assert tier_of(store, 3) == DEVICE_TIER
    for i in (1, 2, 3):
        assert torch.equal(read(store, i)[1], payload(i))
    assert store.stats().demotions == 1
    assert store.take_dropped() == []


def test_locate_refreshes_recency():
    """A read under a lease is a use: the located snapshot is not the next victim."""
    store = make_store(device_blocks=2, cpu_blocks=4)
    put(store, 1)
    put(store, 2)
    store.lease("L", [key(1), key(2)])
    store.locate("L", key(1))
    store.release("L")
    put(store, 3)
    assert tier_of(store, 2) == CPU_TIER
    assert tier_of(store, 1) == DEVICE_TIER


def test_leased_device_snapshot_is_not_demoted():
    """1 is leased and is the LRU device snapshot; 3 arriving demotes 2 instead,
    and 1 keeps its row while leased."""
    store = make_store(device_blocks=2, cpu_blocks=4)
    put(store, 1)
    put(store, 2)
    [(tier, first_row, dtype)] = store.lease("held", [key(1)])
    touch(store, 2)  # now 1 (leased) is the least recently used
    put(store, 3)
    assert store.locate("held", key(1)) == (DEVICE_TIER, first_row)
    assert (tier, dtype) == (DEVICE_TIER, "bfloat16")
    assert tier_of(store, 2) == CPU_TIER
    store.release("held")
    touch(store, 3)  # locate used 1 last; make it the LRU again
    put(store, 4)  # 1 is unleased now, so it is the one demoted
    assert tier_of(store, 1) == CPU_TIER


def test_full_cpu_tier_drops_its_lru_unleased_snapshot():
    """Zero device budget: snapshots go straight to CPU; with CPU full, the LRU
    unleased one (2, since 1 is leased) is dropped for 3 and reported once."""
    store = make_store(device_blocks=0, cpu_blocks=2)
    assert put(store, 1).tier == CPU_TIER
    put(store, 2)
    store.lease("held", [key(1)])
    touch(store, 2)
    touch(store, 1)  # 2 is now the LRU and unleased; 1 is leased
    put(store, 3)
    assert store.contains(key(1)) and store.contains(key(3))
    assert not store.contains(key(2))
    assert key(2) not in store.logical_dtypes
    assert store.take_dropped() == [key(2)]
    assert store.take_dropped() == []
    assert store.stats().drops == 1
    store.release("held")


def test_demotion_into_full_cpu_tier_drops_the_cpu_lru_first():
    """Device 1 slot, CPU 1 slot, both full: 3 arriving drops CPU's 1, demotes 2."""
    store = make_store(device_blocks=1, cpu_blocks=1)
    put(store, 1)
    put(store, 2)  # 1 demoted
    put(store, 3)  # 1 dropped, 2 demoted
    assert store.take_dropped() == [key(1)]
    assert tier_of(store, 2) == CPU_TIER and tier_of(store, 3) == DEVICE_TIER
    assert torch.equal(read(store, 2)[1], payload(2))
    stats = store.stats()
    assert (stats.demotions, stats.drops) == (2, 1)


def test_zero_cpu_capacity_drops_device_victims():
    """A device-only store: the device LRU is dropped, not demoted."""
    store = make_store(device_blocks=1, cpu_blocks=0)
    put(store, 1)
    put(store, 2)
    assert store.take_dropped() == [key(1)]
    assert store.stats().demotions == 0


def test_device_victim_is_dropped_when_cpu_tier_is_all_leased():
    """CPU full of leased snapshots cannot take a demotion; the device LRU is dropped
    so the newer snapshot still gets a device slot."""
    store = make_store(device_blocks=1, cpu_blocks=1)
    put(store, 1)
    put(store, 2)  # 1 demoted to CPU
    store.lease("cpu-held", [key(1)])
    put(store, 3)
    assert store.take_dropped() == [key(2)]
    assert tier_of(store, 1) == CPU_TIER and tier_of(store, 3) == DEVICE_TIER
    store.release("cpu-held")


def test_new_snapshot_goes_to_cpu_when_every_device_slot_is_leased():
    store = make_store(device_blocks=1, cpu_blocks=2)
    put(store, 1)
    store.lease("dev-held", [key(1)])
    assert put(store, 2).tier == CPU_TIER
    assert store.stats().demotions == 0 and store.stats().skips == 0
    store.release("dev-held")


def test_staging_snapshots_are_never_evicted():
    store = make_store(device_blocks=1, cpu_blocks=1)
    first = store.begin_stage(key(1), "bfloat16")
    assert first is not None and first.tier == DEVICE_TIER
    second = store.begin_stage(key(2), "bfloat16")
    assert second is not None and second.tier == CPU_TIER
    assert store.begin_stage(key(3), "bfloat16") is None
    assert store.stats().skips == 1


def test_skip_when_both_tiers_are_full_changes_nothing():
    """Both tiers full of leased snapshots: the new one is skipped and counted, and
    no snapshot moves or drops."""
    store = make_store(device_blocks=1, cpu_blocks=1)
    put(store, 1)
    put(store, 2)
    grants = store.lease("both", [key(1), key(2)])
    before = store.stats()
    assert store.begin_stage(key(3), "bfloat16") is None
    assert store.begin_stage(key(4), "bfloat16") is None
    after = store.stats()
    assert after.skips == before.skips + 2
    assert dataclasses.replace(after, skips=before.skips) == before
    assert store.lease("again", [key(1), key(2)]) == grants
    assert store.take_dropped() == []
    assert not store.contains(key(3))


def test_failed_demotion_copy_leaves_the_snapshot_whole(monkeypatch):
    """The device-to-CPU copy faults during a demotion: the error propagates, the
    victim is still whole on the device, no CPU slot is leaked, nothing is counted;
    the next attempt succeeds."""
    store = make_store(device_blocks=1, cpu_blocks=1)
    put(store, 1)

    def broken_copy(device):
        raise RuntimeError("injected copy fault")

    monkeypatch.setattr(demotions, "fence", broken_copy)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        store.begin_stage(key(2), "bfloat16")
    assert tier_of(store, 1) == DEVICE_TIER
    assert torch.equal(read(store, 1)[1], payload(1))
    stats = store.stats()
    assert (stats.demotions, stats.staging_snapshots) == (0, 0)
    assert not store.contains(key(2))

    monkeypatch.undo()
    put(store, 2)
    assert tier_of(store, 1) == CPU_TIER
    assert torch.equal(read(store, 1)[1], payload(1))


def test_a_batch_copies_its_demotions_together_and_undoes_them_on_a_fault(
    monkeypatch,
):
    """Staging three snapshots into a full two-slot device tier demotes both
    residents in one copy (and drops the CPU tier's oldest to make room). When that
    copy faults, the batch is undone: both residents are whole on the device again,
    no slot stays reserved; the CPU snapshot dropped for room stays dropped."""
    store = make_store(device_blocks=2, cpu_blocks=2)
    for i in (1, 2, 3, 4):
        put(store, i)  # 1 and 2 demoted to the CPU tier, 3 and 4 on the device
    assert [tier_of(store, i) for i in (1, 2, 3, 4)] == [CPU_TIER] * 2 + [
        DEVICE_TIER
    ] * 2
    store.take_dropped()

    def broken_fence(device):
        raise RuntimeError("injected copy fault")

    monkeypatch.setattr(demotions, "fence", broken_fence)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        store.begin_stage_batch([key(5), key(6)], "bfloat16")
    assert [tier_of(store, i) for i in (3, 4)] == [DEVICE_TIER] * 2
    for i in (3, 4):
        assert torch.equal(read(store, i)[1], payload(i))
    assert store.take_dropped() == [key(1), key(2)]  # made room in the CPU tier
    stats = store.stats()
    assert (stats.demotions, stats.staging_snapshots) == (2, 0)

    monkeypatch.undo()
    slots = store.begin_stage_batch([key(5), key(6), key(3)], "bfloat16")
    assert [slot.key for slot in slots] == [key(5), key(6)]  # 3 is held already
    assert {slot.tier for slot in slots} == {DEVICE_TIER}
    for i in (3, 4):
        tier, data = read(store, i)
        assert tier == CPU_TIER and torch.equal(data, payload(i))
    assert store.stats().demotions == 4


def test_demoted_snapshots_in_transit_are_neither_leased_nor_evicted():
    """Between ``reserve_stage_batch`` and ``settle_stage_batch`` a demoted
    snapshot's CPU rows are not written yet: a lease must miss it and no later
    batch may drop it; once its copy ran and the batch settled, it reads back
    whole from the CPU tier."""
    store = make_store(device_blocks=1, cpu_blocks=1)
    put(store, 1)
    batch = store.reserve_stage_batch([key(2)], "bfloat16")
    assert list(batch.demotions) == [key(1)]
    assert [slot.key for slot in batch.slots] == [key(2)]
    assert store.lease("early", [key(1)]) == []
    # The one CPU slot is in transit and the device slot is staging: no room.
    assert store.reserve_stage_batch([key(3)], "bfloat16").slots == []
    assert store.contains(key(1))
    store.copy_demotions(batch)
    store.settle_stage_batch(batch, demotions_copied=True)
    tier, data = read(store, 1)
    assert tier == CPU_TIER and torch.equal(data, payload(1))
    write_layers(store, batch.slots[0], payload(2), range(L))
    store.publish(key(2))
    tier, data = read(store, 2)
    assert tier == DEVICE_TIER and torch.equal(data, payload(2))


def test_a_batch_settled_without_its_copy_is_undone():
    """The demotions' copy did not run (it failed): the batch's slots are
    aborted and the demoted snapshot is back, whole and leasable, on the device."""
    store = make_store(device_blocks=1, cpu_blocks=1)
    put(store, 1)
    batch = store.reserve_stage_batch([key(2)], "bfloat16")
    store.settle_stage_batch(batch, demotions_copied=False)
    assert not store.is_staging(key(2)) and not store.contains(key(2))
    tier, data = read(store, 1)
    assert tier == DEVICE_TIER and torch.equal(data, payload(1))
    stats = store.stats()
    assert (stats.demotions, stats.staging_snapshots, stats.cpu_snapshots) == (0, 0, 0)
    put(store, 2)  # the CPU slot was given back
    assert tier_of(store, 1) == CPU_TIER


# ---- leases --------------------------------------------------------------------------


def test_lease_covers_the_longest_leading_run_of_published_keys():
    store = make_store(device_blocks=2, cpu_blocks=2)
    put(store, 1)
    put(store, 2)
    put(store, 3)  # 1 demoted
    staging = store.begin_stage(key(5), "bfloat16")  # 2 demoted
    assert staging is not None
    grants = store.lease("run", [key(1), key(3), key(4), key(2)])
    assert [g[0] for g in grants] == [CPU_TIER, DEVICE_TIER]
    assert all(g[2] == "bfloat16" for g in grants)
    assert store.locate("run", key(3)) == (DEVICE_TIER, grants[1][1])
    assert store.lease("staging-first", [key(5), key(1)]) == []
    with pytest.raises(KeyError, match="not held by lease"):
        store.locate("run", key(2))
    store.release("run")


def test_lease_counts_hits_by_tier():
    store = make_store(device_blocks=1, cpu_blocks=2)
    put(store, 1)
    put(store, 2)  # 1 demoted
    store.lease("x", [key(2), key(1)])
    stats = store.stats()
    assert (stats.device_hits, stats.cpu_hits) == (1, 1)
    assert stats.active_leases == 1


def test_lease_id_in_use_raises_and_release_is_idempotent():
    store = make_store(device_blocks=2, cpu_blocks=2)
    put(store, 1)
    store.lease("id", [key(1)])
    with pytest.raises(ValueError, match="already in use"):
        store.lease("id", [key(1)])
    store.release("id")
    store.release("id")
    store.release("never-existed")
    assert store.lease("id", [key(1)])  # usable again once released
    store.release("id")
    assert store.stats().active_leases == 0


def test_a_miss_records_no_lease():
    store = make_store(device_blocks=1, cpu_blocks=1)
    assert store.lease("miss", [key(7)]) == []
    assert store.stats().active_leases == 0
    with pytest.raises(KeyError, match="no active lease"):
        store.locate("miss", key(7))


def test_two_leases_on_one_snapshot_both_pin_it():
    """A snapshot leased by two requesters stays pinned until both release."""
    store = make_store(device_blocks=1, cpu_blocks=0)
    put(store, 1)
    store.lease("a", [key(1)])
    store.lease("b", [key(1)])
    store.release("a")
    assert store.begin_stage(key(2), "bfloat16") is None  # still pinned by b
    store.release("b")
    put(store, 2)
    assert store.take_dropped() == [key(1)]


def test_stats_after_a_mixed_run():
    store = make_store(device_blocks=2, cpu_blocks=1)
    for i in range(1, 5):  # 3 demotes 1; 4 drops 1 and demotes 2
        put(store, i)
    store.lease("s", [key(3), key(2)])
    assert store.stats() == StoreStats(
        device_hits=1,
        cpu_hits=1,
        demotions=2,
        drops=1,
        skips=0,
        published=4,
        device_snapshots=2,
        cpu_snapshots=1,
        device_bytes=2 * BLOCK,
        cpu_bytes=BLOCK,
        device_capacity_blocks=2,
        cpu_capacity_blocks=1,
        staging_snapshots=0,
        active_leases=1,
    )


# ---- bit exactness -------------------------------------------------------------------

BF16_GEOMETRY = KVGeometry(
    num_layers=4, layer_block_nbytes=65536 * 2 // 4, logical_dtype="bfloat16"
)


def all_bf16_patterns() -> torch.Tensor:
    """Every 16-bit pattern (NaNs, infinities, subnormals, -0) as bfloat16."""
    return (
        torch.arange(-32768, 32768, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
    )


def stage_raw(store, k: bytes, values: torch.Tensor) -> StageSlot:
    slot = store.begin_stage(k, "bfloat16")
    assert slot is not None
    raw = values.view(torch.uint8).view(BF16_GEOMETRY.num_layers, -1)
    rows = store.rows(slot.tier)
    rows[slot.first_row : slot.first_row + BF16_GEOMETRY.num_layers].copy_(raw)
    store.mark_layers_written(k, range(BF16_GEOMETRY.num_layers))
    store.publish(k)
    return slot


def read_bits(store, k: bytes) -> tuple[str, torch.Tensor]:
    [(tier, first_row, dtype)] = store.lease("bits", [k])
    assert dtype == "bfloat16"
    rows = store.rows(tier)[first_row : first_row + BF16_GEOMETRY.num_layers]
    bits = rows.cpu().contiguous().view(-1).view(torch.int16).clone()
    store.release("bits")
    return tier, bits


@pytest.mark.parametrize(
    "device, pinned",
    [
        ("cpu", False),
        pytest.param("cuda", False, marks=[pytest.mark.cuda, needs_cuda]),
        pytest.param("cuda", True, marks=[pytest.mark.cuda, needs_cuda]),
    ],
)
def test_every_bf16_bit_pattern_survives_both_tiers_and_demotion(device, pinned):
    """All 65,536 BF16 patterns are stored raw in the device tier, demoted to the
    CPU tier (page-locked, where demotions are asynchronous DMA, or pageable),
    and staged straight into the CPU tier; every read is bit-exact."""
    store = TieredKVSnapshotStore(
        BF16_GEOMETRY,
        device=device,
        device_budget_bytes=BF16_GEOMETRY.block_nbytes,
        cpu_capacity_blocks=2,
    )
    if pinned:
        assert store.pin_cpu_tier() and store.cpu_rows.is_pinned()
    else:
        assert not store.cpu_rows.is_pinned()
    assert store.device_rows.device.type == device
    patterns = all_bf16_patterns()
    expected = patterns.view(torch.int16)
    reversed_patterns = patterns.flip(0).contiguous()

    assert stage_raw(store, key(1), patterns).tier == DEVICE_TIER
    tier, bits = read_bits(store, key(1))
    assert tier == DEVICE_TIER and torch.equal(bits, expected)

    stage_raw(store, key(2), reversed_patterns)  # demotes 1
    tier, bits = read_bits(store, key(1))
    assert tier == CPU_TIER and torch.equal(bits, expected)
    tier, bits = read_bits(store, key(2))
    assert tier == DEVICE_TIER and torch.equal(bits, expected.flip(0))

    store.lease("pin-device", [key(2)])  # the next snapshot must go to the CPU tier
    assert stage_raw(store, key(3), patterns).tier == CPU_TIER
    tier, bits = read_bits(store, key(3))
    assert tier == CPU_TIER and torch.equal(bits, expected)
    assert store.stats().demotions == 1
    store.unpin_cpu_tier()
    assert not store.cpu_rows.is_pinned()


def test_a_cpu_store_has_nothing_to_page_lock():
    store = make_store(1, 2)
    assert store.pin_cpu_tier() is False
    store.unpin_cpu_tier()  # and nothing to undo
