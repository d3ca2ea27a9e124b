"""Authentication as the commands users run set it up (no engine starts here).

A supervisor with authentication on takes in only workers that show the cluster's
secret, and tells its pool address only to them (or an admin). ``xinference local``
on a reachable address authenticates without being asked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .cluster_nodes import free_port, node_env, supervisor_node, worker_node
from .local_server import LocalServer

SECRET = "the-clusters-secret-0123456789abcdef"
ADMIN = {"username": "admin", "password": "admin password 1"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("auth-supervisor")
    env = node_env(workdir, "0.5", "5") | {"XINFERENCE_CLUSTER_SECRET": SECRET}
    node = supervisor_node(workdir, "127.0.0.1", env)
    node.args += ["--auth"]
    node.start()
    try:
        setup = httpx.post(f"{node.announced}/v1/admin/setup", json=ADMIN)
        assert setup.status_code == 200, setup.text
        node.admin = {"Authorization": f"Bearer {setup.json()['access_token']}"}
        yield node
    finally:
        assert node.stop() == [], node.tail()


def run_worker(endpoint: str, secret: str | None, *extra: str, workdir: Path):
    env = node_env(workdir, "0.5", "5")
    env.pop("XINFERENCE_CLUSTER_SECRET", None)
    args = ["worker", "-e", endpoint, "-H", "127.0.0.1", *extra]
    if secret is not None:
        args += ["--cluster-secret", secret]
    return subprocess.run(
        [sys.executable, "-m", "xinference.deploy.cmdline", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_pool_address_is_not_public(supervisor):
    endpoint = supervisor.announced
    assert httpx.get(f"{endpoint}/v1/address").status_code == 401
    wrong = {"Authorization": "Bearer not-the-secret"}
    assert httpx.get(f"{endpoint}/v1/address", headers=wrong).status_code == 401
    right = {"Authorization": f"Bearer {SECRET}"}
    assert httpx.get(f"{endpoint}/v1/address", headers=right).status_code == 200
    # the secret opens only that: no models, no workers
    assert httpx.get(f"{endpoint}/v1/models", headers=right).status_code == 403


def test_a_worker_with_a_wrong_secret_is_refused_and_not_listed(supervisor, tmp_path):
    endpoint = supervisor.announced
    address = httpx.get(f"{endpoint}/v1/address", headers=supervisor.admin).json()[
        "address"
    ]
    # through the REST API: refused the address
    refused = run_worker(endpoint, "not-the-secret", workdir=tmp_path)
    assert refused.returncode != 0
    assert "cluster's secret" in refused.stderr, refused.stderr
    # straight to the pool: the supervisor refuses the registration itself
    direct = run_worker(
        endpoint, "not-the-secret", "--supervisor-address", address, workdir=tmp_path
    )
    assert direct.returncode != 0
    assert "wrong or missing cluster secret" in direct.stderr, direct.stderr
    missing = run_worker(
        endpoint, None, "--supervisor-address", address, workdir=tmp_path
    )
    assert missing.returncode != 0
    for result in (refused, direct, missing):
        assert SECRET not in result.stdout + result.stderr
        assert "not-the-secret" not in result.stderr
    workers = httpx.get(f"{endpoint}/v1/workers", headers=supervisor.admin).json()
    assert workers == []
    assert SECRET not in supervisor.log_path.read_text()


def test_a_worker_with_the_secret_joins(supervisor, tmp_path):
    endpoint = supervisor.announced
    env = node_env(tmp_path, "0.5", "5") | {"XINFERENCE_CLUSTER_SECRET": SECRET}
    port = free_port("127.0.0.1")
    worker = worker_node(tmp_path, "worker", endpoint, "127.0.0.1", port, env).start()
    try:
        workers = httpx.get(f"{endpoint}/v1/workers", headers=supervisor.admin).json()
        assert [entry["address"] for entry in workers] == [f"127.0.0.1:{port}"]
    finally:
        assert worker.stop() == [], worker.tail()


def test_a_reachable_local_server_authenticates_unasked(tmp_path):
    server = LocalServer(tmp_path, host="0.0.0.0").start()
    try:
        endpoint = server.endpoint
        assert httpx.get(f"{endpoint}/v1/cluster/auth").json() == {"auth": True}
        assert httpx.get(f"{endpoint}/v1/models").status_code == 401
        assert "authentication on (0.0.0.0 is reachable" in server.tail()
    finally:
        assert server.stop() == []


def test_a_reachable_open_server_needs_saying_so(tmp_path):
    server = LocalServer(
        tmp_path, host="0.0.0.0", env={"XINFERENCE_AUTH_ADVANCED": "false"}
    ).start()
    try:
        assert httpx.get(f"{server.endpoint}/v1/cluster/auth").json() == {"auth": False}
        assert "authentication OFF (XINFERENCE_AUTH_ADVANCED=false)" in server.tail()
    finally:
        assert server.stop() == []
