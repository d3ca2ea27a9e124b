"""Every route of the application, enumerated from its route table, is checked:
a route added later is covered without editing this test.

Without a credential: 401, unless the route is on the public allow-list. With a
credential that lacks the route's permission: 403. With one that has it: neither.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from starlette.routing import Mount

from xinference.api.auth.permissions import (
    ADMIN,
    CLUSTER_JOIN,
    PERMISSIONS,
    PUBLIC_ROUTES,
    ROUTE_PERMISSIONS,
    is_public,
)

from .conftest import CLUSTER_SECRET


def expected_permission(method: str, path: str) -> str:
    """What a route must need, by the rule itself, not by the function the
    middleware asks: its entry in the table (HEAD as GET), else admin."""
    listed = ROUTE_PERMISSIONS.get(("GET" if method == "HEAD" else method, path))
    return ADMIN if listed is None else listed


def probes(app: Any) -> list[tuple[str, str, str]]:
    """(method, declared path, a concrete URL) for every route and method."""
    found = []
    for route in app.routes:
        if isinstance(route, Mount):
            found.append(("GET", route.path, f"{route.path}/app.js"))
            continue
        url = re.sub(r"\{[^}]+\}", "nosuch", route.path)
        for method in sorted(route.methods or ()):
            found.append((method, route.path, url))
    return found


async def test_every_route_checks_its_permission(authed):
    figures = {
        "probed": 0,
        "public": 0,
        "401": 0,
        "403": 0,
        "allowed": 0,
        "unlisted": 0,
    }
    # per permission: a user holding every other (admin excluded) and one holding it
    lacking: dict[str, str] = {}
    holding: dict[str, str] = {}
    for index, permission in enumerate(PERMISSIONS):
        others = [p for p in PERMISSIONS if p not in (permission, ADMIN)]
        token, _ = await authed.user_with(f"lacks{index}", others)
        lacking[permission] = token
        if permission != ADMIN:
            _, key = await authed.user_with(f"holds{index}", [permission])
            holding[permission] = key
    holding[ADMIN] = authed.admin_token
    lacking[CLUSTER_JOIN] = lacking[ADMIN]  # everything but admin
    holding[CLUSTER_JOIN] = CLUSTER_SECRET

    async def call(method: str, url: str, credential: str | None) -> int:
        headers = authed.bearer(credential) if credential else {}
        body = {} if method in ("POST", "PUT", "PATCH") else None
        response = await authed.http.request(method, url, json=body, headers=headers)
        return response.status_code

    for method, path, url in probes(authed.app):
        figures["probed"] += 1
        anonymous = await call(method, url, None)
        if is_public(method, path):
            figures["public"] += 1
            assert anonymous not in (401, 403), (method, path, anonymous)
            continue
        assert anonymous == 401, (method, path, anonymous)
        figures["401"] += 1
        needed = expected_permission(method, path)
        if ("GET" if method == "HEAD" else method, path) not in ROUTE_PERMISSIONS:
            figures["unlisted"] += 1  # needs admin: a user with all else is refused
        refused = await call(method, url, lacking[needed])
        assert refused == 403, (method, path, needed, refused)
        figures["403"] += 1
        allowed = await call(method, url, holding[needed])
        assert allowed not in (401, 403), (method, path, needed, allowed)
        figures["allowed"] += 1
    print(f"\nroute probe figures: {figures}; allow-list {sorted(PUBLIC_ROUTES)}")
    # the table really has the application's routes, and FastAPI's docs are closed
    assert figures["probed"] >= 25 and figures["401"] >= 18
    # FastAPI's docs routes are in no table: they check the admin default
    assert figures["unlisted"] >= 2
    assert not is_public("GET", "/openapi.json") and not is_public("GET", "/docs")


async def test_a_route_added_later_needs_admin(authed):
    """A route nobody listed in the permission table is closed to every
    credential without admin, whatever else it holds."""

    async def added_later() -> dict[str, str]:
        return {"ok": "yes"}

    authed.app.add_api_route("/v1/added-later", added_later, methods=["GET"])
    others = [p for p in PERMISSIONS if p != ADMIN]
    token, key = await authed.user_with("everything-but-admin", others)
    for credential in (token, key):
        response = await authed.http.get(
            "/v1/added-later", headers=authed.bearer(credential)
        )
        assert response.status_code == 403, response.text
    admin = await authed.http.get(
        "/v1/added-later", headers=authed.bearer(authed.admin_token)
    )
    assert admin.status_code == 200 and admin.json() == {"ok": "yes"}


async def test_a_path_no_route_has_needs_a_credential_too(authed):
    """No probing for which paths exist without a credential."""
    response = await authed.http.get("/v1/not-a-route")
    assert response.status_code == 401
    with_token = await authed.http.get(
        "/v1/not-a-route", headers=authed.bearer(authed.admin_token)
    )
    assert with_token.status_code == 404


@pytest.mark.parametrize(
    "header",
    ["", "Bearer", "Bearer ", "Basic cm9vdDpwdw==", "Bearer not-a-key", "Bearer a.b.c"],
)
async def test_malformed_or_unknown_credentials_are_401(authed, header):
    response = await authed.http.get("/v1/models", headers={"Authorization": header})
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/", "/status"])
async def test_head_of_the_page_and_the_probe_answers_as_get(
    authed, supervisor_address, path
):
    """Load balancers and uptime checkers probe with HEAD: public where GET is,
    with the status and headers of a GET, authentication on or off."""
    import httpx

    from xinference.api.restful_api import create_app

    open_app = httpx.ASGITransport(app=create_app(supervisor_address))
    async with httpx.AsyncClient(transport=open_app, base_url="http://t") as plain:
        for http in (authed.http, plain):
            get = await http.get(path)
            head = await http.head(path)
            assert get.status_code == 200
            assert head.status_code == 200, (path, head.status_code)
            assert head.headers["content-type"] == get.headers["content-type"]
