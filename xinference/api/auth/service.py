"""Who is calling: a bearer credential (access token, API key or the cluster's
secret) turned into a ``Principal``, and logins (throttled) turned into tokens."""

from __future__ import annotations

import asyncio
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from .permissions import ADMIN, CLUSTER_JOIN, Principal
from .store import AuthStore, auth_dir, read_or_create_secret
from .throttle import Attempt, LoginThrottle
from .tokens import DEFAULT_TTL_S, TokenInvalid, TokenSigner, looks_like_jwt

TOKEN_TTL_ENV = "XINFERENCE_AUTH_TOKEN_TTL_S"


class Unauthorized(Exception):
    """401: no credential, or one that is not (or no longer) valid."""


class Forbidden(Exception):
    """403: a valid credential without the permission the route needs."""


class Throttled(Exception):
    """429: too many failed logins; ``retry_after_s`` says for how long."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"too many failed logins: try again in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


@dataclass
class AuthService:
    """The server's authentication; ``enabled`` False lets every request through."""

    enabled: bool
    store: AuthStore | None = None
    signer: TokenSigner | None = None
    throttle: LoginThrottle | None = None
    cluster_secret: str | None = None
    # off because the operator said so (``--no-auth``): then even a reachable
    # bind serves (``settings.check_bind``)
    chosen: bool = False

    @classmethod
    def disabled(
        cls, cluster_secret: str | None = None, chosen: bool = False
    ) -> AuthService:
        return cls(enabled=False, cluster_secret=cluster_secret, chosen=chosen)

    @classmethod
    def open(
        cls,
        home: Path | None = None,
        *,
        ttl_s: float | None = None,
        cluster_secret: str | None = None,
        throttle: LoginThrottle | None = None,
    ) -> AuthService:
        """Authentication on, with the store and signing secret under
        ``home/auth`` (``$XINFERENCE_HOME`` by default), created on first use."""
        directory = auth_dir(home)
        if ttl_s is None:
            ttl_s = float(os.environ.get(TOKEN_TTL_ENV, DEFAULT_TTL_S))
        return cls(
            enabled=True,
            store=AuthStore(directory),
            signer=TokenSigner(
                read_or_create_secret(directory / "token.secret"), ttl_s
            ),
            throttle=throttle or LoginThrottle(),
            cluster_secret=cluster_secret,
        )

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    # ---- requests -----------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller named by an ``Authorization: Bearer ...`` header value."""
        assert self.store is not None and self.signer is not None
        if not authorization:
            raise Unauthorized("authentication required: send Authorization: Bearer")
        scheme, _, credential = authorization.partition(" ")
        credential = credential.strip()
        if scheme.lower() != "bearer" or not credential:
            raise Unauthorized("authentication required: send Authorization: Bearer")
        if self.cluster_secret is not None and hmac.compare_digest(
            credential.encode(), self.cluster_secret.encode()
        ):
            return Principal("cluster", frozenset({CLUSTER_JOIN}), "cluster-secret")
        if looks_like_jwt(credential):
            try:
                username = self.signer.verify(credential)
            except TokenInvalid as error:
                raise Unauthorized(str(error)) from None
            user = self.store.get_user(username)
            if user is None:
                raise Unauthorized("the access token's user no longer exists")
            return Principal(user.username, frozenset(user.permissions), "token")
        key = self.store.find_key(credential)
        if key is None:
            raise Unauthorized("the API key is not valid (unknown or revoked)")
        owner = self.store.get_user(key.owner)
        if owner is None:
            raise Unauthorized("the API key's owner no longer exists")
        # a key never does more than its owner may (now, not when it was made)
        allowed = set(key.permissions)
        if ADMIN not in owner.permissions:
            allowed &= set(owner.permissions)
        return Principal(owner.username, frozenset(allowed), "key", key.key_id)

    def authorize(self, principal: Principal, permission: str) -> None:
        if not principal.may(permission):
            raise Forbidden(
                f"{principal.name!r} lacks the permission {permission!r} "
                "this route needs"
            )

    # ---- logins -------------------------------------------------------------------

    async def login(self, username: str, password: str, client_host: str) -> str:
        """An access token for a right password; Unauthorized or Throttled."""
        assert self.store is not None and self.signer is not None
        assert self.throttle is not None
        user_key = f"user:{username}"
        # counted before the password is checked (``throttle.py`` says why)
        attempt = self.throttle.admit([user_key, f"addr:{client_host}"])
        if not isinstance(attempt, Attempt):
            raise Throttled(attempt)
        user = await asyncio.to_thread(self.store.verify_password, username, password)
        if user is None:
            raise Unauthorized("wrong username or password")
        self.throttle.succeeded(attempt, clear=[user_key])
        return self.signer.issue(user.username)
