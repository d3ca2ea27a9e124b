"""Supervisor and worker processes for the cluster tests, started with the commands
users run (``python -m xinference.deploy.cmdline supervisor|worker``), each on its
own loopback address."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from .local_server import engine_env

STARTUP_TIMEOUT_S = 90.0
SHUTDOWN_TIMEOUT_S = 120.0
REPO = Path(__file__).resolve().parents[2]


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class Node:
    """One node process; ``ready`` is the line (a regex with one group) it prints
    once it serves."""

    def __init__(
        self, name: str, args: list[str], workdir: Path, ready: str, env: dict[str, str]
    ) -> None:
        self.name = name
        self.args = args
        self.workdir = workdir
        self.ready = re.compile(ready)
        self.env = env
        self.log_path = workdir / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.announced = ""

    def start(self) -> Node:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xinference.deploy.cmdline", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=REPO,
        )
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")[offset:]
            match = self.ready.search(text)
            if match:
                self.announced = match.group(1)
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start:\n{self.tail()}")
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.name} did not start:\n{self.tail()}")

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def tree(self) -> list[psutil.Process]:
        try:
            return [psutil.Process(self.pid), *psutil.Process(self.pid).children(True)]
        except psutil.NoSuchProcess:
            return []

    def kill_host(self) -> list[int]:
        """SIGKILL the node and every process under it at once, as a host that
        loses power would; the pids killed."""
        tree = self.tree()
        for process in tree:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)
        assert self.process is not None
        self.process.wait(10)
        return [process.pid for process in tree]

    def stop(self) -> list[int]:
        """SIGTERM, bounded wait, then kill what is left; the pids killed."""
        if self.process is None or self.process.poll() is not None:
            return []
        tree = self.tree()[1:]
        killed = []
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            killed.append(self.pid)
            self.process.kill()
            self.process.wait(10)
        _, alive = psutil.wait_procs(tree, timeout=10)
        for process in alive:
            killed.append(process.pid)
            process.kill()
        return killed

    def tail(self, lines: int = 60) -> str:
        text = (
            self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        )
        return "\n".join(text.splitlines()[-lines:])


def node_env(home: Path, heartbeat_interval: str, heartbeat_timeout: str) -> dict:
    env = engine_env(home)
    env.update(
        XINFERENCE_HEARTBEAT_INTERVAL_S=heartbeat_interval,
        XINFERENCE_HEARTBEAT_TIMEOUT_S=heartbeat_timeout,
    )
    return env


def supervisor_node(workdir: Path, host: str, env: dict[str, str]) -> Node:
    return Node(
        "supervisor",
        ["supervisor", "-H", host, "-p", "0"],
        workdir,
        r"Xinference serving at (http://\S+)",
        env,
    )


def worker_node(
    workdir: Path, name: str, endpoint: str, host: str, port: int, env: dict[str, str]
) -> Node:
    return Node(
        name,
        ["worker", "-e", endpoint, "-H", host, "--worker-port", str(port)],
        workdir,
        r"Xinference worker at ([^\s,]+)",
        env,
    )
