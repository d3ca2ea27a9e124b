"""Who may call which route: the permission names, the route table and the
short list of public routes (pure data and functions, no I/O).

The names are upstream Xinference's. ``admin`` implies every other permission.
A route missing from ``ROUTE_PERMISSIONS`` needs ``admin``: a route added later
is closed until someone decides who may call it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MODELS_LIST = "models:list"
MODELS_READ = "models:read"
MODELS_START = "models:start"
MODELS_STOP = "models:stop"
USERS_MANAGE = "users:manage"
KEYS_MANAGE = "keys:manage"
ADMIN = "admin"
# Held by nobody but the cluster's secret: asking where the supervisor's pool is.
CLUSTER_JOIN = "cluster:join"

PERMISSIONS = (
    MODELS_LIST,
    MODELS_READ,
    MODELS_START,
    MODELS_STOP,
    USERS_MANAGE,
    KEYS_MANAGE,
    ADMIN,
)

# Public without a credential: the auth probe, login, first-run setup, the page
# and its static files, and the liveness probe (a constant answer).
# (method, route path) -> None; "*" matches every method.
PUBLIC_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/v1/cluster/auth"),
        ("POST", "/token"),
        ("GET", "/v1/admin/setup/status"),
        ("POST", "/v1/admin/setup"),
        ("GET", "/"),
        ("*", "/web"),
        ("GET", "/status"),
    }
)

# (method, route path as declared) -> the permission it needs.
ROUTE_PERMISSIONS: dict[tuple[str, str], str] = {
    ("GET", "/v1/models"): MODELS_LIST,
    ("GET", "/v1/model_registrations/{model_type}"): MODELS_LIST,
    ("GET", "/v1/models/{model_uid}"): MODELS_READ,
    ("GET", "/v1/models/{model_uid}/progress"): MODELS_READ,
    ("GET", "/v1/models/{model_uid}/replicas"): MODELS_READ,
    ("GET", "/v1/models/{model_uid}/stats"): MODELS_READ,
    ("POST", "/v1/models/{model_uid}/prefix"): MODELS_READ,
    ("GET", "/v1/workers"): MODELS_READ,
    ("GET", "/metrics"): MODELS_READ,
    # generating reads a model, as upstream has it
    ("POST", "/v1/completions"): MODELS_READ,
    ("POST", "/v1/chat/completions"): MODELS_READ,
    ("POST", "/tokenize"): MODELS_READ,
    ("POST", "/detokenize"): MODELS_READ,
    ("POST", "/v1/models"): MODELS_START,
    ("POST", "/v1/models/{model_uid}/cancel"): MODELS_STOP,
    ("DELETE", "/v1/models/{model_uid}"): MODELS_STOP,
    ("GET", "/v1/address"): CLUSTER_JOIN,
    ("GET", "/v1/auth/me"): MODELS_LIST,
    ("GET", "/v1/admin/users"): USERS_MANAGE,
    ("POST", "/v1/admin/users"): USERS_MANAGE,
    ("DELETE", "/v1/admin/users/{username}"): USERS_MANAGE,
    ("GET", "/v1/admin/keys"): KEYS_MANAGE,
    ("POST", "/v1/admin/keys"): KEYS_MANAGE,
    ("DELETE", "/v1/admin/keys/{key_id}"): KEYS_MANAGE,
}


def is_public(method: str, path: str) -> bool:
    """Whether a route answers without a credential. HEAD is GET without the
    body: public where GET is."""
    method = "GET" if method == "HEAD" else method
    return (method, path) in PUBLIC_ROUTES or ("*", path) in PUBLIC_ROUTES


def required_permission(method: str, path: str) -> str:
    """The permission a route needs (``admin`` for one nobody listed). HEAD is
    answered as GET."""
    method = "GET" if method == "HEAD" else method
    return ROUTE_PERMISSIONS.get((method, path), ADMIN)


def check_permissions(names: Iterable[str]) -> tuple[str, ...]:
    """Validated, sorted permission names; ValueError names an unknown one."""
    names = tuple(sorted(set(names)))
    unknown = [name for name in names if name not in PERMISSIONS]
    if unknown:
        raise ValueError(
            f"unknown permission(s) {unknown}; known: {', '.join(PERMISSIONS)}"
        )
    return names


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from and what it may do."""

    name: str  # a username, or "cluster" for the cluster's secret
    permissions: frozenset[str]
    via: str  # "token", "key" or "cluster-secret"
    key_id: str | None = None  # the API key's public handle, when via a key

    def may(self, permission: str) -> bool:
        if permission == CLUSTER_JOIN:  # the pool address is for workers and admins
            return CLUSTER_JOIN in self.permissions or ADMIN in self.permissions
        return permission in self.permissions or ADMIN in self.permissions
