"""The request size limit: a body over the server's limit is a 413 with a JSON body
before any route reads it, whether it declares its length or arrives in chunks;
the limit is the server's --max-request-bytes (16 MiB unless set)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from click.testing import CliRunner

from xinference.api.body_limit import DEFAULT_MAX_REQUEST_BYTES
from xinference.api.restful_api import create_app
from xinference.api.server_options import ServerOptions
from xinference.deploy import cmdline

LIMIT = 64 * 1024


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """The app behind a real uvicorn server, limited to LIMIT bytes (no
    supervisor: the routes used here never reach one)."""
    app = create_app(
        f"127.0.0.1:{_free_port()}", options=ServerOptions(max_request_bytes=LIMIT)
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def login_body(junk_bytes: int) -> bytes:
    """A login with a junk field (ignored by the route) of ``junk_bytes``."""
    return json.dumps(
        {"username": "a", "password": "b", "junk": "x" * junk_bytes}
    ).encode()


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    body = response.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert f"limit of {LIMIT} bytes" in body["detail"]
    assert "--max-request-bytes" in body["detail"]


def test_a_body_declared_over_the_limit_is_a_413(endpoint):
    with httpx.Client(base_url=endpoint, timeout=30) as http:
        refused = http.post(
            "/v1/completions",
            content=login_body(LIMIT),
            headers={"content-type": "application/json"},
        )
        assert_refused(refused)
        assert str(len(login_body(LIMIT))) in refused.json()["detail"]
        # the server answers on: the next request is served
        assert http.get("/status").json() == {"ok": True}


def test_a_chunked_body_is_refused_once_it_passes_the_limit(endpoint):
    sent = []

    def chunks() -> Iterator[bytes]:
        for _ in range(4 * LIMIT // 4096):
            sent.append(4096)
            yield b"x" * 4096

    with httpx.Client(base_url=endpoint, timeout=30) as http:
        refused = http.post(
            "/token", content=chunks(), headers={"content-type": "application/json"}
        )
    assert "content-length" not in refused.request.headers
    assert_refused(refused)


def test_a_body_within_the_limit_reaches_its_route(endpoint):
    with httpx.Client(base_url=endpoint, timeout=30) as http:
        served = http.post(
            "/token",
            content=login_body(LIMIT - 100),
            headers={"content-type": "application/json"},
        )
    # the route read it: with authentication off, /token says so
    assert served.status_code == 400 and "off" in served.json()["detail"]


async def test_by_default_a_32_mb_body_is_refused():
    """The issue's 32 MB body with a junk field, against the default limit."""
    assert ServerOptions().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 16 << 20
    transport = httpx.ASGITransport(app=create_app("127.0.0.1:1"))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        refused = await http.post(
            "/v1/chat/completions",
            content=login_body(32 << 20),
            headers={"content-type": "application/json"},
        )
    assert refused.status_code == 413
    assert "16.0 MiB" in refused.json()["detail"]


@pytest.mark.parametrize("command", ["local", "supervisor"])
def test_the_server_option_reaches_the_server(monkeypatch, command):
    started = {}

    async def serve(*args):
        started["options"] = args[-1]

    monkeypatch.setattr(cmdline, f"_serve_{command}", serve)
    runner = CliRunner()
    done = runner.invoke(
        cmdline.cli, [command, "--max-request-bytes", "1MiB"], catch_exceptions=False
    )
    assert done.exit_code == 0, done.output
    assert started["options"].max_request_bytes == 1 << 20
    bad = runner.invoke(cmdline.cli, [command, "--max-request-bytes", "0"])
    assert bad.exit_code == 2 and "--max-request-bytes" in bad.output
