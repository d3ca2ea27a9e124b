"""The Xavier and routing options of ``xinference launch``.

Kept apart from ``cmdline.py`` so that the command line stays one module per
concern; the option names are the REST launch body's keys with dashes (click
turns ``--xavier-fast-path`` into ``xavier_fast_path``), and every value is
checked by ``LaunchSpec.from_options`` on the server, as a REST launch is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from ..model.llm.vllm.xavier.config import DEFAULT_TRANSPORT, TRANSPORTS

Command = TypeVar("Command", bound=Callable[..., Any])

_OPTIONS = (
    click.option(
        "--enable-xavier", is_flag=True, help="share prefix KV between replicas"
    ),
    click.option(
        "--xavier-gpu-cache-bytes",
        default=None,
        help="GPU-first device budget: bytes or a size such as 256MiB (0: no budget)",
    ),
    click.option(
        "--xavier-transport",
        default=DEFAULT_TRANSPORT,
        show_default=True,
        type=click.Choice(list(TRANSPORTS)),
    ),
    click.option(
        "--xavier-cross-layer-blocks",
        is_flag=True,
        help="ask vLLM for one KV allocation where a block of every layer is "
        "contiguous",
    ),
    click.option(
        "--xavier-remote-loads/--no-xavier-remote-loads",
        default=True,
        show_default=True,
        help="off: replicas publish what they hold (for --router cache-aware) but "
        "never load KV from a peer (routing only)",
    ),
    click.option(
        "--xavier-fast-path/--no-xavier-fast-path",
        # None: neither given, the engine's $XAVIER_FAST_PATH decides
        default=None,
        help="load bounded remote hits synchronously, lease-free (default: "
        "$XAVIER_FAST_PATH in the engine's environment, else off)",
    ),
    click.option(
        "--router",
        default="round-robin",
        show_default=True,
        type=click.Choice(["round-robin", "cache-aware"]),
    ),
    click.option("--router-busy-margin", default=2, show_default=True, type=int),
)


def xavier_launch_options(command: Command) -> Command:
    """Add the Xavier and routing options to ``command``, in this order."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command
