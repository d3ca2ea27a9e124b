"""The holder side of a transfer actor: which snapshots a peer may load, and for how
long they stay pinned.

``LeaseBook.grant`` checks that the requester can use our KV at all (same model,
geometry, protocol and row byte order: otherwise its KV would be wrong, which is an
error, not a miss), then pins the longest leading run of the asked keys that the
store has published. The grant names each key's tier and logical dtype, and carries
what our device-tier transport tells the loader's (an opaque ``TransportHint``). A
lease is released by its loader when the load ends; one older than ``lease_ttl_s``
is released here, since its loader died or lost track of it and the snapshots must
not stay pinned. No xoscar here: the actor calls it on its event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ..engine.layout import row_format
from ..hashing import BlockHash
from ..stats import ActorCounters
from ..store.tiered import TieredKVSnapshotStore
from ..transports.base import DeviceTierTransport
from ..wire import DEVICE_TIER, LeaseGrant, ReplicaIdentity

logger = logging.getLogger(__name__)


class LeaseBook:
    """The leases one replica granted to its peers."""

    def __init__(
        self,
        rank: int,
        identity: ReplicaIdentity,
        store: TieredKVSnapshotStore,
        transport: DeviceTierTransport,
        *,
        lease_ttl_s: float,
        counters: ActorCounters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rank = rank
        self._identity = identity
        self._store = store
        self._transport = transport
        self._lease_ttl_s = lease_ttl_s
        self._counters = counters
        self._clock = clock
        # lease id -> clock time it was granted (non-empty grants only)
        self._granted_at: dict[str, float] = {}

    def grant(
        self, keys: Sequence[BlockHash], lease_id: str, requester: ReplicaIdentity
    ) -> LeaseGrant:
        """Lease the longest leading run of ``keys`` held here for ``requester``.

        An incompatible requester raises ``ValueError``; an empty grant is a miss.
        """
        reason = self._incompatibility(requester)
        if reason is not None:
            raise ValueError(
                f"replica {self._rank} cannot share KV with this requester: {reason}"
            )
        self.expire()
        entries = self._store.lease(lease_id, keys)
        if entries:
            self._granted_at[lease_id] = self._clock()
        rows = [row if tier == DEVICE_TIER else None for tier, row, _ in entries]
        return LeaseGrant(
            lease_id=lease_id,
            holder_rank=self._rank,
            keys=tuple(keys[: len(entries)]),
            tiers=tuple(tier for tier, _, _ in entries),
            logical_dtypes=tuple(dtype for _, _, dtype in entries),
            transport_hint=self._transport.hint(rows) if entries else None,
        )

    def release(self, lease_id: str) -> None:
        """Release a lease; idempotent."""
        self._granted_at.pop(lease_id, None)
        self._store.release(lease_id)

    def expire(self) -> None:
        """Release leases older than ``lease_ttl_s``. A load still reading under an
        expired lease then fails cleanly (unknown key under that lease), and its
        request recomputes; pinning snapshots forever would be worse."""
        deadline = self._clock() - self._lease_ttl_s
        expired = [lid for lid, t in self._granted_at.items() if t < deadline]
        for lease_id in expired:
            del self._granted_at[lease_id]
            self._store.release(lease_id)
            self._counters.leases_expired += 1
            logger.warning(
                "rank %d released lease %s after %.0f s: its loader never did",
                self._rank,
                lease_id,
                self._lease_ttl_s,
            )

    def _incompatibility(self, requester: ReplicaIdentity) -> str | None:
        identity = self._identity
        reason = identity.incompatibility(requester)
        if reason is None and row_format(identity.layout) != row_format(
            requester.layout
        ):
            reason = (
                f"KV layouts {identity.layout!r} here and {requester.layout!r} on the "
                "peer order a block's bytes differently"
            )
        return reason
