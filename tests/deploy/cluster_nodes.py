"""Supervisor and worker processes for the cluster tests, started with the commands
users run (``python -m xinference.deploy.cmdline supervisor|worker``), each on its
own loopback address."""

from __future__ import annotations

import socket
from pathlib import Path

from .local_server import CommandProcess, engine_env


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def node_env(home: Path, heartbeat_interval: str, heartbeat_timeout: str) -> dict:
    env = engine_env(home)
    env.update(
        XINFERENCE_HEARTBEAT_INTERVAL_S=heartbeat_interval,
        XINFERENCE_HEARTBEAT_TIMEOUT_S=heartbeat_timeout,
    )
    return env


def supervisor_node(workdir: Path, host: str, env: dict[str, str]) -> CommandProcess:
    return CommandProcess(
        "supervisor",
        ["supervisor", "-H", host, "-p", "0"],
        workdir,
        r"Xinference serving at (http://\S+)",
        env,
    )


def worker_node(
    workdir: Path, name: str, endpoint: str, host: str, port: int, env: dict[str, str]
) -> CommandProcess:
    return CommandProcess(
        name,
        ["worker", "-e", endpoint, "-H", host, "--worker-port", str(port)],
        workdir,
        r"Xinference worker at ([^\s,]+)",
        env,
    )
