"""Which worker each rank goes to (the supervisor's rule, without processes)."""

from types import SimpleNamespace

import pytest

from xinference.core.heartbeat import HeartbeatSettings
from xinference.core.options import LaunchOptionError
from xinference.core.supervisor import SupervisorActor


def supervisor_with(*addresses: str) -> SupervisorActor:
    supervisor = SupervisorActor(HeartbeatSettings())
    supervisor._workers = {address: f"ref-{address}" for address in addresses}
    return supervisor


def spec(replica: int, worker_ip: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(replica=replica, worker_ip=worker_ip)


def test_replicas_spread_round_robin_over_the_workers_in_registration_order():
    supervisor = supervisor_with("127.0.0.2:1", "127.0.0.3:1")
    assert supervisor._assign_workers(spec(2)) == ["ref-127.0.0.2:1", "ref-127.0.0.3:1"]
    assert supervisor._assign_workers(spec(3)) == [
        "ref-127.0.0.2:1",
        "ref-127.0.0.3:1",
        "ref-127.0.0.2:1",
    ]


def test_worker_ip_keeps_every_replica_on_that_host():
    supervisor = supervisor_with("127.0.0.2:1", "127.0.0.3:1", "127.0.0.3:2")
    assert supervisor._assign_workers(spec(3, "127.0.0.3")) == [
        "ref-127.0.0.3:1",
        "ref-127.0.0.3:2",
        "ref-127.0.0.3:1",
    ]
    with pytest.raises(LaunchOptionError, match="no worker at worker_ip '10.0.0.9'"):
        supervisor._assign_workers(spec(1, "10.0.0.9"))


def test_no_worker_is_refused():
    with pytest.raises(RuntimeError, match="no worker is registered"):
        supervisor_with()._assign_workers(spec(1))
