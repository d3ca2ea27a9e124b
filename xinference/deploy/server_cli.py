"""The REST server's options on the command line of ``xinference-local`` and
``xinference-supervisor`` (``api/server_options.py`` has what each means), kept
apart from ``cmdline.py`` as the launch options are (``launch_options.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..api import tenancy
from ..api.body_limit import DEFAULT_MAX_REQUEST_SIZE, OPTION
from ..api.server_options import ServerOptions
from ..model.llm.vllm.xavier.config import parse_size

Command = TypeVar("Command", bound=Callable[..., Any])

_OPTIONS = (
    click.option(
        OPTION,
        "max_request_bytes",
        default=DEFAULT_MAX_REQUEST_SIZE,
        show_default=True,
        help="the largest request body read, in bytes or a size such as 64MiB; "
        "a larger one is answered 413",
    ),
    click.option(
        tenancy.OPTION,
        "kv_sharing",
        type=click.Choice(tenancy.KV_SHARING),
        default=None,
        help="with authentication on, whose requests share cached KV: one "
        "user's (default), one API key's, or all (then only the requests' own "
        "cache_salt separates them)",
    ),
)


def server_options(command: Command) -> Command:
    """Add the REST server's options to ``command``."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def options_from(
    max_request_bytes: str, kv_sharing: str | None, *, auth_enabled: bool
) -> ServerOptions:
    """The ``ServerOptions`` the command line gave (``server_options``' values; a
    usage error names a bad one). Sharing per user or key needs users."""
    try:
        size = parse_size(max_request_bytes)
        if size <= 0:
            raise ValueError(f"must be positive, got {max_request_bytes!r}")
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint=OPTION) from None
    if kv_sharing in ("user", "key") and not auth_enabled:
        raise click.UsageError(
            f"{tenancy.OPTION} {kv_sharing} needs authentication on (--auth): "
            "without it, requests have no user or key to be told apart by"
        )
    return ServerOptions(
        max_request_bytes=size,
        kv_sharing=kv_sharing or tenancy.DEFAULT_KV_SHARING,
    )


def describe(options: ServerOptions, auth_enabled: bool) -> str:
    """One line for the server's start: how cached KV is shared."""
    if not auth_enabled:
        return (
            "KV cache: shared by every request (authentication off), apart "
            "from requests' own cache_salt"
        )
    scope = {"user": "each user's requests", "key": "each API key's requests"}
    return (
        f"KV cache: shared among {scope.get(options.kv_sharing, 'all requests')} "
        f"({tenancy.OPTION} {options.kv_sharing})"
    )


def server_options_from(service: Any, given: dict[str, Any]) -> ServerOptions:
    """The options for a server whose authentication is ``service``, said."""
    options = options_from(**given, auth_enabled=service.enabled)
    click.echo(describe(options, service.enabled))
    return options
