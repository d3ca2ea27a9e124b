"""Where the connector spends the engine's thread: seconds and calls per method.

Every method vLLM calls runs on its scheduler thread or its model runner's thread,
between or around forwards, so what Xavier costs an engine that shares no prefix is
the sum of these. ``EngineTime`` adds them up (two clock reads per call) and logs the
totals every ``LOG_EVERY_S`` seconds of wall time and at shutdown, for profiling a
deployment from its logs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

LOG_EVERY_S = 60.0

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(slots=True)
class _Account:
    calls: int = 0
    seconds: float = 0.0


class EngineTime:
    """Seconds and calls per connector method, for one connector half."""

    def __init__(self, owner: str, clock: Callable[[], float] = time.perf_counter):
        self._owner = owner  # e.g. "worker of replica 1", for the log
        self._clock = clock
        self._accounts: dict[str, _Account] = {}
        self._started = clock()
        self._last_log = self._started

    def add(self, method: str, seconds: float) -> None:
        account = self._accounts.get(method)
        if account is None:
            account = self._accounts[method] = _Account()
        account.calls += 1
        account.seconds += seconds
        now = self._clock()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            self.log()

    def seconds(self) -> float:
        """Seconds spent in every method so far (read from any thread: a sum of
        floats the engine's thread only ever adds to)."""
        return sum(account.seconds for account in list(self._accounts.values()))

    def totals(self) -> dict[str, tuple[int, float]]:
        """method -> (calls, seconds), the busiest first."""
        ordered = sorted(self._accounts.items(), key=lambda item: -item[1].seconds)
        return {name: (a.calls, a.seconds) for name, a in ordered}

    def summary(self) -> str:
        wall = self._clock() - self._started
        spent = sum(a.seconds for a in self._accounts.values())
        parts = [
            f"{name} {calls} calls {seconds:.3f} s ({seconds / calls * 1e6:.0f} us each)"
            for name, (calls, seconds) in self.totals().items()
        ]
        return (
            f"Xavier {self._owner}: {spent:.3f} s of {wall:.1f} s on the engine's "
            f"thread ({spent / wall:.2%}): " + "; ".join(parts)
            if wall > 0
            else f"Xavier {self._owner}: nothing measured yet"
        )

    def log(self) -> None:
        if self._accounts:
            logger.info("%s", self.summary())


def timed(method: F) -> F:
    """Count a connector method's time in its instance's ``_engine_time``."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._engine_time.add(method.__name__, time.perf_counter() - started)

    return wrapper  # type: ignore[return-value]
