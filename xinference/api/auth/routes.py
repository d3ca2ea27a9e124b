"""The authentication routes, upstream's contracts:

    GET    /v1/cluster/auth         {"auth": bool}                       public
    POST   /token                   {"username","password"} -> {"access_token",
                                    "token_type": "bearer", "expires_in"}  public
    GET    /v1/admin/setup/status   {"auth", "needs_setup"}              public
    POST   /v1/admin/setup          the first admin (409 once one exists) public
    GET    /v1/admin/users          users:manage
    POST   /v1/admin/users          {"username","password","permissions"}: only
                                    permissions the caller holds (admin: any)
    DELETE /v1/admin/users/{name}   (revokes the user's keys too)
    GET    /v1/admin/keys           keys:manage (a user's own; every key for admin)
    POST   /v1/admin/keys           {"name","permissions"[,"owner"]} -> the key, once
    DELETE /v1/admin/keys/{key_id}  revoked from the next request on

Which route needs which permission is ``permissions.py``'s table, checked by the
middleware before any of these run.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, Field

from .permissions import ADMIN, PERMISSIONS, USERS_MANAGE, Principal
from .service import AuthService, Throttled, Unauthorized
from .store import UserExists


class Credentials(BaseModel):
    username: str = Field(min_length=1, max_length=64)
    password: str = Field(min_length=1, max_length=1024)


class NewUser(Credentials):
    permissions: list[str] = Field(default_factory=lambda: ["models:list"])


class NewKey(BaseModel):
    name: str = Field(default="", max_length=128)
    permissions: list[str] | None = None  # default: the creator's
    owner: str | None = None  # default: the creator


def auth_router(service: AuthService) -> APIRouter:
    router = APIRouter()

    def store():  # type: ignore[no-untyped-def]
        if not service.enabled or service.store is None:
            raise HTTPException(400, "authentication is off on this server")
        return service.store

    def principal(request: Request) -> Principal:
        store()  # with authentication off there is nobody to name
        return request.state.principal  # set by the middleware

    @router.get("/v1/cluster/auth")
    async def cluster_auth() -> dict[str, bool]:
        return {"auth": service.enabled}

    @router.post("/token")
    async def token(body: Credentials, request: Request) -> dict[str, object]:
        store()
        host = request.client.host if request.client else "?"
        try:
            access = await service.login(body.username, body.password, host)
        except Throttled as error:
            raise HTTPException(
                429,
                str(error),
                headers={"Retry-After": str(int(error.retry_after_s) + 1)},
            ) from None
        except Unauthorized as error:
            raise HTTPException(401, str(error)) from None
        assert service.signer is not None
        return {
            "access_token": access,
            "token_type": "bearer",
            "expires_in": int(service.signer.ttl_s),
        }

    @router.get("/v1/admin/setup/status")
    async def setup_status() -> dict[str, bool]:
        needs = service.enabled and not store().has_admin()
        return {"auth": service.enabled, "needs_setup": needs}

    @router.post("/v1/admin/setup")
    async def setup(body: Credentials) -> dict[str, object]:
        users = store()
        if users.has_admin():
            raise HTTPException(409, "an admin exists: log in instead")
        try:
            user = await asyncio.to_thread(
                users.create_user, body.username, body.password, list(PERMISSIONS)
            )
        except (ValueError, UserExists) as error:
            raise HTTPException(400, str(error)) from None
        assert service.signer is not None
        return {
            "user": user.public(),
            "access_token": service.signer.issue(user.username),
            "token_type": "bearer",
        }

    @router.get("/v1/admin/users")
    async def list_users() -> list[dict[str, object]]:
        return [user.public() for user in store().list_users()]

    @router.post("/v1/admin/users")
    async def create_user(body: NewUser, request: Request) -> dict[str, object]:
        users = store()
        caller = principal(request)
        if not caller.may(ADMIN):
            # users:manage is not a way to more rights: a manager grants only
            # permissions they hold themselves (and never admin)
            if ADMIN in body.permissions:
                raise HTTPException(403, "only an admin makes an admin")
            beyond = set(body.permissions) - set(caller.permissions)
            if beyond:
                raise HTTPException(
                    403, f"you cannot grant what you lack: {sorted(beyond)}"
                )
        try:
            user = await asyncio.to_thread(
                users.create_user, body.username, body.password, body.permissions
            )
        except UserExists as error:
            raise HTTPException(409, str(error)) from None
        except ValueError as error:
            raise HTTPException(400, str(error)) from None
        return user.public()

    @router.delete("/v1/admin/users/{username}")
    async def delete_user(username: str, request: Request) -> dict[str, object]:
        users = store()
        target = users.get_user(username)
        if target is None:
            raise HTTPException(404, f"no user {username!r}")
        if ADMIN in target.permissions and not principal(request).may(ADMIN):
            raise HTTPException(403, "only an admin removes an admin")
        users.delete_user(username)
        return {"username": username, "deleted": True}

    @router.get("/v1/admin/keys")
    async def list_keys(request: Request) -> list[dict[str, object]]:
        caller = principal(request)
        owner = None if caller.may(ADMIN) else caller.name
        return [key.public() for key in store().list_keys(owner)]

    @router.post("/v1/admin/keys")
    async def create_key(body: NewKey, request: Request) -> dict[str, object]:
        keys = store()
        caller = principal(request)
        owner = body.owner or caller.name
        if owner != caller.name and not caller.may(USERS_MANAGE):
            raise HTTPException(403, "keys for another user need users:manage")
        user = keys.get_user(owner)
        if user is None:
            raise HTTPException(404, f"no user {owner!r}")
        wanted = (
            list(user.permissions) if body.permissions is None else body.permissions
        )
        beyond = set(wanted) - set(caller.permissions)
        if beyond and not caller.may(ADMIN):
            raise HTTPException(
                403, f"a key cannot give what you lack: {sorted(beyond)}"
            )
        try:
            record, key = keys.create_key(owner, body.name, wanted)
        except ValueError as error:
            raise HTTPException(400, str(error)) from None
        return record.public() | {"api_key": key}

    @router.delete("/v1/admin/keys/{key_id}")
    async def revoke_key(key_id: str, request: Request) -> dict[str, object]:
        keys = store()
        caller = principal(request)
        mine = [key for key in keys.list_keys(caller.name) if key.key_id == key_id]
        if not mine and not caller.may(ADMIN):
            raise HTTPException(404, f"no key {key_id!r} of yours")
        record = keys.revoke_key(key_id)
        if record is None:
            raise HTTPException(404, f"no key {key_id!r}")
        return record.public()

    return router
