"""Replica liveness: the supervisor notices a replica that died or stopped answering.

One ``LivenessMonitor`` per ready deployment, in the supervisor's process. Every
``interval_s`` it asks

1. each replica's worker whether its sub-pool process still runs
   (``WorkerActor.replica_health``: the process's exit status), and
2. each replica's model actor for its own account (``ReplicaModelActor.health``:
   vLLM notices at once that its engine-core process died), under ``probe_s``.

A replica whose process exited, whose engine died or whose actor no longer exists
in its running pool is *gone*: the supervisor records why, the block tracker forgets it (no peer is
sent there for a prefix again), the front end stops routing to it, and its
sub-pool is removed with whatever it spawned. A replica that misses a probe's
deadline (stopped, or too busy to answer) or cannot be reached (its host may be
lost: that is the worker heartbeat's to declare) is *unresponsive*: requests go
to the others until it answers again.

Bound: a death is noticed within ``interval_s + probe_s`` of happening (a dead
engine or process answers at once, so in practice within ``interval_s`` plus a
round trip); ``docs/internals.md`` states the figures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import xoscar as xo
from xoscar.errors import ServerClosed

from .deployment import Deployment

logger = logging.getLogger(__name__)

LIVENESS_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0
RETIRE_TIMEOUT_S = 60.0

# Errors that mean the replica's actor or process is not there any more.
UNREACHABLE = (ServerClosed, xo.ActorNotExist, ConnectionError)


class LivenessMonitor:
    """Probes one deployment's replicas until cancelled."""

    def __init__(
        self,
        record: Deployment,
        mark_gone: Callable[[Deployment, list[int], str], Awaitable[None]],
        *,
        interval_s: float = LIVENESS_INTERVAL_S,
        probe_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self._record = record
        self._mark_gone = mark_gone
        self._interval_s = interval_s
        self._probe_s = probe_s
        self._retiring: set[asyncio.Task[None]] = set()
        self._worker_failed = False

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._interval_s)
                try:
                    await self.check_once()
                except Exception:  # never stop watching because of one round
                    logger.exception(
                        "%s: liveness check failed", self._record.spec.model_uid
                    )
        finally:
            # A removal under way finishes (bounded) before the deployment's
            # teardown, which waits for this task, looks at the sub-pools.
            await asyncio.gather(*self._retiring, return_exceptions=True)

    async def check_once(self) -> None:
        record = self._record
        uid = record.spec.model_uid
        ranks = [rank for rank in sorted(record.models) if rank not in record.gone]
        if not ranks:
            return
        dead: dict[int, str] = {}
        addresses = {rank: record.addresses[rank] for rank in ranks}
        # Each worker is asked about the sub-pools it runs (a lost worker is the
        # heartbeat's to report: core/heartbeat.py).
        by_worker: dict[str, tuple[Any, list[str]]] = {}
        for rank in ranks:
            worker = record.workers[rank]
            by_worker.setdefault(worker.address, (worker, []))[1].append(
                addresses[rank]
            )
        answers = await asyncio.gather(
            *(
                xo.wait_for(worker.replica_health(owned), self._probe_s)
                for worker, owned in by_worker.values()
            ),
            return_exceptions=True,
        )
        health: dict[str, str | None] = {}
        failed = [a for a in answers if isinstance(a, BaseException)]
        for answer in answers:
            if not isinstance(answer, BaseException):
                health.update(answer)
        if failed and not self._worker_failed:  # not a replica's fault
            logger.warning("%s: worker health check failed: %r", uid, failed[0])
        self._worker_failed = bool(failed)
        for rank, address in addresses.items():
            reason = health.get(address)
            if reason is not None:
                dead[rank] = reason
        probes = await asyncio.gather(
            *(
                # xo.wait_for: its deadline holds against a stopped process
                xo.wait_for(record.models[rank].health(), self._probe_s)
                for rank in ranks
            ),
            return_exceptions=True,
        )
        for rank, outcome in zip(ranks, probes, strict=True):
            if rank in dead:
                continue
            if isinstance(outcome, TimeoutError):
                if rank not in record.unresponsive:
                    logger.warning(
                        "%s replica %d missed a health probe (%g s): routing "
                        "around it until it answers",
                        uid,
                        rank,
                        self._probe_s,
                    )
                record.unresponsive[rank] = (
                    f"no answer to a health probe in {self._probe_s:g} s"
                )
            elif isinstance(outcome, xo.ActorNotExist):  # its pool runs, it not
                dead[rank] = "its model actor no longer exists"
            elif isinstance(outcome, UNREACHABLE):
                # Its process or its host: a dead sub-pool is the worker's to
                # report (above), a lost worker the heartbeat's; until then no
                # requests go there.
                if rank not in record.unresponsive:
                    logger.warning(
                        "%s replica %d unreachable (%r): routing around it",
                        uid,
                        rank,
                        outcome,
                    )
                record.unresponsive[rank] = f"unreachable ({outcome!r})"
            elif isinstance(outcome, BaseException):
                dead[rank] = f"its health probe failed ({outcome!r})"
            elif outcome is not None:
                dead[rank] = str(outcome)
            elif record.unresponsive.pop(rank, None) is not None:
                logger.info("%s replica %d answers again: serving", uid, rank)
        for reason in sorted(set(dead.values())):
            gone = [rank for rank, why in dead.items() if why == reason]
            await self._mark_gone(record, gone, reason)
            for rank in gone:
                task = asyncio.create_task(self._retire(rank))
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)

    async def _retire(self, rank: int) -> None:
        """Remove a gone replica's sub-pool and every process it spawned (an
        engine core whose sub-pool was killed would otherwise run on)."""
        record = self._record
        address = record.addresses.get(rank)
        if address is None:
            return
        try:
            killed: Any = await xo.wait_for(
                record.workers[rank].remove_replica(address), RETIRE_TIMEOUT_S
            )
        except Exception as error:
            logger.warning(
                "%s replica %d: removing its sub-pool failed: %r",
                record.spec.model_uid,
                rank,
                error,
            )
            return
        record.addresses.pop(rank, None)
        logger.info(
            "%s replica %d removed%s",
            record.spec.model_uid,
            rank,
            f"; killed leftover processes {killed}" if killed else "",
        )
