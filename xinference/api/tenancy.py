"""Whose cached KV a request may share: the cache salt it is served under.

A prefix cache shared by every user is a side channel: a prompt whose prefix
another user sent recently is served faster (its time to first token shows it),
so one tenant can test guesses about what another sent. Cross-replica sharing
makes the whole deployment one such cache. vLLM's answer is a per-request
``cache_salt`` (an OpenAI request field here too): requests under different salts
never share a block, in vLLM (it salts its first block's hash), in Xavier's
stores and index (``hashing.py``) or in the router's choice (``dispatch.py``).

With authentication on, the server salts every request by who sent it
(``--kv-sharing``): ``user`` (the default) lets only one user's requests share,
``key`` only one credential's (each API key apart, a user's logins together),
``all`` lets everyone share (the client's own salts still separate). The salt a
request is served under is then a digest of the sharing scope, the caller and the
client's salt: a caller can choose the last only, so no caller can produce
another's. With authentication off there is no caller, and a client's salt is
used as sent, as vLLM uses it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .auth.permissions import Principal
from .errors import InvalidRequest

KV_SHARING = ("user", "key", "all")
DEFAULT_KV_SHARING = "user"
OPTION = "--kv-sharing"
# vLLM's rule for a client's salt (its OpenAI server's validate_cache_salt, 0.32):
# characters its downstream cache backends use as separators are refused.
MAX_SALT_CHARS = 128
_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(salt: str | None) -> None:
    """Refuse a client's ``cache_salt`` that vLLM's own server would refuse
    (or that is not valid Unicode): a 400 naming it."""
    if salt is None:
        return
    bad = (
        not salt
        or len(salt) > MAX_SALT_CHARS
        or any(char in _FORBIDDEN for char in salt)
    )
    if bad:
        raise InvalidRequest(
            f"cache_salt must be 1 to {MAX_SALT_CHARS} characters without '@', "
            "'/', '\\' or NUL",
            "cache_salt",
        )
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            "cache_salt is not valid Unicode text (a lone surrogate)", "cache_salt"
        ) from None


class SaltPolicy:
    """The salt each request is served under, for the server's ``kv_sharing``."""

    def __init__(self, sharing: str = DEFAULT_KV_SHARING) -> None:
        if sharing not in KV_SHARING:
            raise ValueError(
                f"{OPTION} must be one of {', '.join(KV_SHARING)}, got {sharing!r}"
            )
        self.sharing = sharing

    def salt(self, principal: Principal | None, requested: str | None) -> str | None:
        """The salt for a request from ``principal`` (None: authentication is
        off) that asked for ``requested``."""
        check_cache_salt(requested)
        scope = self._scope(principal)
        if scope is None:
            return requested
        # one digest over an unambiguous encoding of (scope, caller, salt)
        material = json.dumps(["xinference-kv-sharing", *scope, requested or ""])
        return hashlib.sha256(material.encode()).hexdigest()

    def _scope(self, principal: Principal | None) -> tuple[str, str] | None:
        if principal is None or self.sharing == "all":
            return None
        if self.sharing == "key" and principal.key_id is not None:
            return "key", principal.key_id
        return "user", principal.name


def request_principal(request: Any) -> Principal | None:
    """The caller the authentication middleware named (None with it off)."""
    return getattr(request.state, "principal", None)
