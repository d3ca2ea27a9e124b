"""Whether a server authenticates: off on a loopback bind, on for any other bind,
on wherever asked (``--auth`` or ``XINFERENCE_AUTH_ADVANCED=true``); off on a
non-loopback bind only when the operator says so (``--no-auth`` or
``XINFERENCE_AUTH_ADVANCED=false``)."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .service import AuthService
from .store import auth_dir, read_or_create_secret

AUTH_ENV = "XINFERENCE_AUTH_ADVANCED"
CLUSTER_SECRET_ENV = "XINFERENCE_CLUSTER_SECRET"
CLUSTER_SECRET_FILE = "cluster.secret"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class InsecureBind(RuntimeError):
    """Serving on a reachable address without authentication, unasked."""


@dataclass(frozen=True, slots=True)
class AuthDecision:
    enabled: bool
    explicit: bool  # the operator chose (flag or environment), not the default
    reason: str


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(info[4][0]).is_loopback for info in infos
    )


def decide(
    host: str, flag: bool | None, environ: Mapping[str, str] | None = None
) -> AuthDecision:
    """Whether to authenticate on ``host``: the flag, else ``$XINFERENCE_AUTH_ADVANCED``,
    else by the bind address."""
    env = os.environ if environ is None else environ
    if flag is not None:
        return AuthDecision(flag, True, f"--{'' if flag else 'no-'}auth given")
    raw = env.get(AUTH_ENV, "").strip().lower()
    if raw in _TRUE:
        return AuthDecision(True, True, f"{AUTH_ENV}={raw}")
    if raw in _FALSE:
        return AuthDecision(False, True, f"{AUTH_ENV}={raw}")
    if raw:
        raise ValueError(f"{AUTH_ENV}={raw!r}: give true or false")
    if is_loopback(host):
        return AuthDecision(False, False, f"{host} is a loopback address")
    return AuthDecision(True, False, f"{host} is reachable from other hosts")


def check_bind(host: str, enabled: bool, explicit: bool) -> None:
    """Refuse to serve a reachable address without authentication unless the
    operator asked for exactly that."""
    if enabled or explicit or is_loopback(host):
        return
    raise InsecureBind(
        f"refusing to serve on {host} without authentication: anyone who can reach "
        "it could launch and terminate models and read every replica's statistics. "
        f"Turn authentication on (--auth, {AUTH_ENV}=true), bind 127.0.0.1, or say "
        f"--no-auth ({AUTH_ENV}=false) to serve it open on purpose."
    )


def service_for_bind(
    host: str,
    flag: bool | None,
    cluster_secret: str | None = None,
    home: Path | None = None,
) -> tuple[AuthService, AuthDecision]:
    """The server's authentication as ``decide`` has it, opened (store and
    secrets under ``$XINFERENCE_HOME/auth``). With authentication on and no
    cluster secret given, the cluster's is read from (or created once in)
    ``auth/cluster.secret``."""
    decision = decide(host, flag)
    if not decision.enabled:
        return AuthService.disabled(cluster_secret, chosen=decision.explicit), decision
    if cluster_secret is None:
        cluster_secret = read_or_create_secret(auth_dir(home) / CLUSTER_SECRET_FILE)
    return AuthService.open(home, cluster_secret=cluster_secret), decision
