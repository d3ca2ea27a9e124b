"""Generation words of the device tier's slots: what makes a lease-free read safe.

A loader that reads a holder's snapshot without a lease has no pin that keeps the
slot from being reused while its READ runs. Instead each device-tier slot has one
64-bit word, written only by the holder's store, on this protocol (a sequence
lock):

- the word is odd while the slot is being (re)written: the store makes it odd
  (``begin_rewrite``) before anything writes a new snapshot's rows into the slot;
- it becomes even again, larger than ever before (``publish``), once every row of
  the new snapshot is written, and that even value is published with the key;
- a loader that expects generation ``g`` for a key reads the rows, and only after
  they have landed reads the word back: the rows are the key's if and only if the
  word still is ``g`` (``mismatches``). Any other value, odd or larger, means the
  slot was reused during or before the read; those blocks are failed and the
  engine recomputes them. A stale index entry costs a recomputation, never wrong KV.

Values only grow, so a slot reused twice never shows an old generation again. A
slot freed and not yet reused keeps its word: its rows are still the old
snapshot's, so a read of them is still correct.

The words live in CPU memory even when the tier is on a GPU: the store's thread
writes them with plain stores, ordered before the rows' copies it launches after
them (``begin_rewrite``) and after the fence that ``publish`` already requires. A
reader in another process reads them by whatever moves host memory (a NIXL READ
of the region, shared memory on one host).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..hashing import BlockHash

WORD_DTYPE = torch.int64


class SlotGenerations:
    """One generation word per device-tier slot (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be non-negative, got {num_slots}")
        # Every word starts at one even value taken from the clock: a holder
        # that restarted (a new store in the same slots) never publishes a
        # generation its previous incarnation published, so a location left
        # over from before cannot match by chance.
        start = max(2, time.time_ns() // 2 * 2)
        self.words = torch.full((num_slots,), start, dtype=WORD_DTYPE)
        self._view = self.words.numpy()  # plain stores, no torch dispatch per call

    @property
    def num_slots(self) -> int:
        return int(self.words.numel())

    def begin_rewrite(self, slot: int) -> None:
        """The slot is about to receive a new snapshot's rows: from now on a
        reader that expected its previous generation sees a mismatch."""
        word = int(self._view[slot])
        self._view[slot] = word + 1 if word % 2 == 0 else word + 2

    def publish(self, slot: int) -> int:
        """The slot's new snapshot is fully written: its generation (even, larger
        than any the slot had before), to be published with its key."""
        word = int(self._view[slot])
        if word % 2 == 0:
            raise AssertionError(
                f"slot {slot} is published without begin_rewrite (word {word})"
            )
        self._view[slot] = word + 1
        return word + 1

    def current(self, slot: int) -> int:
        return int(self._view[slot])

    def read(self, slots: Sequence[int]) -> list[int]:
        """The words of ``slots`` now (a local reader's read-back)."""
        return [int(self._view[s]) for s in slots]


def is_stable(generation: int) -> bool:
    """Whether ``generation`` can name a published snapshot (even, not 0: 0
    is what a location that left the device tier carries)."""
    return generation > 0 and generation % 2 == 0


def mismatches(expected: Sequence[int], read_back: Sequence[int]) -> list[int]:
    """Positions whose word, read back after the rows landed, is not the
    generation the loader expected: those rows may not be the key's."""
    if len(expected) != len(read_back):
        raise ValueError(
            f"{len(read_back)} generation words read back for {len(expected)} keys"
        )
    return [
        i
        for i, (want, got) in enumerate(zip(expected, read_back, strict=True))
        if not is_stable(want) or got != want
    ]


def verified_read(
    read_rows: Callable[[], None],
    read_words: Callable[[], Sequence[int]],
    expected: Sequence[int],
) -> list[int]:
    """A lease-free read: ``read_rows`` brings the rows (and returns once they
    have landed), then ``read_words`` reads the same slots' generation words; the
    positions whose word is not ``expected`` must be treated as not loaded.

    The order is the protocol: a word read before the rows could predate a reuse
    that overwrote them during the read."""
    read_rows()
    return mismatches(expected, read_words())


class _LocatesDeviceKeys(Protocol):
    def device_location(self, key: BlockHash) -> tuple[int, int] | None: ...


def device_locations(
    store: _LocatesDeviceKeys, keys: Sequence[BlockHash], only_held: bool = False
) -> list[tuple[BlockHash, int, int]]:
    """What to publish for ``keys``: ``(key, row, generation)`` of those in the
    device tier, and ``(key, 0, 0)`` (no location: it left the device tier) for
    the others unless ``only_held``."""
    out = []
    for key in keys:
        location = store.device_location(key)
        if location is not None:
            out.append((key, *location))
        elif not only_held:
            out.append((key, 0, 0))
    return out
