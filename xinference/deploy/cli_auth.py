"""The command line's side of authentication: the servers' ``--auth/--no-auth``
and ``--cluster-secret``, ``xinference login``, the credential each client command
sends, and what a 401 or 403 means to the user.

``--api-key/-ak`` wins; otherwise the token ``xinference login`` kept for that
endpoint (in ``$XINFERENCE_HOME/auth/cli-tokens.json``, 0600) is sent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
import httpx

from ..api.auth.store import auth_dir
from ..client.restful_client import Client, XinferenceError

TOKENS_FILE = "cli-tokens.json"

# ---- servers: xinference-local, -supervisor and -worker ------------------------

auth_option = click.option(
    "--auth/--no-auth",
    default=None,
    help="authenticate API calls (default: $XINFERENCE_AUTH_ADVANCED, else off on "
    "a loopback --host and on for any other); --no-auth serves any host open",
)
cluster_secret_option = click.option(
    "--cluster-secret",
    envvar="XINFERENCE_CLUSTER_SECRET",
    show_envvar=True,
    default=None,
    help="the secret a worker shows to join (the supervisor's default with "
    "authentication on: $XINFERENCE_HOME/auth/cluster.secret, made once)",
)


def server_auth(host: str, auth: bool | None, cluster_secret: str | None) -> Any:
    """The server's AuthService, after saying which way it was decided."""
    from ..api.auth.settings import InsecureBind, check_bind, service_for_bind

    try:
        service, decision = service_for_bind(host, auth, cluster_secret)
        check_bind(host, service.enabled, service.chosen)
    except (InsecureBind, ValueError, OSError) as error:
        raise click.ClickException(str(error)) from None
    state = "on" if service.enabled else "OFF"
    click.echo(f"authentication {state} ({decision.reason})")
    if service.enabled and service.store is not None and not service.store.has_admin():
        click.echo(
            "no admin yet: create one on the web page or with POST /v1/admin/setup"
        )
    return service


# ---- clients: the credential each command sends ----------------------------------


def _tokens_path() -> Path:
    return auth_dir() / TOKENS_FILE


def _saved() -> dict[str, str]:
    """endpoint URL -> access token"""
    try:
        return dict(json.loads(_tokens_path().read_text()))
    except (FileNotFoundError, ValueError):
        return {}


def save_token(endpoint: str, token: str) -> Path:
    tokens = _saved() | {endpoint.rstrip("/"): token}
    path = _tokens_path()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        json.dump(tokens, file)
    return path


def credential(endpoint: str, api_key: str | None) -> str | None:
    """What the command sends as its bearer: the key, else a kept login token."""
    return api_key or _saved().get(endpoint.rstrip("/"))


def explain(error: XinferenceError, endpoint: str) -> str:
    """The server's refusal, with what to do about a 401 or 403."""
    if error.status_code == 401:
        return (
            f"{endpoint} needs authentication ({error.detail}): give --api-key, or "
            f"run `xinference login -e {endpoint} -u USERNAME`"
        )
    if error.status_code == 403:
        return f"not allowed on {endpoint}: {error.detail}"
    return error.detail


@click.command()
@click.option("--endpoint", "-e", default=None, help="server URL")
@click.option("--username", "-u", required=True)
@click.option(
    "--password",
    "-p",
    prompt=True,
    hide_input=True,
    help="asked for when not given (better than a command line others can read)",
)
@click.pass_context
def login(
    ctx: click.Context, endpoint: str | None, username: str, password: str
) -> None:
    """Log in; the other commands then send the token to this endpoint until it
    expires."""
    endpoint = (endpoint or ctx.obj or "http://127.0.0.1:9997").rstrip("/")
    try:
        with Client(endpoint) as client:
            token = client.login(username, password)
    except XinferenceError as error:
        if error.status_code == 429:
            raise click.ClickException(f"login refused: {error.detail}") from None
        raise click.ClickException(f"login failed: {error.detail}") from None
    except httpx.TransportError as error:
        raise click.ClickException(f"cannot reach {endpoint}: {error}") from None
    path = save_token(endpoint, token)
    click.echo(f"Logged in to {endpoint} as {username}; token kept in {path}")
