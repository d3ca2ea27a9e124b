"""Worker liveness with real processes and no engines: a worker frozen (SIGSTOP,
as a network cut looks from the supervisor) is declared gone within the bound, and
once it runs again it learns that from its next heartbeat, registers again and
removes the replica sub-pool it had (the supervisor counts it gone); a worker
stopped with SIGTERM leaves at once."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import psutil
import pytest
import xoscar as xo

from xinference.core.placement import ReplicaPlacement
from xinference.core.worker import WorkerActor

from .cluster_nodes import free_port, node_env, supervisor_node, worker_node

pytestmark = pytest.mark.slow

INTERVAL_S = 0.3
TIMEOUT_S = 2.0
SLACK_S = 3.0  # a busy 2-core CI host


def workers(http: httpx.Client) -> list[str]:
    return [worker["host"] for worker in http.get("/v1/workers").json()]


def wait_for(http: httpx.Client, expected: list[str], timeout: float) -> float:
    started = time.monotonic()
    while sorted(workers(http)) != sorted(expected):
        assert time.monotonic() - started < timeout, workers(http)
        time.sleep(0.05)
    return time.monotonic() - started


async def test_a_frozen_worker_is_gone_then_rejoins_and_a_stopped_one_leaves(
    tmp_path,
):
    env = node_env(tmp_path, str(INTERVAL_S), str(TIMEOUT_S))
    supervisor = supervisor_node(tmp_path, "127.0.0.1", env).start()
    nodes = []
    try:
        for host in ("127.0.0.2", "127.0.0.3"):
            node = worker_node(
                tmp_path, f"w-{host}", supervisor.announced, host, free_port(host), env
            )
            nodes.append(node.start())
        with httpx.Client(base_url=supervisor.announced, timeout=30) as http:
            wait_for(http, ["127.0.0.2", "127.0.0.3"], 30)
            frozen = nodes[1]
            # a replica sub-pool on the worker about to be cut off (no engine)
            pool = await xo.create_actor_pool("127.0.0.1", n_process=0)
            try:
                worker = await xo.actor_ref(
                    address=frozen.announced, uid=WorkerActor.default_uid()
                )
                sub_pool = await worker.start_replica_pool(
                    ReplicaPlacement(rank=0, gpu=None, address_scheme=None, env=())
                )
                sub_pid = (await worker.sub_pools())[sub_pool]
            finally:
                await pool.stop()
            frozen.process.send_signal(signal.SIGSTOP)
            try:
                gone_after = wait_for(http, ["127.0.0.2"], TIMEOUT_S + 30)
            finally:
                frozen.process.send_signal(signal.SIGCONT)
            assert gone_after <= TIMEOUT_S + INTERVAL_S + SLACK_S
            assert gone_after >= TIMEOUT_S - INTERVAL_S  # not before the timeout
            wait_for(http, ["127.0.0.2", "127.0.0.3"], 30)
            assert "registering again" in frozen.tail()
            # the sub-pool it had is not served: removed after the rejoin
            started = time.monotonic()
            while psutil.pid_exists(sub_pid) and time.monotonic() - started < 30:
                await asyncio.sleep(0.1)
            assert not psutil.pid_exists(sub_pid), frozen.tail()
            assert f"replica sub-pool {sub_pool} is not served any more" in (
                frozen.tail()
            )
            nodes[0].process.send_signal(signal.SIGTERM)
            nodes[0].process.wait(60)
            assert workers(http) == ["127.0.0.3"]  # no timeout waited
        assert "127.0.0.2:" in supervisor.tail() and "stopped" in supervisor.tail()
    finally:
        leftovers = [pid for node in [*nodes, supervisor] for pid in node.stop()]
    assert leftovers == []
