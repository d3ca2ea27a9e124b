"""Pools listen on the host they are given, not on every interface: a worker's
main pool and the replica sub-pools it spawns, plain and ``nixl://`` (Xavier's).

Real xoscar pools and real sub-pool processes; no engine is loaded. Every
listening socket of the pool process and its sub-pools is checked, so a listener
opened by UCX/NIXL underneath counts too.
"""

from __future__ import annotations

import os

import psutil
import xoscar as xo

from xinference.core.placement import plan_replicas
from xinference.core.worker import WorkerActor

HOST = "127.0.0.1"


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every TCP listener of these processes."""
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            found.append((conn.pid, conn.laddr.ip, conn.laddr.port))
    return found


async def test_worker_and_replica_pools_listen_only_on_the_given_host():
    pool = await xo.create_actor_pool(HOST, n_process=0, auto_recover=False)
    try:
        worker = await xo.create_actor(
            WorkerActor,
            pool,
            gpus=[],
            address=pool.external_address,
            uid=WorkerActor.default_uid(),
        )
        addresses = []
        for xavier in (False, True):
            (placement,) = plan_replicas(1, gpus=[], xavier=xavier, user_env={})
            addresses.append(await worker.start_replica_pool(placement))
        pids = [os.getpid(), *(pool.sub_processes[a].pid for a in addresses)]
        sockets = listening(pids)
        assert {pid for pid, _, _ in sockets} >= set(pids[1:]), sockets
        assert all(ip == HOST for _, ip, _ in sockets), sockets
        for address in addresses:
            await worker.remove_replica(address)
    finally:
        await pool.stop()
