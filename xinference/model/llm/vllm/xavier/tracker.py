"""The block tracker: which replica holds which published snapshot.

One actor per model, in the supervisor's pool. Replicas register snapshots when they
publish them and unregister them in batches when the store drops them; a loader asks
for the longest contiguous prefix of its prompt's keys that one *other* replica holds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import xoscar as xo

from .hashing import BlockHash
from .wire import PrefixHit

logger = logging.getLogger(__name__)


def tracker_uid(model_uid: str) -> str:
    return f"xavier-block-tracker-{model_uid}"


class BlockTrackerActor(xo.StatelessActor):
    """Index of published snapshots. All methods are synchronous, hence atomic."""

    def __init__(self) -> None:
        super().__init__()
        # key -> ranks holding it, in registration order (first holder first)
        self._holders: dict[BlockHash, dict[int, None]] = {}
        # rank -> keys it holds
        self._blocks_of: dict[int, set[BlockHash]] = {}
        # rank -> transfer actor pool address
        self._addresses: dict[int, str] = {}

    @classmethod
    def default_uid(cls) -> str:
        return "xavier-block-tracker"

    def register_replica(self, rank: int, address: str) -> None:
        """Add a replica; a rank registering again replaces its old entry.

        A replica that restarted lost its snapshots, so whatever the old incarnation
        registered must not be served on its behalf.
        """
        if rank in self._addresses:
            logger.info(
                "replica %d re-registered at %s; dropping its old blocks", rank, address
            )
            self._drop_blocks_of(rank)
        self._addresses[rank] = address
        self._blocks_of[rank] = set()

    def register_blocks(self, rank: int, keys: Sequence[BlockHash]) -> None:
        held = self._require(rank)
        for key in keys:
            self._holders.setdefault(key, {})[rank] = None
            held.add(key)

    def unregister_blocks(self, rank: int, keys: Sequence[BlockHash]) -> None:
        held = self._blocks_of.get(rank)
        if held is None:
            return  # the replica was forgotten meanwhile: nothing left to remove
        for key in keys:
            held.discard(key)
            ranks = self._holders.get(key)
            if ranks is not None:
                ranks.pop(rank, None)
                if not ranks:
                    del self._holders[key]

    def query_prefix(self, rank: int, keys: Sequence[BlockHash]) -> PrefixHit | None:
        """Longest contiguous run of leading ``keys`` held by one replica != ``rank``.

        A prefix split across two holders is not joined: one load comes from one peer.
        """
        candidates: set[int] | None = None
        best: PrefixHit | None = None
        for depth, key in enumerate(keys, start=1):
            holders = {r for r in self._holders.get(key, ()) if r != rank}
            candidates = holders if candidates is None else candidates & holders
            if not candidates:
                break
            chosen = min(candidates)  # deterministic among equals
            best = PrefixHit(
                rank=chosen, address=self._addresses[chosen], num_blocks=depth
            )
        return best

    def forget_replica(self, rank: int) -> None:
        """A replica went away: drop it and everything it held."""
        self._drop_blocks_of(rank)
        self._addresses.pop(rank, None)
        self._blocks_of.pop(rank, None)

    def replicas(self) -> dict[int, str]:
        return dict(self._addresses)

    def num_blocks(self, rank: int) -> int:
        return len(self._blocks_of.get(rank, ()))

    def _require(self, rank: int) -> set[BlockHash]:
        held = self._blocks_of.get(rank)
        if held is None:
            raise KeyError(f"replica {rank} is not registered with the block tracker")
        return held

    def _drop_blocks_of(self, rank: int) -> None:
        for key in self._blocks_of.get(rank, ()):
            ranks = self._holders.get(key)
            if ranks is not None:
                ranks.pop(rank, None)
                if not ranks:
                    del self._holders[key]
        self._blocks_of[rank] = set()
