"""Which replica holds which published snapshot, as plain data.

The block tracker keeps the authoritative index in its actor; each replica's
scheduler keeps a mirror of it (``tracker_mirror.py``) so that a prompt nobody else
holds costs no round trip. Both are this class: one structure, one prefix rule.

Every entry carries the tracker version at which it was registered, so the tracker
can answer "what has replica r's mirror seen" (``visible_upto``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .hashing import BlockHash


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
        # rank -> {key: version it was registered at}
        self._blocks_of: dict[int, dict[BlockHash, int]] = {}

    def add(self, rank: int, keys: Iterable[BlockHash], version: int = 0) -> None:
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

    def clear(self) -> None:
        self._holders.clear()
        self._blocks_of.clear()

    def holds(self, rank: int) -> bool:
        return rank in self._blocks_of

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
            if self._blocks_of[holder][key] > visible_upto:
                holders ^= lowest
        return holders

    def _drop_holder(self, key: BlockHash, rank: int) -> None:
        holders = self._holders.get(key, 0) & ~(1 << rank)
        if holders:
            self._holders[key] = holders
        else:
            self._holders.pop(key, None)
