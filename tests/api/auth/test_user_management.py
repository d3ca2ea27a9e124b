"""Who may make users with which permissions: ``users:manage`` lets its holder
make users with the permissions they hold themselves, never more."""

from __future__ import annotations

from xinference.api.auth.permissions import (
    ADMIN,
    KEYS_MANAGE,
    MODELS_LIST,
    MODELS_START,
    USERS_MANAGE,
)


async def new_user(authed, credential: str, name: str, permissions: list[str]):
    return await authed.http.post(
        "/v1/admin/users",
        json={"username": name, "password": "p" * 12, "permissions": permissions},
        headers=authed.bearer(credential),
    )


async def test_a_user_manager_grants_only_what_they_hold(authed):
    token, key = await authed.user_with("manager", [USERS_MANAGE, MODELS_LIST])
    for credential in (token, key):
        refused = await new_user(authed, credential, "ops", [MODELS_START])
        assert refused.status_code == 403
        assert MODELS_START in refused.json()["detail"]
        mixed = await new_user(authed, credential, "ops", [MODELS_LIST, KEYS_MANAGE])
        assert mixed.status_code == 403 and KEYS_MANAGE in mixed.json()["detail"]
        admin = await new_user(authed, credential, "boss", [ADMIN])
        assert admin.status_code == 403
    users = await authed.http.get("/v1/admin/users", headers=authed.bearer(token))
    assert {user["username"] for user in users.json()} == {"root", "manager"}
    # what they hold, they may hand on (users:manage included)
    made = await new_user(authed, token, "helper", [MODELS_LIST, USERS_MANAGE])
    assert made.status_code == 200, made.text
    assert set(made.json()["permissions"]) == {MODELS_LIST, USERS_MANAGE}


async def test_an_admin_grants_anything(authed):
    made = await new_user(
        authed, authed.admin_token, "ops", [MODELS_START, KEYS_MANAGE, ADMIN]
    )
    assert made.status_code == 200, made.text
