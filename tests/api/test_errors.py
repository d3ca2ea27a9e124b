"""Errors keep the connection: the REST app behind a real uvicorn server whose
supervisor is unreachable, so every management call fails inside the server with
an error no handler expects (a 500). No engine, no pool."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from xinference.api.restful_api import create_app


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def endpoint():
    # Nobody listens at the supervisor's address: calls to it fail unexpectedly.
    app = create_app(f"127.0.0.1:{_free_port()}")
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


def local_port(response: httpx.Response) -> int:
    """The client side's port of the connection that carried ``response``."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_a_server_error_is_json_and_keeps_the_connection(endpoint):
    with httpx.Client(base_url=endpoint, timeout=30) as http:
        failed = http.get("/v1/models")
        assert failed.status_code == 500
        body = failed.json()
        assert body["detail"] and body["error"]["type"] == "server_error"
        assert body["error"]["message"] == body["detail"]
        assert failed.headers.get("connection") != "close"
        served = http.get("/status")
        assert served.status_code == 200 and served.json() == {"ok": True}
        # the same TCP connection carried both
        assert local_port(served) == local_port(failed)


def test_each_error_status_has_a_json_body_on_the_same_connection(endpoint):
    with httpx.Client(base_url=endpoint, timeout=30) as http:
        ports = set()
        for method, path, body, status in [
            (
                "POST",
                "/v1/completions",
                {"model": "m", "prompt": "x", "echo": True},
                400,
            ),
            ("POST", "/v1/completions", {"model": "m"}, 422),
            ("DELETE", "/v1/models/nothing-here", None, 500),
            ("GET", "/no/such/path", None, 404),
        ]:
            response = http.request(method, path, json=body)
            assert response.status_code == status, response.text
            assert response.json()["detail"], response.text
            ports.add(local_port(response))
        assert len(ports) == 1
