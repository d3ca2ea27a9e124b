"""Signed, expiring access tokens (JWT, HS256, via PyJWT).

A token names its user and when it expires; what the user may do is read from
the store on every request, so a deleted user's tokens stop working at once.
"""

from __future__ import annotations

import time

import jwt

ALGORITHM = "HS256"
DEFAULT_TTL_S = 1800.0  # upstream's default lifetime: 30 minutes


class TokenInvalid(ValueError):
    """Expired, tampered with or not ours; the message never quotes the token."""


class TokenSigner:
    def __init__(self, secret: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError("a token lifetime is positive")
        self._secret = secret
        self.ttl_s = ttl_s

    def issue(self, username: str, now: float | None = None) -> str:
        issued = time.time() if now is None else now
        claims = {"sub": username, "iat": int(issued), "exp": int(issued + self.ttl_s)}
        return jwt.encode(claims, self._secret, algorithm=ALGORITHM)

    def verify(self, token: str) -> str:
        """The username a valid token names."""
        try:
            claims = jwt.decode(
                token,
                self._secret,
                algorithms=[ALGORITHM],
                options={"require": ["sub", "exp", "iat"]},
            )
        except jwt.ExpiredSignatureError:
            raise TokenInvalid("the access token expired: log in again") from None
        except jwt.InvalidTokenError:
            raise TokenInvalid("the access token is not valid") from None
        return str(claims["sub"])


def looks_like_jwt(credential: str) -> bool:
    return credential.count(".") == 2
