"""Credentials that must stop working, logins that must slow down, first-run
setup that happens once, and secrets that stay out of answers and logs."""

from __future__ import annotations

import logging
import stat
import time

from xinference.api.auth.permissions import MODELS_LIST, MODELS_READ, MODELS_START
from xinference.api.auth.store import read_or_create_secret

from .conftest import ADMIN_PASSWORD, ADMIN_USER


async def test_an_expired_token_is_refused(authed):
    signer = authed.service.signer
    stale = signer.issue(ADMIN_USER, now=time.time() - signer.ttl_s - 5)
    fresh = signer.issue(ADMIN_USER)
    assert (
        await authed.http.get("/v1/models", headers=authed.bearer(fresh))
    ).is_success
    response = await authed.http.get("/v1/models", headers=authed.bearer(stale))
    assert response.status_code == 401
    assert "expired" in response.json()["detail"]


async def test_a_token_signed_with_another_secret_is_refused(authed):
    import jwt

    forged = jwt.encode(
        {"sub": ADMIN_USER, "iat": int(time.time()), "exp": int(time.time()) + 60},
        "not-the-server-secret-but-long-enough-for-hs256",
        algorithm="HS256",
    )
    response = await authed.http.get("/v1/models", headers=authed.bearer(forged))
    assert response.status_code == 401


async def test_a_revoked_key_is_refused_on_the_next_request(authed):
    _, key = await authed.user_with("reader", [MODELS_LIST])
    assert (await authed.http.get("/v1/models", headers=authed.bearer(key))).is_success
    keys = await authed.http.get(
        "/v1/admin/keys", headers=authed.bearer(authed.admin_token)
    )
    (record,) = [entry for entry in keys.json() if entry["owner"] == "reader"]
    assert "api_key" not in record and record["revoked"] is False
    revoked = await authed.http.delete(
        f"/v1/admin/keys/{record['key_id']}", headers=authed.bearer(authed.admin_token)
    )
    assert revoked.json()["revoked"] is True
    response = await authed.http.get("/v1/models", headers=authed.bearer(key))
    assert response.status_code == 401


async def test_a_deleted_users_token_and_keys_stop_working(authed):
    token, key = await authed.user_with("leaver", [MODELS_LIST])
    await authed.http.delete(
        "/v1/admin/users/leaver", headers=authed.bearer(authed.admin_token)
    )
    for credential in (token, key):
        response = await authed.http.get(
            "/v1/models", headers=authed.bearer(credential)
        )
        assert response.status_code == 401


async def test_a_key_never_does_more_than_its_owner(authed):
    token, _ = await authed.user_with("lister", [MODELS_LIST])
    # the user cannot mint a key with a permission they lack ...
    grab = await authed.http.post(
        "/v1/admin/keys",
        json={"name": "x", "permissions": [MODELS_START]},
        headers=authed.bearer(token),
    )
    assert grab.status_code == 403  # lister lacks keys:manage as well
    # ... and an admin-made key that says more is cut down to the owner's now
    made = await authed.http.post(
        "/v1/admin/keys",
        json={"owner": "lister", "permissions": [MODELS_LIST, MODELS_READ]},
        headers=authed.bearer(authed.admin_token),
    )
    key = made.json()["api_key"]
    response = await authed.http.get("/v1/workers", headers=authed.bearer(key))
    assert response.status_code == 403


async def test_setup_happens_once(authed):
    status = await authed.http.get("/v1/admin/setup/status")
    assert status.json() == {"auth": True, "needs_setup": False}
    again = await authed.http.post(
        "/v1/admin/setup", json={"username": "mallory", "password": "p" * 12}
    )
    assert again.status_code == 409
    users = await authed.http.get(
        "/v1/admin/users", headers=authed.bearer(authed.admin_token)
    )
    assert [user["username"] for user in users.json()] == [ADMIN_USER]


async def test_secrets_stay_out_of_answers_and_logs(authed, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    token, key = await authed.user_with("quiet", [MODELS_LIST])
    bodies = []
    for credential in (key + "x", token[:-3] + "abc", "Bearer " + key):
        response = await authed.http.get(
            "/v1/models/nosuch/stats", headers=authed.bearer(credential)
        )
        bodies.append(response.text)
    bodies.append(
        (await authed.http.get("/v1/admin/users", headers=authed.bearer(token))).text
    )
    listing = await authed.http.get(
        "/v1/admin/keys", headers=authed.bearer(authed.admin_token)
    )
    bodies.append(listing.text)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for secret in (key, token, ADMIN_PASSWORD, "quiet-password"):
        assert all(secret not in body for body in bodies)
        assert secret not in logged
    directory = tmp_path / "auth"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    db = (directory / "auth.db").read_bytes()
    assert ADMIN_PASSWORD.encode() not in db and key.encode() not in db


def test_a_secret_is_made_once(tmp_path):
    first = read_or_create_secret(tmp_path / "s")
    assert read_or_create_secret(tmp_path / "s") == first and len(first) >= 40
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o600


async def test_with_authentication_off_everything_is_open(supervisor_address):
    """What upstream's client asks first, and what an open server answers."""
    import httpx

    from xinference.api.restful_api import create_app

    transport = httpx.ASGITransport(app=create_app(supervisor_address))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/v1/cluster/auth")).json() == {"auth": False}
        assert (await http.get("/v1/admin/setup/status")).json() == {
            "auth": False,
            "needs_setup": False,
        }
        assert (await http.get("/v1/models")).status_code == 200
        assert (await http.get("/v1/address")).status_code == 200
        login = await http.post("/token", json={"username": "a", "password": "b"})
        assert login.status_code == 400 and "off" in login.json()["detail"]
        # the admin routes say why they cannot answer (found by test_rest_fuzz)
        for method, path in [
            ("GET", "/v1/admin/users"),
            ("GET", "/v1/admin/keys"),
            ("POST", "/v1/admin/keys"),
            ("DELETE", "/v1/admin/keys/x"),
            ("DELETE", "/v1/admin/users/x"),
        ]:
            response = await http.request(method, path, json={})
            assert response.status_code == 400, (method, path, response.text)
