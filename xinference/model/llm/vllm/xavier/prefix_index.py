"""Which replica holds which published snapshot, as plain data.

The block tracker keeps the authoritative index in its actor; each replica's
scheduler keeps a mirror of it (``tracker_mirror.py``) so that a prompt nobody else
holds costs no round trip. Both are this class: one structure, one prefix rule.

Every entry carries the tracker version at which it was registered, so the tracker
can answer "what has replica r's mirror seen" (``visible_upto``), and, for a key in
its holder's device tier, where it is there (row and generation, ``locate``): what a
lease-free reader needs. The tracker keeps them too, so that a mirror starting from
a snapshot can read lease-free at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .change_log import Location
from .hashing import BlockHash

# An entry is one int: the version the key was registered at in its low
# _VERSION_BITS, and above them, when its holder published a location, the row
# (_ROW_BITS) and then the generation: one int of up to 176 bits, 48 bytes where
# the version alone is 28-32. A dict of (row, generation) tuples beside the
# index, as the mirror kept them before, cost about 160 bytes more per located
# block (benchmark/location_costs.py; issue 33 counted every byte per block).
_VERSION_BITS = 64
_ROW_BITS = 48
_VERSION_MASK = (1 << _VERSION_BITS) - 1
_ROW_MASK = (1 << _ROW_BITS) - 1
_GENERATION_SHIFT = _VERSION_BITS + _ROW_BITS
_MAX_GENERATION = 1 << 63  # an int64 on the wire


def _packed_location(row: int, generation: int) -> int:
    """A location's bits above the version; 0 for "none" (generation 0, or
    values no store publishes: a reader must not trust them)."""
    if not (0 < generation < _MAX_GENERATION and 0 <= row <= _ROW_MASK):
        return 0
    return (row << _VERSION_BITS) | (generation << _GENERATION_SHIFT)


class PrefixIndex:
    """key -> holders, and rank -> keys; not thread-safe (callers lock).

    A key's holders are one int, bit ``rank`` set for each holding rank: at fleet
    scale a dict per key cost about 200 bytes of every indexed block, and a lookup
    intersects holders with one ``&`` per key instead of building a set per key.
    Ranks are replica ranks: small, non-negative.
    """

    def __init__(self) -> None:
        # key -> bit mask of the ranks holding it
        self._holders: dict[BlockHash, int] = {}
        # rank -> {key: version it was registered at, and its location (see
        # _VERSION_BITS)}
        self._blocks_of: dict[int, dict[BlockHash, int]] = {}

    def add(self, rank: int, keys: Iterable[BlockHash], version: int = 0) -> None:
        """``rank`` holds ``keys`` from ``version`` on, with no location (a key
        registered again lost whatever slot it had: its holder locates it anew)."""
        if not 0 <= version <= _VERSION_MASK:
            raise ValueError(f"version {version} out of range")
        if rank < 0:
            raise ValueError(f"a holder's rank must be >= 0, got {rank}")
        held = self._blocks_of.setdefault(rank, {})
        holders = self._holders
        bit = 1 << rank
        for key in keys:
            held[key] = version
            holders[key] = holders.get(key, 0) | bit

    def remove(self, rank: int, keys: Iterable[BlockHash]) -> None:
        held = self._blocks_of.get(rank)
        if held is None:
            return
        for key in keys:
            if held.pop(key, None) is not None:
                self._drop_holder(key, rank)

    def forget(self, rank: int) -> None:
        """Drop everything ``rank`` holds, and the rank itself."""
        for key in self._blocks_of.pop(rank, ()):
            self._drop_holder(key, rank)

    def locate(self, rank: int, locations: Iterable[Location]) -> None:
        """Where ``rank``'s keys now are in its device tier; generation 0: the
        key left it. Keys ``rank`` does not hold are ignored: a location is
        dropped with its key, never kept without one."""
        held = self._blocks_of.get(rank)
        if held is None:
            return
        # _packed_location inlined, names local: the tracker runs this for
        # every located key of the fleet
        version_mask, row_mask, top = _VERSION_MASK, _ROW_MASK, _MAX_GENERATION
        row_shift, generation_shift = _VERSION_BITS, _GENERATION_SHIFT
        for key, row, generation in locations:
            entry = held.get(key)
            if entry is None:
                continue
            if 0 < generation < top and 0 <= row <= row_mask:
                held[key] = (
                    (entry & version_mask)
                    | (row << row_shift)
                    | (generation << generation_shift)
                )
            else:
                held[key] = entry & version_mask

    def forget_locations(self, rank: int, locations: Iterable[Location]) -> None:
        """Drop these locations of ``rank``'s keys where they are still the
        ones held (a newer location, published meanwhile, stays)."""
        held = self._blocks_of.get(rank)
        if held is None:
            return
        for key, row, generation in locations:
            entry = held.get(key)
            packed = _packed_location(row, generation)
            if entry is not None and packed and entry & ~_VERSION_MASK == packed:
                held[key] = entry & _VERSION_MASK

    def locations(
        self, rank: int, keys: Sequence[BlockHash]
    ) -> list[tuple[int, int]] | None:
        """``(row, generation)`` of each of ``keys`` held by ``rank``, or None
        unless every one has a location."""
        held = self._blocks_of.get(rank)
        if held is None:
            return None
        out = []
        for key in keys:
            entry = held.get(key, 0) >> _VERSION_BITS
            if not entry:
                return None
            out.append((entry & _ROW_MASK, entry >> _ROW_BITS))
        return out

    def located_by_rank(self) -> dict[int, list[Location]]:
        """Every location held, per rank (what a snapshot carries)."""
        out: dict[int, list[Location]] = {}
        for rank, held in self._blocks_of.items():
            located = [
                (key, (entry >> _VERSION_BITS) & _ROW_MASK, entry >> _GENERATION_SHIFT)
                for key, entry in held.items()
                if entry > _VERSION_MASK
            ]
            if located:
                out[rank] = located
        return out

    def clear(self) -> None:
        self._holders.clear()
        self._blocks_of.clear()

    def holds(self, rank: int) -> bool:
        return rank in self._blocks_of

    def held_by(self, rank: int, keys: Iterable[BlockHash]) -> set[BlockHash]:
        """Those of ``keys`` that ``rank`` holds."""
        held = self._blocks_of.get(rank, {})
        return {key for key in keys if key in held}

    def num_blocks(self, rank: int) -> int:
        return len(self._blocks_of.get(rank, ()))

    def blocks_by_rank(self) -> dict[int, tuple[BlockHash, ...]]:
        return {rank: tuple(keys) for rank, keys in self._blocks_of.items()}

    def longest_prefix(
        self,
        rank: int,
        keys: Sequence[BlockHash],
        visible_upto: int | None = None,
    ) -> tuple[int, int] | None:
        """(holder, depth): the longest contiguous run of leading ``keys`` that one
        replica other than ``rank`` holds, the lowest rank among equals; None if no
        other replica holds ``keys[0]``. With ``visible_upto``, entries registered
        after that version do not count.

        A prefix split across two holders is not joined: one load comes from one peer.
        """
        others = ~(1 << rank) if rank >= 0 else -1
        candidates = -1  # every rank
        best: tuple[int, int] | None = None
        for depth, key in enumerate(keys, start=1):
            holders = self._holders.get(key, 0) & others
            if visible_upto is not None and holders:
                holders = self._visible(key, holders, visible_upto)
            candidates &= holders
            if not candidates:
                break
            best = ((candidates & -candidates).bit_length() - 1, depth)
        return best

    def _visible(self, key: BlockHash, holders: int, visible_upto: int) -> int:
        """``holders`` less the ranks whose entry for ``key`` is newer than
        ``visible_upto``."""
        remaining = holders
        while remaining:
            lowest = remaining & -remaining
            remaining ^= lowest
            holder = lowest.bit_length() - 1
            if self._blocks_of[holder][key] & _VERSION_MASK > visible_upto:
                holders ^= lowest
        return holders

    def _drop_holder(self, key: BlockHash, rank: int) -> None:
        holders = self._holders.get(key, 0) & ~(1 << rank)
        if holders:
            self._holders[key] = holders
        else:
            self._holders.pop(key, None)
