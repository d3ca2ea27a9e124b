"""A real ``xinference local`` server in a subprocess, for the CLI and HTTP tests.

It is the command users run (``python -m xinference.deploy.cmdline local``); the
test reads the endpoint it prints, and at the end stops it with SIGTERM (the
server then terminates its models) and checks that no process it spawned is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

STARTUP_TIMEOUT_S = 90.0
SHUTDOWN_TIMEOUT_S = 120.0
_ENDPOINT = re.compile(r"Xinference serving at (http://\S+)")


def engine_env(home: Path) -> dict[str, str]:
    """Environment for CPU engines: small KV cache, offline, quiet vLLM."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_LOGGING_LEVEL="WARNING",
        XINFERENCE_HOME=str(home),
    )
    return env


class LocalServer:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.endpoint = ""

    def start(self) -> LocalServer:
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            # Upstream's short flags (-H, -p): exercised by every server test.
            [
                sys.executable,
                "-m",
                "xinference.deploy.cmdline",
                "local",
                "-H",
                "127.0.0.1",
                "-p",
                "0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_env(self.workdir),
            cwd=Path(__file__).resolve().parents[2],
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            match = _ENDPOINT.search(self.log_path.read_text(errors="replace"))
            if match:
                self.endpoint = match.group(1)
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited at start:\n{self.tail()}")
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"server did not start in {STARTUP_TIMEOUT_S} s:\n{self.tail()}"
        )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def descendants(self) -> set[int]:
        """Pids of every live process under the server (zombies excluded)."""
        alive = set()
        for child in psutil.Process(self.pid).children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    alive.add(child.pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def stop(self) -> list[int]:
        """SIGTERM (the server terminates its models), wait (bounded), then kill
        whatever is left, descendants included; returns the pids that had to be
        killed (none when the server shut down cleanly)."""
        if self.process is None or self.process.poll() is not None:
            return []
        try:
            tree = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
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


def wait_for_no_descendants(
    server: LocalServer, baseline: set[int], timeout: float
) -> set[int]:
    """Processes under the server beyond ``baseline`` still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    extra = server.descendants() - baseline
    while extra and time.monotonic() < deadline:
        time.sleep(0.2)
        extra = server.descendants() - baseline
    return extra
