"""A whole local cluster in one process: supervisor, worker and HTTP server.

The process hosts one xoscar main pool with the supervisor and the worker actors
(replicas are sub-pools appended to it, one process each) and serves the REST API
from the same event loop. ``xinference-local``, the demo and the tests start it
through ``start_local_cluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
import xoscar as xo

from ..api.auth import AuthService
from ..api.auth.settings import check_bind
from ..api.restful_api import create_app
from ..api.server_options import ServerOptions
from ..core.supervisor import SupervisorActor
from ..core.worker import WorkerActor

logger = logging.getLogger(__name__)

SERVER_START_TIMEOUT_S = 30.0
SERVER_STOP_TIMEOUT_S = 30.0


class EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the process owner decides when to
    stop (uvicorn would re-raise a caught SIGTERM after serving, killing the process
    before the models are torn down)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class SupervisorNode:
    """A running supervisor pool and its REST API: ``xinference-local``'s (whose
    pool holds the worker too) or ``xinference-supervisor``'s."""

    pool: Any
    supervisor: Any
    supervisor_address: str
    endpoint: str
    server: uvicorn.Server
    server_task: asyncio.Task[None]

    async def stop(self) -> None:
        """Terminate every model (their counters are logged; the workers remove
        their sub-pools), then stop serving."""
        try:
            await self.supervisor.terminate_all()
        finally:
            self.server.should_exit = True
            try:
                await asyncio.wait_for(self.server_task, SERVER_STOP_TIMEOUT_S)
            finally:
                await self.pool.stop()


async def start_local_cluster(
    host: str = "127.0.0.1",
    port: int = 9997,
    *,
    access_log: bool = False,
    auth: AuthService | None = None,
    options: ServerOptions | None = None,
) -> SupervisorNode:
    """Start the pool, the actors and the HTTP server; ``port=0`` lets the OS pick
    a free port (read it back from ``endpoint``). Without ``auth`` the API is
    open, which only a loopback ``host`` allows (``check_bind``); ``options``:
    the REST server's (defaults without)."""
    auth = auth or AuthService.disabled()
    check_bind(host, auth.enabled, auth.chosen)
    # auto_recover off: xoscar would restart a replica's sub-pool that died and
    # re-create its actors without an engine (and a transfer actor that registers
    # the dead rank with the tracker again). A dead replica is the supervisor's
    # to notice and report (``core/liveness.py``).
    pool = await xo.create_actor_pool(host, n_process=0, auto_recover=False)
    address = pool.external_address
    try:
        supervisor = await xo.create_actor(
            SupervisorActor, address=address, uid=SupervisorActor.default_uid()
        )
        await xo.create_actor(
            WorkerActor,
            pool,
            supervisor_address=address,
            cluster_secret=auth.cluster_secret,
            address=address,
            uid=WorkerActor.default_uid(),
        )
        server, task, bound_port = await serve_http(
            address, host, port, access_log, auth, options
        )
    except BaseException:
        await pool.stop()
        raise
    endpoint = f"http://{host}:{bound_port}"
    logger.info(
        "Xinference at %s (supervisor %s), authentication %s",
        endpoint,
        address,
        "on" if auth.enabled else "off",
    )
    return SupervisorNode(pool, supervisor, address, endpoint, server, task)


async def serve_http(
    supervisor_address: str,
    host: str,
    port: int,
    access_log: bool,
    auth: AuthService | None = None,
    options: ServerOptions | None = None,
) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    """The REST API of the supervisor at ``supervisor_address``, serving on
    ``host:port`` (0: any free port) once this returns: (server, its task, the
    port it bound)."""
    auth = auth or AuthService.disabled()
    check_bind(host, auth.enabled, auth.chosen)
    listener = socket.create_server((host, port))
    config = uvicorn.Config(
        create_app(supervisor_address, auth, options),
        log_level="warning",
        access_log=access_log,
        lifespan="off",
    )
    server = EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    await wait_started(server, task)
    return server, task, listener.getsockname()[1]


async def wait_started(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SERVER_START_TIMEOUT_S
    while not server.started:
        if task.done():
            task.result()  # raises the start failure
            raise RuntimeError("the HTTP server stopped while starting")
        if loop.time() > deadline:
            raise TimeoutError("the HTTP server did not start in time")
        await asyncio.sleep(0.05)
