"""The REST server's options on the command line of ``xinference-local`` and
``xinference-supervisor`` (``api/server_options.py`` has what each means), kept
apart from ``cmdline.py`` as the launch options are (``launch_options.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

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
)


def server_options(command: Command) -> Command:
    """Add the REST server's options to ``command``."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def options_from(max_request_bytes: str) -> ServerOptions:
    """The ``ServerOptions`` the command line gave (``server_options``' values; a
    usage error names a bad one)."""
    try:
        return ServerOptions(max_request_bytes=parse_size(max_request_bytes))
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint=OPTION) from None
