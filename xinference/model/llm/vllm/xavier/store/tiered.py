"""The tiered KV snapshot store: a device tier and a CPU tier of whole-block snapshots.

A snapshot is one engine KV block of every layer, keyed by its content hash. It is
stored as ``L = geometry.num_layers`` rows of ``R = geometry.layer_block_nbytes``
bytes in one of two ``uint8`` tensors of shape ``(slots * L, R)``: the device tier
(on the store's device, bounded by a byte budget) and the CPU tier (bounded by a
block count). Slot ``s`` of a tier holds rows ``s*L .. s*L + L - 1``, row ``s*L + l``
being layer ``l``.

Life of a snapshot::

    begin_stage -> (caller writes rows) -> mark_layers_written ... -> publish
          \\-> abort_stage (rollback: slot freed, no trace)

Only published snapshots are visible (``contains``, ``lease``); they are immutable
and may move from the device tier to the CPU tier (demotion) or be dropped, but never
while leased. Eviction policy (recency, pins) lives in ``eviction.LRUOrder``, a
tier's rows and free slots in ``tier.Tier``; this module owns placement and states.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..engine.device import HostPin
from ..hashing import BlockHash
from ..stats import StoreStats
from ..wire import CPU_TIER, DEVICE_TIER, KVGeometry
from .demotions import Demotion, StageBatch, copy_demoted_rows, undo_demotions
from .generations import SlotGenerations
from .tier import Tier


class SnapshotState(enum.Enum):
    STAGING = "staging"  # slot reserved, layers being written; invisible to peers
    PUBLISHED = "published"  # every layer written; visible and immutable


@dataclass(frozen=True, slots=True)
class StageSlot:
    """Where to write a staged snapshot: rows ``first_row .. first_row + L - 1`` of
    the ``tier`` tensor (``store.rows(tier)``), row ``first_row + layer`` per layer."""

    key: BlockHash
    tier: str
    slot: int
    first_row: int


@dataclass(slots=True)
class _Snapshot:
    """The store's record of one snapshot (mutable, private)."""

    key: BlockHash
    tier: str
    slot: int
    logical_dtype: str
    state: SnapshotState = SnapshotState.STAGING
    written_layers: set[int] = field(default_factory=set)
    generation: int = 0  # device tier, published: its slot's generation word


@dataclass(frozen=True, slots=True)
class _Lease:
    keys: tuple[BlockHash, ...]  # leased keys in grant order (may be empty)
    key_set: frozenset[BlockHash]


class TieredKVSnapshotStore:
    """Snapshots of KV blocks in a device tier and a CPU tier, with leases.

    Policy for a new snapshot (``begin_stage``), planned before any state changes so
    that a placement either happens completely or not at all:

    1. a free device slot;
    2. else the least recently used unleased published device snapshot is demoted to
       the CPU tier (into a free CPU slot, or the slot of the CPU tier's LRU unleased
       snapshot, which is dropped); if the CPU tier has no room at all, that device
       snapshot is dropped instead; the new snapshot takes its device slot;
    3. else (zero device budget, or every device slot leased or staging) the new
       snapshot goes to the CPU tier: a free slot or the CPU LRU unleased snapshot's;
    4. else it is skipped and counted.

    Capacities: ``device_budget_bytes`` is rounded down to whole snapshots (0 means
    no device tier); ``cpu_capacity_blocks`` may be 0 (no CPU tier: victims of the
    device tier are dropped). A store with neither is refused, since every snapshot
    would be skipped.

    Not thread-safe by design: one transfer actor owns the store and calls it from
    its event loop, one call at a time, so there are no locks inside. Calls are
    bookkeeping, except the demotions' copy: ``begin_stage_batch`` runs it in
    place, ``copy_demotions`` on whatever thread calls it (it reads only its batch
    and the tier tensors, whose rows the batch has reserved).
    """

    def __init__(
        self,
        geometry: KVGeometry,
        device: torch.device | str,
        device_budget_bytes: int,
        cpu_capacity_blocks: int,
    ) -> None:
        if device_budget_bytes < 0:
            raise ValueError(
                f"device_budget_bytes must be non-negative, got {device_budget_bytes}"
            )
        if cpu_capacity_blocks < 0:
            raise ValueError(
                f"cpu_capacity_blocks must be non-negative, got {cpu_capacity_blocks}"
            )
        device_slots = device_budget_bytes // geometry.block_nbytes
        if device_slots == 0 and cpu_capacity_blocks == 0:
            raise ValueError(
                f"the store has no capacity: a device budget of {device_budget_bytes} "
                f"bytes holds no {geometry.block_nbytes}-byte snapshot and "
                "cpu_capacity_blocks is 0"
            )
        self.geometry = geometry
        self.device = torch.device(device)
        num_layers, row_nbytes = geometry.num_layers, geometry.layer_block_nbytes
        self._device_tier = Tier(
            DEVICE_TIER, device_slots, num_layers, row_nbytes, self.device
        )
        self._cpu_tier = Tier(
            CPU_TIER, cpu_capacity_blocks, num_layers, row_nbytes, "cpu"
        )
        self._tiers = {DEVICE_TIER: self._device_tier, CPU_TIER: self._cpu_tier}
        # the CPU tier page-locked while the store is on a GPU (``pin_cpu_tier``)
        self._cpu_pin = HostPin(self._cpu_tier.rows)
        # one word per device slot, for lease-free reads (``generations.py``)
        self.generations = SlotGenerations(device_slots)

        # key -> record, for staging and published snapshots alike.
        self._snapshots: dict[BlockHash, _Snapshot] = {}
        # key -> logical dtype name ("bfloat16", ...), published snapshots only.
        self.logical_dtypes: dict[BlockHash, str] = {}
        # lease id -> the keys it pins.
        self._leases: dict[str, _Lease] = {}
        # keys dropped since the last take_dropped(), in drop order.
        self._dropped: list[BlockHash] = []
        # keys demoted out of the device tier since the last take_demoted()
        self._demoted: list[BlockHash] = []

        self._device_hits = 0
        self._cpu_hits = 0
        self._demotions = 0
        # demotions whose copy is queued, while reserve_stage_batch runs
        self._pending_demotions: dict[BlockHash, Demotion] | None = None
        # demoted snapshots whose CPU rows are not written yet (see StageBatch)
        self._in_transit: set[BlockHash] = set()
        self._drops = 0
        self._skips = 0
        self._published = 0

    # ---- tensors ----------------------------------------------------------------

    @property
    def device_rows(self) -> torch.Tensor:
        """``(device_slots * L, R)`` uint8 on the store's device; may have 0 rows."""
        return self._device_tier.rows

    @property
    def cpu_rows(self) -> torch.Tensor:
        """``(cpu_slots * L, R)`` uint8 on CPU; may have 0 rows."""
        return self._cpu_tier.rows

    def pin_cpu_tier(self) -> bool:
        """Page-lock the CPU tier when the store is on a GPU: demotions are then
        one DMA transfer per run at the host link's speed (into pageable memory
        they crawl through the driver's bounce buffers and fault every page in,
        which kept an H100's staging ring full). Whether it is pinned now.
        Blocking, seconds for a large tier: call it from a worker thread."""
        if self.device.type != "cuda":
            return False
        return self._cpu_pin.pin()

    def unpin_cpu_tier(self) -> None:
        """Undo ``pin_cpu_tier`` (before the store is dropped)."""
        self._cpu_pin.unpin()

    def rows(self, tier: str) -> torch.Tensor:
        """The rows tensor of ``tier`` (``DEVICE_TIER`` or ``CPU_TIER``)."""
        return self._tier(tier).rows

    # ---- staging ------------------------------------------------------------------

    def begin_stage(self, key: BlockHash, logical_dtype: str) -> StageSlot | None:
        """Reserve a slot for ``key``; None if the key is already published or being
        staged (nothing is overwritten), or if no room can be made (counted skip).

        May demote or drop unleased published snapshots to make room.
        """
        slots = self.begin_stage_batch([key], logical_dtype)
        return slots[0] if slots else None

    def begin_stage_batch(
        self, keys: Sequence[BlockHash], logical_dtype: str
    ) -> list[StageSlot]:
        """``begin_stage`` for each of ``keys``, in order; returns the slots reserved
        (keys already held, or for which no room could be made, have none).

        The demotions that make room are copied together, one device-to-host copy
        and one fence for the batch instead of one each. If that copy fails, the
        error propagates and the batch is undone: no slot stays reserved, and each
        demoted snapshot is back, whole, in its device slot (its rows there were not
        written meanwhile). CPU snapshots dropped to make room stay dropped
        (``take_dropped`` reports them).

        Copies on the calling thread; ``reserve_stage_batch`` lets a caller on an
        event loop run the copy elsewhere.
        """
        batch = self.reserve_stage_batch(keys, logical_dtype)
        try:
            self.copy_demotions(batch)
        except BaseException:
            self.settle_stage_batch(batch, demotions_copied=False)
            raise
        self.settle_stage_batch(batch, demotions_copied=True)
        return batch.slots

    def reserve_stage_batch(
        self, keys: Sequence[BlockHash], logical_dtype: str
    ) -> StageBatch:
        """The bookkeeping of ``begin_stage_batch``, without the demotions' copy.

        The demoted snapshots are in transit until ``settle_stage_batch``: not
        leasable (a miss for whoever asks) nor evictable, since their CPU rows are
        not written yet. The caller runs ``copy_demotions(batch)`` (on any thread:
        it reads only the batch and the tier tensors) before writing the batch's
        slots, whose device rows the demotions read, then settles the batch on the
        thread that owns the store.
        """
        if not isinstance(logical_dtype, str) or not logical_dtype:
            raise ValueError(
                f"logical_dtype must be a dtype name, got {logical_dtype!r}"
            )
        pending: dict[BlockHash, Demotion] = {}
        self._pending_demotions = pending
        reserved: list[StageSlot] = []
        try:
            for key in keys:
                if key in self._snapshots:
                    continue
                placement = self._make_room()
                if placement is None:
                    self._skips += 1
                    continue
                tier, slot = placement
                if tier is self._device_tier:
                    # before anything writes the slot: lease-free readers of its
                    # previous snapshot see the change
                    self.generations.begin_rewrite(slot)
                self._snapshots[key] = _Snapshot(key, tier.name, slot, logical_dtype)
                reserved.append(StageSlot(key, tier.name, slot, tier.first_row(slot)))
        except BaseException:
            for stage_slot in reversed(reserved):
                self.abort_stage(stage_slot.key)
            self._undo_demotions(pending)
            raise
        finally:
            self._pending_demotions = None
        for key in pending:
            self._cpu_tier.order.pin(key)
            self._in_transit.add(key)
        return StageBatch(reserved, pending)

    def copy_demotions(self, batch: StageBatch) -> None:
        """Copy the rows of ``batch``'s demotions from the device tier to their CPU
        slots: one gather, one device-to-host copy and one fence for all of them."""
        copy_demoted_rows(
            batch.demotions, self._device_tier, self._cpu_tier, self.device
        )

    def settle_stage_batch(self, batch: StageBatch, demotions_copied: bool) -> None:
        """End the transit of ``batch``'s demotions. Copied: they are leasable in
        the CPU tier. Not copied: the batch is undone as ``begin_stage_batch``
        says (its slots still staging are aborted, the demoted snapshots go back to
        their device slots); the batch's slots must not have been written then."""
        for key in batch.demotions:
            self._in_transit.discard(key)
            self._cpu_tier.order.unpin(key)
        if demotions_copied:
            return
        for stage_slot in reversed(batch.slots):
            if self.is_staging(stage_slot.key):
                self.abort_stage(stage_slot.key)
        self._undo_demotions(batch.demotions)

    def mark_layers_written(self, key: BlockHash, layers: Iterable[int]) -> None:
        """Record that the caller wrote these layers' rows; each layer exactly once.

        Validated as a whole before anything is recorded, so a bad call records
        nothing.
        """
        record = self._staging_record(key, "mark layers of")
        layers = list(layers)
        num_layers = self.geometry.num_layers
        for layer in layers:
            if not 0 <= layer < num_layers:
                raise ValueError(
                    f"layer {layer} of {key.hex()} is out of range 0..{num_layers - 1}"
                )
        if len(set(layers)) != len(layers):
            raise ValueError(f"duplicate layers in {layers} for {key.hex()}")
        again = record.written_layers.intersection(layers)
        if again:
            raise ValueError(
                f"layers {sorted(again)} of {key.hex()} were already written"
            )
        record.written_layers.update(layers)

    def publish(self, key: BlockHash) -> None:
        """Make a fully written snapshot visible; from now on it is immutable.

        On CUDA the caller must have fenced its writes first (the store cannot see
        another stream's pending copies).
        """
        record = self._staging_record(key, "publish")
        missing = self.geometry.num_layers - len(record.written_layers)
        if missing:
            absent = sorted(
                set(range(self.geometry.num_layers)) - record.written_layers
            )
            raise ValueError(
                f"cannot publish {key.hex()}: {missing} layer(s) not written yet "
                f"({_abbreviate(absent)})"
            )
        record.state = SnapshotState.PUBLISHED
        record.written_layers = set()  # no longer needed; published means complete
        if record.tier == DEVICE_TIER:
            record.generation = self.generations.publish(record.slot)
        self._tier(record.tier).order.touch(key)
        self.logical_dtypes[key] = record.logical_dtype
        self._published += 1

    def abort_stage(self, key: BlockHash) -> None:
        """Roll back a staging snapshot: its slot is free again and nothing remains."""
        record = self._staging_record(key, "abort")
        del self._snapshots[key]
        self._tier(record.tier).give_back_slot(record.slot)

    def is_staging(self, key: BlockHash) -> bool:
        """True while ``key`` has a reserved slot and is not published yet."""
        record = self._snapshots.get(key)
        return record is not None and record.state is SnapshotState.STAGING

    def contains(self, key: BlockHash) -> bool:
        """True only for a published snapshot."""
        record = self._snapshots.get(key)
        return record is not None and record.state is SnapshotState.PUBLISHED

    # ---- leases -------------------------------------------------------------------

    def lease(
        self, lease_id: str, keys: Iterable[BlockHash]
    ) -> list[tuple[str, int, str]]:
        """Pin the longest leading run of published ``keys`` under ``lease_id``.

        Returns ``(tier, first_row, logical_dtype)`` per leased key, in order; an
        empty list is a miss and records no lease. Leasing refreshes recency and
        counts a hit per key in its tier. An id that holds an active lease raises;
        an id may be used again once released.
        """
        if lease_id in self._leases:
            raise ValueError(f"lease id {lease_id!r} is already in use")
        leased: list[BlockHash] = []
        grants: list[tuple[str, int, str]] = []
        for key in keys:
            record = self._snapshots.get(key)
            if (
                record is None
                or record.state is not SnapshotState.PUBLISHED
                or key in self._in_transit
            ):
                break
            tier = self._tier(record.tier)
            tier.order.touch(key)
            tier.order.pin(key)
            if tier.name == DEVICE_TIER:
                self._device_hits += 1
            else:
                self._cpu_hits += 1
            leased.append(key)
            grants.append(
                (tier.name, tier.first_row(record.slot), record.logical_dtype)
            )
        if leased:
            self._leases[lease_id] = _Lease(tuple(leased), frozenset(leased))
        return grants

    def release(self, lease_id: str) -> None:
        """Unpin everything ``lease_id`` holds; releasing twice or an unknown id is a
        no-op (a requester may release after a timeout that already released)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return
        for key in lease.keys:
            self._tier(self._snapshots[key].tier).order.unpin(key)

    def locate(self, lease_id: str, key: BlockHash) -> tuple[str, int]:
        """``(tier, first_row)`` of ``key`` as leased by ``lease_id``.

        A read under a lease counts as a use, so it refreshes recency.
        """
        lease = self._leases.get(lease_id)
        if lease is None:
            raise KeyError(f"no active lease {lease_id!r}")
        if key not in lease.key_set:
            raise KeyError(f"{key.hex()} is not held by lease {lease_id!r}")
        record = self._snapshots[key]
        tier = self._tier(record.tier)
        tier.order.touch(key)
        return tier.name, tier.first_row(record.slot)

    def device_location(self, key: BlockHash) -> tuple[int, int] | None:
        """``(first_row, generation)`` of a published device-tier snapshot, for a
        lease-free read (``generations.py``); None elsewhere. Counts no use."""
        record = self._snapshots.get(key)
        if (
            record is None
            or record.tier != DEVICE_TIER
            or record.state is not SnapshotState.PUBLISHED
        ):
            return None
        return self._device_tier.first_row(record.slot), record.generation

    # ---- reporting ----------------------------------------------------------------

    def locate_device_rows(self, lease_id: str, keys: Sequence[BlockHash]) -> list[int]:
        """The device-tier row of layer 0 of each leased key (its layers follow).

        A key in the CPU tier is an error: the caller asked the wrong path for it.
        """
        rows = []
        for key in keys:
            tier, first_row = self.locate(lease_id, key)
            if tier != DEVICE_TIER:
                raise ValueError(
                    f"snapshot {key.hex()} under lease {lease_id!r} is in the {tier} "
                    "tier; only device tier snapshots move over the device-tier "
                    "transport"
                )
            rows.append(first_row)
        return rows

    def take_demoted(self) -> list[BlockHash]:
        """Keys moved out of the device tier since the last call (their published
        locations are stale; an undone move is listed too)."""
        demoted, self._demoted = self._demoted, []
        return demoted

    def take_dropped(self) -> list[BlockHash]:
        """Keys dropped since the last call, oldest first (to unregister them)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def stats(self) -> StoreStats:
        """Counters since construction and the current occupancy of each tier."""
        block = self.geometry.block_nbytes
        device_published = len(self._device_tier.order)
        cpu_published = len(self._cpu_tier.order)
        return StoreStats(
            device_hits=self._device_hits,
            cpu_hits=self._cpu_hits,
            demotions=self._demotions,
            drops=self._drops,
            skips=self._skips,
            published=self._published,
            device_snapshots=device_published,
            cpu_snapshots=cpu_published,
            device_bytes=device_published * block,
            cpu_bytes=cpu_published * block,
            device_capacity_blocks=self._device_tier.num_slots,
            cpu_capacity_blocks=self._cpu_tier.num_slots,
            staging_snapshots=len(self._snapshots) - device_published - cpu_published,
            active_leases=len(self._leases),
        )

    # ---- internals ----------------------------------------------------------------

    def _tier(self, name: str) -> Tier:
        try:
            return self._tiers[name]
        except KeyError:
            raise ValueError(
                f"unknown tier {name!r}; expected {DEVICE_TIER!r} or {CPU_TIER!r}"
            ) from None

    def _staging_record(self, key: BlockHash, action: str) -> _Snapshot:
        record = self._snapshots.get(key)
        if record is None:
            raise KeyError(f"cannot {action} {key.hex()}: it is not being staged")
        if record.state is SnapshotState.PUBLISHED:
            raise ValueError(
                f"cannot {action} {key.hex()}: it is published and immutable"
            )
        return record

    def _make_room(self) -> tuple[Tier, int] | None:
        """Take a slot for a new snapshot, evicting as the policy says; None when no
        slot can be had, in which case nothing has changed.

        Every decision is made from the current state before the first mutation, so
        the mutations that follow cannot fail for want of room. Only a fault in the
        demotion copy can interrupt them; then the device snapshot is still whole in
        its slot, a CPU snapshot dropped to make room stays dropped (and is reported
        by ``take_dropped``), no slot is taken, and the error propagates.
        """
        device, cpu = self._device_tier, self._cpu_tier
        if device.has_free_slot:
            return device, device.take_free_slot()

        device_victim = device.order.oldest_evictable()
        cpu_victim = None if cpu.has_free_slot else cpu.order.oldest_evictable()
        cpu_has_room = cpu.has_free_slot or cpu_victim is not None

        if device_victim is not None:
            if cpu_has_room:
                if cpu_victim is not None:
                    self._drop(cpu_victim)
                self._demote(device_victim)
            else:
                self._drop(device_victim)
            return device, device.take_free_slot()

        if cpu_victim is not None:
            self._drop(cpu_victim)
        if cpu.has_free_slot:
            return cpu, cpu.take_free_slot()
        return None

    def _undo_demotions(self, demotions: dict[BlockHash, Demotion]) -> None:
        undo_demotions(
            demotions,
            self._snapshots,
            self._device_tier,
            self._cpu_tier,
            self.generations,
        )
        self._demotions -= len(demotions)

    def _drop(self, key: BlockHash) -> None:
        """Forget an unleased published snapshot and free its slot."""
        record = self._snapshots[key]
        tier = self._tier(record.tier)
        tier.order.remove(key)  # raises if pinned: a leased snapshot never drops
        del self._snapshots[key]
        del self.logical_dtypes[key]
        tier.give_back_slot(record.slot)
        if self._pending_demotions is not None:
            # Demoted earlier in this batch and dropped again: nothing to copy.
            self._pending_demotions.pop(key, None)
        self._dropped.append(key)
        self._drops += 1

    def _demote(self, key: BlockHash) -> None:
        """Move an unleased published device snapshot into a free CPU slot.

        Only the bookkeeping happens here; the copy is queued for the batch
        (``reserve_stage_batch``), which keeps the key in transit, neither leasable
        nor evictable, until the copy has run; a failed copy undoes the move.
        """
        assert self._pending_demotions is not None, "demotions happen in a batch"
        record = self._snapshots[key]
        device, cpu = self._device_tier, self._cpu_tier
        if device.order.is_pinned(key):
            raise AssertionError(f"{key.hex()} is leased and must not be demoted")
        cpu_slot = cpu.take_free_slot()
        self._pending_demotions[key] = Demotion(record.slot, cpu_slot)
        device.order.remove(key)
        device.give_back_slot(record.slot)
        record.tier, record.slot = CPU_TIER, cpu_slot
        self._demoted.append(key)
        # The demoted snapshot is the CPU tier's most recent arrival.
        cpu.order.touch(key)
        self._demotions += 1


def _abbreviate(values: list[int], limit: int = 8) -> str:
    """``[0, 1, 2]`` -> ``"layers 0, 1, 2"``, shortened past ``limit`` entries."""
    shown = ", ".join(str(v) for v in values[:limit])
    more = f", ... ({len(values) - limit} more)" if len(values) > limit else ""
    return f"layers {shown}{more}"
