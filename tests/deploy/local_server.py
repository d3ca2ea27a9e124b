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
from typing import Self

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


class CommandProcess:
    """One ``python -m xinference.deploy.cmdline ...`` process, logging to
    ``<workdir>/<name>.log``; ``ready`` is the line (a regex with one group) it
    prints once it serves, and ``announced`` that group."""

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

    def start(self) -> Self:
        # Appended to, so that a process started again keeps the earlier log; only
        # what this start writes is searched for the ready line.
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "xinference.deploy.cmdline", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=Path(__file__).resolve().parents[2],
        )
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
        raise TimeoutError(
            f"{self.name} did not start in {STARTUP_TIMEOUT_S} s:\n{self.tail()}"
        )

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def tree(self) -> list[psutil.Process]:
        """The process and every process under it."""
        try:
            return [psutil.Process(self.pid), *psutil.Process(self.pid).children(True)]
        except psutil.NoSuchProcess:
            return []

    def descendants(self) -> set[int]:
        """Pids of every live process under this one (zombies excluded)."""
        alive = set()
        for child in self.tree()[1:]:
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    alive.add(child.pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def kill_host(self) -> list[int]:
        """SIGKILL the process and every process under it at once, as a host that
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
        """SIGTERM (a server terminates its models, a worker leaves), wait
        (bounded), then kill whatever is left, descendants included; returns the
        pids that had to be killed (none when it shut down cleanly)."""
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


class LocalServer(CommandProcess):
    """``xinference local`` on 127.0.0.1, any free port (upstream's short flags,
    -H and -p, exercised by every server test)."""

    def __init__(
        self,
        workdir: Path,
        host: str = "127.0.0.1",
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            "server",
            ["local", "-H", host, "-p", "0", *extra_args],
            workdir,
            _ENDPOINT.pattern,
            engine_env(workdir) | (env or {}),
        )

    @property
    def endpoint(self) -> str:
        return self.announced


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
