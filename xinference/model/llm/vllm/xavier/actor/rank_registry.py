"""Tensor-parallel replicas: which snapshots every rank of a replica has staged.

A replica of ``tensor_parallel_size`` N runs N engine workers, each holding its
shard of every layer (its KV heads), each with its own transfer actor and store.
A snapshot is useful to a peer only when every rank holds its shard, so only the
actor of rank 0 (the lead) talks to the tracker: the other ranks' actors send their
staged and dropped keys to the lead (``rank_blocks_changed``), and the lead's
``RankRegistry`` tells the tracker a key once the last rank has staged it and takes
it back as soon as any rank dropped it. A stale entry still costs a peer only a
short reservation (``connector/ranks.py`` leases every rank and keeps the prefix
all of them granted). No xoscar here: the actor hands over refs and its deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..change_log import pack_keys, unpack_keys
from ..hashing import BlockHash

# How the lead of a replica is reached: its actor ref (resolved lazily: the ranks'
# actors are created in order, and a ref is cheap to ask again).
LeadRef = Callable[[], Awaitable[Any]]
# Bounds one call to the tracker (the actor's deadline on peers).
Deadline = Callable[[Awaitable[Any]], Awaitable[Any]]


async def _no_deadline(call: Awaitable[Any]) -> Any:
    return await call


class RankRegistry:
    """Key -> the ranks of this replica that hold it, kept by the lead rank.

    ``tracker`` is the tracker's ref (``update_blocks(rank, dropped, added)``, packed
    keys); changes reach it in the order they were made here, each call bounded by
    ``deadline`` (the lock is held across it: a stopped tracker must not hold up
    every later change of the replica for longer).
    """

    def __init__(
        self, rank: int, tp_size: int, tracker: Any, deadline: Deadline = _no_deadline
    ) -> None:
        if tp_size < 2:
            raise ValueError(f"a rank registry needs >= 2 ranks, got {tp_size}")
        self._rank = rank
        self._all = (1 << tp_size) - 1
        self._tp_size = tp_size
        self._tracker = tracker
        self._deadline = deadline
        self._holders: dict[BlockHash, int] = {}  # key -> bit mask of tp ranks
        self._lock = asyncio.Lock()

    def held_by_all(self, key: BlockHash) -> bool:
        return self._holders.get(key, 0) == self._all

    async def rank_changed(
        self,
        tp_rank: int,
        dropped: bytes | list[BlockHash],
        added: bytes | list[BlockHash],
    ) -> None:
        """Rank ``tp_rank`` dropped then added these keys; tell the tracker what
        became complete or incomplete (one call, none when nothing did)."""
        if not 0 <= tp_rank < self._tp_size:
            raise ValueError(f"tp_rank {tp_rank} out of range 0..{self._tp_size - 1}")
        bit = 1 << tp_rank
        lost: list[BlockHash] = []
        complete: list[BlockHash] = []
        async with self._lock:  # held across the send: the tracker sees our order
            for key in _keys(dropped):
                mask = self._holders.get(key, 0)
                if mask == self._all:
                    lost.append(key)
                if mask & ~bit:
                    self._holders[key] = mask & ~bit
                else:
                    self._holders.pop(key, None)
            for key in _keys(added):
                mask = self._holders.get(key, 0) | bit
                self._holders[key] = mask
                if mask == self._all:
                    complete.append(key)
            # A key lost and complete again within this change is net added.
            again = set(complete)
            lost = [key for key in lost if key not in again]
            if lost or complete:
                await self._deadline(
                    self._tracker.update_blocks(
                        self._rank, pack_keys(lost), pack_keys(complete)
                    )
                )

    def view(self, tp_rank: int) -> _RankView:
        """What rank ``tp_rank``'s own ``TrackerUpdates`` calls as its tracker."""
        return _RankView(self, tp_rank)


class _RankView:
    """``update_blocks`` of one rank, into the registry (the lead's own rank)."""

    def __init__(self, registry: RankRegistry, tp_rank: int) -> None:
        self._registry = registry
        self._tp_rank = tp_rank

    async def update_blocks(
        self, rank: int, dropped: bytes, added: bytes, located: bytes = b""
    ) -> None:
        # ``located`` is dropped: each rank's rows differ, and the lease-free
        # reads that use locations are off for tensor-parallel replicas.
        await self._registry.rank_changed(self._tp_rank, dropped, added)


class LeadLink:
    """``update_blocks`` of a rank other than the lead: sent to the lead's actor."""

    def __init__(self, lead: LeadRef, tp_rank: int) -> None:
        self._lead = lead
        self._tp_rank = tp_rank

    async def update_blocks(
        self, rank: int, dropped: bytes, added: bytes, located: bytes = b""
    ) -> None:
        # ``located`` is dropped, as in ``_RankView``.
        lead = await self._lead()
        await lead.rank_blocks_changed(self._tp_rank, dropped, added)


class ReplicaRanks:
    """How one rank's transfer actor reaches the tracker, and what it may tell it."""

    def __init__(
        self, rank: int, tp_rank: int, tp_size: int, deadline: Deadline = _no_deadline
    ) -> None:
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(
                f"tp_rank must be in 0..tp_size-1 and tp_size >= 1, got tp_rank "
                f"{tp_rank} of tp_size {tp_size}"
            )
        self._rank = rank
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._deadline = deadline
        self.registry: RankRegistry | None = None

    @property
    def leads(self) -> bool:
        """Registers the replica with the tracker and takes it out at close."""
        return self.tp_rank == 0

    async def connect(self, tracker: Any, address: str, lead: LeadRef) -> Any:
        """Register (the lead only) and return what this rank's ``TrackerUpdates``
        sends its updates to."""
        if not self.leads:
            return LeadLink(lead, self.tp_rank)
        await tracker.register_replica(self._rank, address)
        if self.tp_size == 1:
            return tracker
        self.registry = RankRegistry(self._rank, self.tp_size, tracker, self._deadline)
        return self.registry.view(0)

    async def rank_changed(self, tp_rank: int, dropped: bytes, added: bytes) -> None:
        """A change sent by another rank's ``LeadLink`` (the lead only)."""
        if self.registry is None:
            raise RuntimeError(
                f"replica {self._rank}'s tensor-parallel rank {self.tp_rank} is not "
                f"the lead of {self.tp_size} ranks: rank {tp_rank} sent it changes"
            )
        await self.registry.rank_changed(tp_rank, dropped, added)


def _keys(keys: bytes | list[BlockHash]) -> list[BlockHash]:
    return unpack_keys(keys) if isinstance(keys, bytes) else list(keys)
