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
