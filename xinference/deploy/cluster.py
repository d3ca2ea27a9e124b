"""A cluster across hosts: one supervisor process, one worker process per host.

``xinference-supervisor`` runs the supervisor actor (and each Xavier model's block
tracker) in an xoscar pool on ``--supervisor-port`` and serves the REST API on
``--port``; ``xinference-worker -e http://SUPERVISOR:PORT`` runs a worker actor in
a pool of its own on ``--host``, asks the REST API for the supervisor's pool address
(``GET /v1/address``, unless ``--supervisor-address`` gives it), registers and
heartbeats (``core/heartbeat.py``). Replicas are sub-pools of their worker's pool;
the REST front end talks to them directly, wherever they run.

``xinference-local`` (``local.py``) is the same in one process.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx
import xoscar as xo

from ..api.auth import AuthService
from ..api.auth.settings import check_bind
from ..api.server_options import ServerOptions
from ..core.heartbeat import HeartbeatSettings
from ..core.supervisor import SupervisorActor
from ..core.worker import WorkerActor
from .local import SupervisorNode, serve_http

logger = logging.getLogger(__name__)

ADDRESS_LOOKUP_TIMEOUT_S = 10.0
WORKER_LEAVE_TIMEOUT_S = 120.0


def _pool_address(host: str, port: int | None) -> str:
    return host if not port else f"{host}:{port}"


async def start_supervisor(
    host: str = "127.0.0.1",
    port: int = 9997,
    supervisor_port: int | None = None,
    *,
    heartbeat: HeartbeatSettings | None = None,
    access_log: bool = False,
    auth: AuthService | None = None,
    options: ServerOptions | None = None,
) -> SupervisorNode:
    """The supervisor's pool (on ``supervisor_port``; None or 0: any free port)
    and the HTTP API (``port``; 0: any free port; ``options``: its settings).
    Workers join only with ``auth.cluster_secret`` when it is set."""
    auth = auth or AuthService.disabled()
    check_bind(host, auth.enabled, auth.chosen)
    pool = await xo.create_actor_pool(_pool_address(host, supervisor_port), n_process=0)
    address = pool.external_address
    try:
        supervisor = await xo.create_actor(
            SupervisorActor,
            heartbeat,
            auth.cluster_secret,
            address=address,
            uid=SupervisorActor.default_uid(),
        )
        server, task, bound_port = await serve_http(
            address, host, port, access_log, auth, options
        )
    except BaseException:
        await pool.stop()
        raise
    endpoint = f"http://{host}:{bound_port}"
    logger.info("Xinference supervisor at %s, REST API at %s", address, endpoint)
    return SupervisorNode(pool, supervisor, address, endpoint, server, task)


@dataclass
class WorkerNode:
    pool: Any
    worker: Any
    address: str
    supervisor_address: str

    async def stop(self) -> list[int]:
        """Leave the cluster (the supervisor marks this worker's replicas gone),
        remove every replica sub-pool, stop the pool; the pids that had to be
        killed."""
        try:
            return list(
                await asyncio.wait_for(self.worker.leave(), WORKER_LEAVE_TIMEOUT_S)
            )
        finally:
            await self.pool.stop()


async def supervisor_address_of(
    endpoint: str, cluster_secret: str | None = None
) -> str:
    """The supervisor's xoscar address, as its REST API tells it (with
    authentication on, only to the cluster's secret or an admin)."""
    url = endpoint.rstrip("/") + "/v1/address"
    headers = {"Authorization": f"Bearer {cluster_secret}"} if cluster_secret else {}
    async with httpx.AsyncClient(timeout=ADDRESS_LOOKUP_TIMEOUT_S) as client:
        response = await client.get(url, headers=headers)
    response.raise_for_status()
    return str(response.json()["address"])


async def start_worker(
    host: str,
    *,
    endpoint: str | None = None,
    supervisor_address: str | None = None,
    worker_port: int | None = None,
    heartbeat: HeartbeatSettings | None = None,
    cluster_secret: str | None = None,
) -> WorkerNode:
    """A worker pool on ``host`` (``worker_port``; None or 0: any free port),
    registered with the supervisor found at ``supervisor_address`` or through the
    REST ``endpoint``; ``cluster_secret`` is the one the supervisor was given.
    A supervisor that refuses the worker raises ``WorkerRefused``."""
    if supervisor_address is None:
        if endpoint is None:
            raise ValueError("give the supervisor's endpoint or its address")
        supervisor_address = await supervisor_address_of(endpoint, cluster_secret)
    # auto_recover off, as in xinference-local: a replica sub-pool that died is the
    # supervisor's to notice (core/liveness.py), not xoscar's to restart engineless
    pool = await xo.create_actor_pool(
        _pool_address(host, worker_port), n_process=0, auto_recover=False
    )
    address = pool.external_address
    try:
        worker = await xo.create_actor(
            WorkerActor,
            pool,
            supervisor_address=supervisor_address,
            heartbeat=heartbeat,
            cluster_secret=cluster_secret,
            address=address,
            uid=WorkerActor.default_uid(),
        )
    except BaseException:
        await pool.stop()
        raise
    logger.info("Xinference worker at %s, supervisor %s", address, supervisor_address)
    return WorkerNode(pool, worker, address, supervisor_address)
