"""Replica choice: pure policies over plain numbers (no xoscar, no engine).

The dispatcher gathers the facts (requests in flight per replica, and for the
cache-aware policy the tracker's answer to "who holds the longest prefix of this
prompt") and asks a policy for a rank. Keeping the policy free of I/O makes every
decision reproducible in a unit test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RouteFacts:
    """What a policy may look at for one request.

    ``in_flight[r]`` is the number of requests replica ``r`` is serving now.
    ``holder`` is the replica the block tracker says holds the longest published
    prefix of the prompt (None: nobody), and ``prefix_blocks`` that prefix's length.
    ``available[r]`` says whether replica ``r`` may get the request (a dead or
    unresponsive one may not); None: all may.
    """

    in_flight: tuple[int, ...]
    holder: int | None = None
    prefix_blocks: int = 0
    available: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if not self.in_flight:
            raise ValueError("a route needs at least one replica")
        if self.available is not None:
            if len(self.available) != len(self.in_flight):
                raise ValueError("available and in_flight differ in length")
            if not any(self.available):
                raise ValueError("a route needs at least one available replica")
        if self.holder is not None and not 0 <= self.holder < len(self.in_flight):
            raise ValueError(
                f"holder {self.holder} outside ranks 0..{len(self.in_flight) - 1}"
            )

    def ranks(self) -> list[int]:
        """The ranks that may get the request."""
        if self.available is None:
            return list(range(len(self.in_flight)))
        return [rank for rank, ok in enumerate(self.available) if ok]


class Router(Protocol):
    needs_prefix: bool  # whether the dispatcher must ask the tracker first

    def choose(self, facts: RouteFacts) -> int: ...


class RoundRobinRouter:
    """Replicas in turn, ignoring load and cache contents."""

    needs_prefix = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, facts: RouteFacts) -> int:
        size = len(facts.in_flight)
        allowed = set(facts.ranks())
        for step in range(size):  # the next available rank in turn
            rank = (self._next + step) % size
            if rank in allowed:
                self._next = rank + 1
                return rank
        raise AssertionError("unreachable: RouteFacts has an available rank")


class CacheAwareRouter:
    """Send a request where its prefix already is, unless that replica is too busy.

    The holder of the longest prefix wins when its in-flight count exceeds the least
    busy replica's by at most ``busy_margin``; otherwise the least busy replica takes
    the request and pulls the prefix from the holder through Xavier. Without a
    holder, the least busy replica wins. Ties among the least busy rotate, so an idle
    deployment still spreads cold prompts over all replicas.
    """

    needs_prefix = True

    def __init__(self, busy_margin: int = 2) -> None:
        if busy_margin < 0:
            raise ValueError(f"busy_margin must be non-negative, got {busy_margin}")
        self.busy_margin = busy_margin
        self._rotation = 0

    def choose(self, facts: RouteFacts) -> int:
        ranks = facts.ranks()
        least = min(facts.in_flight[rank] for rank in ranks)
        if facts.holder in ranks and facts.prefix_blocks > 0:
            assert facts.holder is not None
            if facts.in_flight[facts.holder] - least <= self.busy_margin:
                return facts.holder
        return self._least_busy(facts.in_flight, ranks, least)

    def _least_busy(
        self, in_flight: Sequence[int], ranks: list[int], least: int
    ) -> int:
        candidates = [rank for rank in ranks if in_flight[rank] == least]
        rank = candidates[self._rotation % len(candidates)]
        self._rotation += 1
        return rank


def make_router(kind: str, busy_margin: int = 2) -> Router:
    if kind == "round-robin":
        return RoundRobinRouter()
    if kind == "cache-aware":
        return CacheAwareRouter(busy_margin)
    raise ValueError(f"unknown router {kind!r}")
