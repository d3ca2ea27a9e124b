"""The demotions that make room for a batch of new snapshots: what they move, how
their rows are copied in one go, and how they are undone when that copy fails.

When the device tier is full, a new snapshot takes the slot of the least recently
used device snapshot, which moves to the CPU tier (``TieredKVSnapshotStore``).
The move is bookkeeping first (``reserve_stage_batch``), the copy of its rows
after, for the whole batch at once: one gather, one device-to-host copy and one
fence instead of one of each per snapshot, and on a thread that is not the
store's event loop. Until the copy ran, a demoted snapshot is in transit; if the
copy fails, each one goes back, whole, into its device slot (its rows there were
not written meanwhile). This module holds that batch and those two steps; the
store decides which snapshots move.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..engine.device import fence
from ..engine.layout import copy_snapshot_rows
from ..hashing import BlockHash
from ..wire import DEVICE_TIER
from .generations import SlotGenerations
from .tier import Tier

if TYPE_CHECKING:
    from .tiered import StageSlot


@dataclass(frozen=True, slots=True)
class Demotion:
    """A device snapshot moved to the CPU tier whose rows are not copied yet."""

    device_slot: int
    cpu_slot: int


@dataclass(frozen=True, slots=True)
class StageBatch:
    """Slots reserved by ``reserve_stage_batch``, and the demotions that made room
    for them, whose copy is still to run (key -> its device and CPU slot)."""

    slots: list[StageSlot]
    demotions: dict[BlockHash, Demotion]


class _Placed(Protocol):
    """Where the store's record of a snapshot says it is."""

    tier: str
    slot: int
    generation: int


def copy_demoted_rows(
    demotions: Mapping[BlockHash, Demotion],
    device: Tier,
    cpu: Tier,
    store_device: torch.device,
) -> None:
    """Copy the rows of ``demotions`` from the device tier to their CPU slots: one
    gather, one device-to-host copy and one fence for all of them."""
    if not demotions:
        return
    copy_snapshot_rows(
        device.rows,
        [device.first_row(d.device_slot) for d in demotions.values()],
        cpu.rows,
        [cpu.first_row(d.cpu_slot) for d in demotions.values()],
        device.num_layers,
    )
    # The device slots go to new snapshots next, whose writer may use another
    # stream: the reads out of them must have completed.
    fence(store_device)


def undo_demotions(
    demotions: dict[BlockHash, Demotion],
    records: Mapping[BlockHash, _Placed],
    device: Tier,
    cpu: Tier,
    generations: SlotGenerations,
) -> None:
    """Put snapshots whose demotion copy failed back into their device slots,
    which the caller has freed again (their rows were never overwritten)."""
    for key, demotion in reversed(demotions.items()):
        record = records[key]
        cpu.order.remove(key)
        cpu.give_back_slot(demotion.cpu_slot)
        device.take_slot(demotion.device_slot)
        record.tier, record.slot = DEVICE_TIER, demotion.device_slot
        # Its rows are whole, but a new snapshot's staging made the word odd,
        # and words never go back: it is published under a new generation
        # (a reader that expected the old one recomputes, nothing worse).
        if generations.current(demotion.device_slot) % 2 == 0:
            generations.begin_rewrite(demotion.device_slot)
        record.generation = generations.publish(demotion.device_slot)
        device.order.touch(key)
