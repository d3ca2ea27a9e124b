"""One tier of the snapshot store: its rows, its free slots and the recency order
of its published snapshots. The store (``tiered.py``) decides what goes where."""

from __future__ import annotations

import heapq

import torch

from ..hashing import BlockHash
from .eviction import LRUOrder


class Tier:
    """One tier's rows, its free slots and the recency order of its published keys."""

    def __init__(
        self,
        name: str,
        num_slots: int,
        num_layers: int,
        row_nbytes: int,
        device: torch.device | str,
    ) -> None:
        self.name = name
        self.num_slots = num_slots
        self.num_layers = num_layers
        # torch.empty: bytes are only ever read from slots whose every layer was
        # written, so zero-filling would cost time (and, on CPU, touch every page)
        # for nothing.
        self.rows = torch.empty(
            (num_slots * num_layers, row_nbytes), dtype=torch.uint8, device=device
        )
        # Min-heap of free slots: the lowest free slot is reused first, which keeps
        # the occupied rows dense and placement deterministic.
        self._free: list[int] = list(range(num_slots))
        # Published snapshots only; staging ones are not eviction candidates.
        self.order: LRUOrder[BlockHash] = LRUOrder()

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free)

    def take_free_slot(self) -> int:
        return heapq.heappop(self._free)

    def give_back_slot(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def take_slot(self, slot: int) -> None:
        """Take a given free slot (to undo a move; linear, so never on a fast path)."""
        self._free.remove(slot)
        heapq.heapify(self._free)

    def first_row(self, slot: int) -> int:
        return slot * self.num_layers

    def slot_rows(self, slot: int) -> torch.Tensor:
        first = self.first_row(slot)
        return self.rows[first : first + self.num_layers]
