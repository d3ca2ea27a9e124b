"""Tensor-parallel replicas, the connector's side: one decision, every rank's part.

A replica of ``tensor_parallel_size`` N has one scheduler half and N worker halves
(one per engine rank, each with its shard of every layer: its KV heads) and N
transfer actors. The scheduler half decides for all ranks: it hashes a prompt once
(the keys every rank stages and loads under travel in the step's metadata), asks
the tracker once, and reserves on every rank of the holder (``reserve_every_rank``):
the grant is the prefix all of them granted, one lease id on every rank. Rank r of
the loader reads rank r of the holder (``step_for_rank``).

A load completes only when every rank's part did: each worker half reports its own
failed blocks, and vLLM's KV output aggregator hands the scheduler the union (and a
request's asynchronous load as finished only once every rank reported it), so a
block any rank failed is recomputed on all ranks, from the first failed block on.
A request with a load stages nothing after it (``scheduler.py`` says why), so no
rank publishes KV computed over another rank's failed load.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from ..wire import LeaseGrant
from .step import RequestLoad, StepMetadata

ReserveOne = Callable[[int], Awaitable[LeaseGrant]]  # tp rank -> that rank's grant
ReleaseOne = Callable[[int], Awaitable[None]]  # tp rank -> release the lease there
Count = TypeVar("Count", int, float)


async def reserve_every_rank(
    tp_size: int, reserve: ReserveOne, release: ReleaseOne
) -> LeaseGrant:
    """Reserve on every rank of a holder, concurrently; the grant of the leading
    keys every rank granted (rank 0's, carrying ranks 1.. as ``rank_shards``).

    A rank that fails fails the reservation: the others' leases are released first
    (so no rank keeps snapshots pinned for a load that will not come) and the first
    failure is raised; an empty result on any rank is a miss (empty grant)."""
    results = await asyncio.gather(
        *(reserve(tp) for tp in range(tp_size)), return_exceptions=True
    )
    grants = [r for r in results if isinstance(r, LeaseGrant)]
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    held = min((len(g.keys) for g in grants), default=0)
    if failure is not None or held == 0:
        await release_every_rank(
            tp_size,
            release,
            only=[
                tp
                for tp, r in enumerate(results)
                if isinstance(r, LeaseGrant) and r.keys
            ],
        )
        if failure is not None:
            raise failure
        return grants[0].truncated(0)
    lead, *others = (grant.truncated(held) for grant in grants)
    return dataclasses.replace(lead, rank_shards=tuple(others))


async def release_every_rank(
    tp_size: int, release: ReleaseOne, only: list[int] | None = None
) -> None:
    """Release a lease on every rank (or on ``only`` those), concurrently; every
    release is tried, then the first failure is raised."""
    ranks = range(tp_size) if only is None else only
    results = await asyncio.gather(
        *(release(tp) for tp in ranks), return_exceptions=True
    )
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        raise failure


def shard_for_rank(grant: LeaseGrant, tp_rank: int) -> LeaseGrant:
    """Rank ``tp_rank``'s part of a grant made by ``reserve_every_rank``."""
    if tp_rank == 0:
        return (
            dataclasses.replace(grant, rank_shards=()) if grant.rank_shards else grant
        )
    if not 0 < tp_rank <= len(grant.rank_shards):
        raise ValueError(
            f"the grant of lease {grant.lease_id} has parts for "
            f"{len(grant.rank_shards) + 1} tensor-parallel ranks, not for rank {tp_rank}"
        )
    return grant.rank_shards[tp_rank - 1]


def step_for_rank(step: StepMetadata, tp_rank: int, tp_size: int) -> StepMetadata:
    """The step as worker ``tp_rank`` of ``tp_size`` carries it out: each load
    with this rank's part of its grant. The keys to stage and load are the
    scheduler's, the same on every rank."""
    if tp_size == 1:
        return step
    loads = tuple(_load_for_rank(item, tp_rank) for item in step.loads)
    return dataclasses.replace(step, loads=loads)


def _load_for_rank(item: RequestLoad, tp_rank: int) -> RequestLoad:
    if item.load is None:
        return item
    grant = shard_for_rank(item.load.grant, tp_rank)
    return dataclasses.replace(item, load=dataclasses.replace(item.load, grant=grant))


def merge_round_trips(
    mine: Mapping[str, Count], theirs: Mapping[str, Count]
) -> dict[str, Count]:
    """Round trips (or own times) of loads reported by two ranks: a request
    waited for its slowest rank, so the larger value is the request's."""
    merged = dict(mine)
    for req_id, count in theirs.items():
        merged[req_id] = max(count, merged.get(req_id, 0))
    return merged
