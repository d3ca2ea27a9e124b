"""The transfer actors of one replica's engine ranks, created, asked and closed as one.

A replica of ``tensor_parallel_size`` N gets N transfer actors in its pool, one per
engine rank (``config.transfer_actor_uid(model, rank, tp_rank)``), created lead
first: the others send the lead their staged keys (``rank_registry.py``). The model
actor holds this group where a single-rank replica held its one actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import xoscar as xo

from ..config import transfer_actor_uid
from ..rank_stats import merge_rank_stats
from ..stats import XavierStats
from .transfer_actor import TransferActorConfig, XavierTransferActor


class TransferActorGroup:
    """The ranks' actor refs, rank 0 first."""

    def __init__(self, refs: list[Any]) -> None:
        if not refs:
            raise ValueError("a replica has at least one transfer actor")
        self.refs = refs

    @classmethod
    async def create(
        cls, config: TransferActorConfig, address: str
    ) -> TransferActorGroup:
        """Create every rank's actor in ``address``'s pool, lead first; a failure
        destroys those already created."""
        refs: list[Any] = []
        try:
            for tp_rank in range(config.tp_size):
                refs.append(
                    await xo.create_actor(
                        XavierTransferActor,
                        dataclasses.replace(config, tp_rank=tp_rank),
                        address=address,
                        uid=transfer_actor_uid(config.model_uid, config.rank, tp_rank),
                    )
                )
        except BaseException:
            for ref in reversed(refs):
                await xo.destroy_actor(ref)
            raise
        return cls(refs)

    async def rank_stats(self) -> list[XavierStats]:
        return list(await asyncio.gather(*(ref.stats() for ref in self.refs)))

    async def stats(self) -> XavierStats:
        """The replica's stats, summed over its ranks (``rank_stats.py``)."""
        return merge_rank_stats(await self.rank_stats())

    async def close(self) -> None:
        """Drain and close every rank's actor (all are tried; the first failure
        is raised)."""
        results = await asyncio.gather(
            *(ref.close() for ref in self.refs), return_exceptions=True
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure

    async def destroy(self) -> None:
        for ref in reversed(self.refs):
            await xo.destroy_actor(ref)
