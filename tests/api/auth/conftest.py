"""An app with authentication on in front of a real supervisor actor in a real
xoscar pool (no worker, no engine): every route runs its real handler."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import xoscar as xo

from xinference.api.auth import AuthService
from xinference.api.auth.throttle import LoginThrottle
from xinference.api.restful_api import create_app
from xinference.core.supervisor import SupervisorActor

ADMIN_USER = "root"
ADMIN_PASSWORD = "correct horse battery"
CLUSTER_SECRET = "cluster-secret-for-tests-0123456789"


class ManualClock:
    """A monotonic clock that moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class AuthedApp:
    app: object
    service: AuthService
    http: httpx.AsyncClient
    admin_token: str
    clock: ManualClock

    def client_from(self, host: str) -> httpx.AsyncClient:
        """Another client of the same app, calling from ``host``."""
        transport = httpx.ASGITransport(app=self.app, client=(host, 5555))
        return httpx.AsyncClient(transport=transport, base_url="http://test")

    def bearer(self, credential: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {credential}"}

    async def user_with(self, name: str, permissions: list[str]) -> tuple[str, str]:
        """A new user with exactly ``permissions``: (access token, API key)."""
        admin = self.bearer(self.admin_token)
        password = f"{name}-password"
        response = await self.http.post(
            "/v1/admin/users",
            json={"username": name, "password": password, "permissions": permissions},
            headers=admin,
        )
        assert response.status_code == 200, response.text
        login = await self.http.post(
            "/token", json={"username": name, "password": password}
        )
        assert login.status_code == 200, login.text
        key = await self.http.post(
            "/v1/admin/keys", json={"name": "k", "owner": name}, headers=admin
        )
        assert key.status_code == 200, key.text
        return login.json()["access_token"], key.json()["api_key"]


@pytest.fixture
async def supervisor_address() -> AsyncIterator[str]:
    pool = await xo.create_actor_pool("127.0.0.1", n_process=0)
    try:
        await xo.create_actor(
            SupervisorActor,
            address=pool.external_address,
            uid=SupervisorActor.default_uid(),
        )
        yield pool.external_address
    finally:
        await pool.stop()


@pytest.fixture
async def authed(tmp_path, supervisor_address) -> AsyncIterator[AuthedApp]:
    clock = ManualClock()
    service = AuthService.open(
        tmp_path,
        cluster_secret=CLUSTER_SECRET,
        throttle=LoginThrottle(limit=5, window_s=60.0, clock=clock),
    )
    app = create_app(supervisor_address, service)
    transport = httpx.ASGITransport(app=app, client=("10.1.2.3", 5555))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        setup = await http.post(
            "/v1/admin/setup", json={"username": ADMIN_USER, "password": ADMIN_PASSWORD}
        )
        assert setup.status_code == 200, setup.text
        yield AuthedApp(app, service, http, setup.json()["access_token"], clock)
    service.close()
