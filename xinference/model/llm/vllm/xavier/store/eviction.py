"""Recency order with pinning: the eviction policy of the snapshot store, nothing else.

``LRUOrder`` knows keys and their order of use, and which keys are pinned (leased).
It holds no data and imports neither torch nor xoscar, so the policy is tested with
plain values and the store only asks it "which key would you give up first?".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LRUOrder(Generic[K]):
    """Keys from least to most recently used, some of them pinned.

    A pin is counted: a key pinned twice (two leases) stays pinned until unpinned
    twice. A pinned key keeps its place in the order (``touch`` still refreshes it)
    but is never offered by ``oldest_evictable`` and cannot be removed.

    ``oldest_evictable`` walks from the oldest key and skips pinned ones, so it costs
    O(pinned + 1) in the usual case; leases are short-lived, which keeps that small.
    """

    def __init__(self) -> None:
        # key -> None; insertion order is recency order (first = least recent).
        self._order: OrderedDict[K, None] = OrderedDict()
        # key -> number of outstanding pins (> 0); absent means unpinned.
        self._pins: dict[K, int] = {}

    def touch(self, key: K) -> None:
        """Insert ``key`` as the most recently used, or move it there."""
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        """Forget ``key``; a pinned key cannot be removed (that is the pin's point)."""
        if key not in self._order:
            raise KeyError(f"{key!r} is not in the recency order")
        if key in self._pins:
            raise ValueError(
                f"{key!r} is pinned {self._pins[key]} time(s) and cannot be removed"
            )
        del self._order[key]

    def pin(self, key: K) -> None:
        """Protect ``key`` from eviction until a matching ``unpin``."""
        if key not in self._order:
            raise KeyError(f"cannot pin {key!r}: it is not in the recency order")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: K) -> None:
        """Undo one ``pin``; unpinning a key that is not pinned is a caller bug."""
        count = self._pins.get(key)
        if count is None:
            raise KeyError(f"cannot unpin {key!r}: it is not pinned")
        if count == 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1

    def is_pinned(self, key: K) -> bool:
        return key in self._pins

    def oldest_evictable(
        self, is_evictable: Callable[[K], bool] | None = None
    ) -> K | None:
        """The least recently used key that is unpinned and passes ``is_evictable``.

        None when there is no such key. Nothing changes: the caller decides whether
        to evict, so a plan that turns out impossible leaves the order untouched.
        """
        for key in self._order:
            if key in self._pins:
                continue
            if is_evictable is None or is_evictable(key):
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[K]:
        """Keys from least to most recently used."""
        return iter(list(self._order))
