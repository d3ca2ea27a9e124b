import pytest

from ..deploy.local_server import LocalServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `xinference local` server process, shared by a module's tests."""
    server = LocalServer(tmp_path_factory.mktemp("xinference-home")).start()
    try:
        yield server
    finally:
        killed = server.stop()
    assert killed == [], f"server or its children ignored SIGTERM:\n{server.tail()}"


@pytest.fixture(scope="module")
def authed_server(tmp_path_factory):
    """A real `xinference local --auth` server process (authentication on, on a
    loopback bind), shared by a module's tests; no admin exists yet."""
    server = LocalServer(
        tmp_path_factory.mktemp("xinference-home"), extra_args=("--auth",)
    ).start()
    try:
        yield server
    finally:
        killed = server.stop()
    assert killed == [], f"server or its children ignored SIGTERM:\n{server.tail()}"
