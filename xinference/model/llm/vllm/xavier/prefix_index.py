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
    """key -> holders, and rank -> keys; not thread-safe (callers lock)."""

    def __init__(self) -> None:
        # key -> {rank: version it was registered at}, first holder first
        self._holders: dict[BlockHash, dict[int, int]] = {}
        # rank -> keys it holds
        self._blocks_of: dict[int, set[BlockHash]] = {}

    def add(self, rank: int, keys: Iterable[BlockHash], version: int = 0) -> None:
        held = self._blocks_of.setdefault(rank, set())
        for key in keys:
            self._holders.setdefault(key, {})[rank] = version
            held.add(key)

    def remove(self, rank: int, keys: Iterable[BlockHash]) -> None:
        held = self._blocks_of.get(rank)
        if held is None:
            return
        for key in keys:
            held.discard(key)
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
        candidates: set[int] | None = None
        best: tuple[int, int] | None = None
        for depth, key in enumerate(keys, start=1):
            holders = {
                holder
                for holder, version in self._holders.get(key, {}).items()
                if holder != rank and (visible_upto is None or version <= visible_upto)
            }
            candidates = holders if candidates is None else candidates & holders
            if not candidates:
                break
            best = (min(candidates), depth)
        return best

    def _drop_holder(self, key: BlockHash, rank: int) -> None:
        ranks = self._holders.get(key)
        if ranks is not None:
            ranks.pop(rank, None)
            if not ranks:
                del self._holders[key]
