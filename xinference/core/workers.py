"""The supervisor's worker registry: which workers serve, and what losing one does.

``WorkerRegistry`` is a part of ``SupervisorActor`` (a base class, for the actor's
calls keep their names): workers register and send heartbeats
(``core/heartbeat.py`` declares a silent one gone), ``list_workers`` shows them,
a launch takes its ranks from ``_assign_workers``, and a lost worker's replicas
are marked gone in every deployment (``_mark_replicas_gone``, which the replica
liveness monitor uses too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import xoscar as xo

from .cluster_secret import WorkerRefused, secret_matches
from .deployment import Deployment
from .heartbeat import HeartbeatSettings, WorkerLiveness, watch_workers
from .options import LaunchOptionError, LaunchSpec

logger = logging.getLogger(__name__)

# The block tracker forgetting a gone replica: one short actor call.
TRACKER_FORGET_TIMEOUT_S = 30.0


class WorkerRegistry:
    """The workers of one supervisor, and their replicas' loss."""

    # Provided by the supervisor actor.
    address: str
    _models: dict[str, Deployment]  # model uid -> record

    def _init_workers(
        self, heartbeat: HeartbeatSettings | None, cluster_secret: str | None
    ) -> None:
        # None: any worker joins (a cluster on one host, authentication off)
        self._cluster_secret = cluster_secret
        self._workers: dict[str, Any] = {}  # worker address -> ref (live ones)
        self._liveness = WorkerLiveness(heartbeat or HeartbeatSettings.from_env())
        self._watch: asyncio.Task[None] | None = None

    def _start_watching(self) -> None:
        self._watch = asyncio.create_task(
            watch_workers(self._liveness, self._worker_gone)
        )

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    # ---- register, heartbeat, list ----------------------------------------------

    async def register_worker(
        self, address: str, uid: str | bytes, cluster_secret: str | None = None
    ) -> list[str]:
        """Add a worker (or take back one that was declared gone); the sub-pool
        addresses of the replicas it hosts that still serve (a worker registering
        again removes any other sub-pool it has: after a network cut its replicas
        were declared gone). A worker in this supervisor's own process
        (``xinference-local``) is not watched. With a cluster secret set, a
        worker without it is refused (``WorkerRefused``)."""
        if not secret_matches(self._cluster_secret, cluster_secret):
            logger.warning(
                "worker at %s refused: wrong or missing cluster secret", address
            )
            raise WorkerRefused(
                f"the supervisor refused the worker at {address}: wrong or missing "
                "cluster secret (--cluster-secret or $XINFERENCE_CLUSTER_SECRET)"
            )
        self._workers[address] = await xo.actor_ref(address=address, uid=uid)
        if address != self.address:
            self._liveness.register(address, time.monotonic())
        logger.info(
            "worker registered at %s%s",
            address,
            (
                ""
                if address == self.address
                else f" ({self._liveness.settings.describe()})"
            ),
        )
        return [
            record.addresses[rank]
            for record in self._models.values()
            for rank, worker in record.workers.items()
            if rank not in record.gone
            and worker.address == address
            and rank in record.addresses
        ]

    async def worker_heartbeat(self, address: str) -> bool:
        """A worker is alive; False: not registered here, it must register again."""
        return self._liveness.beat(address, time.monotonic())

    async def unregister_worker(self, address: str) -> None:
        """A worker leaving on purpose (its process stops)."""
        await self._worker_gone(address, f"worker {address} stopped")

    async def list_workers(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "address": address,
                "host": host_of(address),
                "silent_for_s": self._liveness.silent_for(address, now),
                "replicas": sorted(
                    (uid, rank)
                    for uid, record in self._models.items()
                    for rank, worker in record.workers.items()
                    if worker.address == address and rank not in record.gone
                ),
            }
            for address in self._workers
        ]

    # ---- assignment ---------------------------------------------------------------

    def _assign_workers(self, spec: LaunchSpec) -> list[Any]:
        """Rank -> worker ref: round-robin over the live workers (in registration
        order), or over those at ``worker_ip``."""
        if not self._workers:
            raise RuntimeError("no worker is registered with the supervisor")
        candidates = [
            ref
            for address, ref in self._workers.items()
            if spec.worker_ip is None or host_of(address) == spec.worker_ip
        ]
        if not candidates:
            known = ", ".join(sorted({host_of(address) for address in self._workers}))
            raise LaunchOptionError(
                f"no worker at worker_ip {spec.worker_ip!r}; workers are at: {known}"
            )
        return [candidates[rank % len(candidates)] for rank in range(spec.replica)]

    # ---- loss ---------------------------------------------------------------------

    async def _worker_gone(self, address: str, reason: str) -> None:
        self._liveness.forget(address)
        if self._workers.pop(address, None) is None:
            return
        logger.warning("%s: its replicas are gone", reason)
        for record in list(self._models.values()):
            ranks = [
                rank
                for rank, worker in record.workers.items()
                if worker.address == address
            ]
            if not ranks:
                continue
            await self._mark_replicas_gone(record, ranks, reason)
            if record.state == "launching" and record.task is not None:
                record.detail = f"cancelled: {reason}"
                record.task.cancel()

    async def _mark_replicas_gone(
        self, record: Deployment, ranks: Iterable[int], reason: str
    ) -> None:
        """Take replicas out of service: remember why, and have the block tracker
        forget what they held (a tracker that is gone itself is no obstacle)."""
        new = [rank for rank in ranks if rank not in record.gone]
        if not new:
            return
        for rank in new:
            record.gone[rank] = reason
            record.unresponsive.pop(rank, None)
        if record.tracker is not None:
            for rank in new:
                try:
                    # xo.wait_for: its deadline holds against a stopped process
                    await xo.wait_for(
                        record.tracker.forget_replica(rank), TRACKER_FORGET_TIMEOUT_S
                    )
                except Exception as error:
                    logger.warning(
                        "%s: the tracker could not forget replica %d: %r",
                        record.spec.model_uid,
                        rank,
                        error,
                    )
        logger.warning(
            "%s: replica(s) %s gone (%s); %d of %d serve",
            record.spec.model_uid,
            ", ".join(map(str, new)),
            reason,
            len(record.live_ranks(range(record.spec.replica))),
            record.spec.replica,
        )


def host_of(address: str) -> str:
    """The host of an xoscar address (``host:port``, with or without a scheme)."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]
