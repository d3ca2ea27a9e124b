"""One log format for every process of a cluster, and how sub-processes get it.

The supervisor, worker and local commands configure the root logger with
``configure``; replica sub-pools get the same level and format from
``sub_pool_logging`` (xoscar applies it when it starts the sub-pool). vLLM's
engine-core processes are spawned by vLLM and configure only vLLM's loggers: the
Xavier connector gives ``xinference``'s loggers a handler there itself, at the
level the worker passes in ``LOG_LEVEL_ENV``.
"""

from __future__ import annotations

import logging
from typing import Any

from ..model.llm.vllm.xavier.config import LOG_FORMAT, LOG_LEVEL_ENV


def configure(level: str, fmt: str = LOG_FORMAT) -> None:
    logging.basicConfig(level=level.upper(), format=fmt)


def log_level_env() -> dict[str, str]:
    """``LOG_LEVEL_ENV`` for a replica's processes: this process's root level, or
    nothing when logging is not configured here."""
    root = logging.getLogger()
    if not root.handlers:
        return {}
    return {LOG_LEVEL_ENV: logging.getLevelName(root.level)}


def sub_pool_logging() -> dict[str, Any] | None:
    """This process's root log level, in ``LOG_FORMAT``, for a replica's sub-pool,
    so that what the replica logs at INFO (the transfer actor's UCX report, each
    NIXL peer's first READ) reaches the worker's log too; None when logging is not
    configured here."""
    root = logging.getLogger()
    if not root.handlers:
        return None
    return {
        "dict": {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"plain": {"format": LOG_FORMAT}},
            "handlers": {
                "console": {"class": "logging.StreamHandler", "formatter": "plain"}
            },
            "root": {
                "level": logging.getLevelName(root.level),
                "handlers": ["console"],
            },
        }
    }
