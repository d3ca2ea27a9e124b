"""Synchronous remote hits without a reservation: the grant is made here, from
the locations the holder published with its keys.

A reservation costs the scheduler a round trip to the holder on the hit's path (up
to ``reply_wait_s`` of its thread, more passes when the holder is slow). A hit
the fast path loads synchronously needs no pin instead: the mirror knows each
key's device-tier row and generation (``LOCATE`` records), the worker half READs
the rows from its own NIXL agent and then the slots' generation words, and a
word that changed fails its block, which vLLM recomputes
(``store/generations.py``). So a location that went stale since it was published
costs a recomputation, never wrong KV.

Only hits that the synchronous policy accepts (every key in the holder's device
tier, this host, a holder already met, within the bound) are made lease-free;
everything else reserves as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ..hashing import BlockHash
from ..tracker_mirror import TrackerMirror
from ..wire import DEVICE_TIER, LeaseGrant, PrefixHit, ReplicaIdentity, TransportHint
from .fast_path import SyncLoadPolicy
from .reservations import LEASE_FREE_PREFIX, Reservation

_sequence = itertools.count()


def lease_free_reservation(
    mirror: TrackerMirror | None,
    policy: SyncLoadPolicy | None,
    rank: int,
    identity: ReplicaIdentity,
    keys: Sequence[BlockHash],
    local_blocks: int,
) -> Reservation | None:
    """A lease-free grant for the run of ``keys`` from block ``local_blocks``
    on that a peer holds (as ``Reservations.start`` looks it up), or None (no
    hit, no locations, or not synchronous)."""
    if mirror is None or policy is None or not policy.lease_free:
        return None
    if not policy.enabled or not mirror.ready:
        return None
    hit = mirror.query(rank, keys[local_blocks:])
    if hit is None:
        return None
    wanted = tuple(keys[local_blocks : local_blocks + hit.num_blocks])
    locations = mirror.locate(hit.rank, wanted)
    if locations is None:
        return None
    n = len(wanted)
    tiers = (DEVICE_TIER,) * n
    if policy.bound_s(hit.address, tiers, n * identity.geometry.block_nbytes) is None:
        return None
    grant = LeaseGrant(
        lease_id=f"{LEASE_FREE_PREFIX}{rank}-{next(_sequence)}",
        holder_rank=hit.rank,
        keys=wanted,
        tiers=tiers,
        logical_dtypes=(identity.geometry.logical_dtype,) * n,
        # the holder's NIXL epoch is filled in by the worker, which met it
        transport_hint=TransportHint(None, tuple(row for row, _ in locations)),
        generations=tuple(generation for _, generation in locations),
    )
    return Reservation(grant, PrefixHit(hit.rank, hit.address, n), local_blocks)
