"""Faults the connector contains so that the engine survives them.

vLLM calls the connector from its scheduler and its model runner; an exception that
escapes kills the engine core and every request on it. The facade catches what its
halves raise, falls back to what costs only a recomputation, and hands the fault to
``ConnectorFaults``: counted per method, logged with its traceback the first time
and then every ``LOG_EVERY``-th time (a fault that repeats every step must not
flood the log), and reported to the replica's transfer actor for the metrics.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

LOG_EVERY = 100


class ConnectorFaults:
    """Per-method fault counts of one connector half."""

    def __init__(self, owner: str, report: Callable[[str], None] | None = None) -> None:
        self._owner = owner  # e.g. "scheduler of replica 1", for the log
        self._report = report
        # method name -> faults contained there
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, where: str, exc: BaseException) -> None:
        """Count and log a fault contained in ``where`` (a connector method)."""
        self.counts[where] += 1
        count = self.counts[where]
        if count == 1 or count % LOG_EVERY == 0:
            logger.error(
                "Xavier %s: %s failed (%d so far); the engine goes on and the "
                "affected requests recompute their KV",
                self._owner,
                where,
                count,
                exc_info=exc,
            )
        if self._report is not None:
            try:
                self._report(where)
            except Exception as report_exc:  # counting must not fail the fallback
                logger.debug("Xavier: could not report a fault: %r", report_exc)

    def attempt(self, what: str, fallback: Callable[..., Any], *args: Any) -> bool:
        """Run a fallback; whether it succeeded. If it fails too, it is counted
        (as ``what``) and logged, and the caller falls back to its last resort."""
        try:
            fallback(*args)
            return True
        except Exception as exc:
            self.counts[what] += 1
            logger.critical(
                "Xavier %s: %s after a fault failed as well: %r",
                self._owner,
                what,
                exc,
                exc_info=exc,
            )
            return False
