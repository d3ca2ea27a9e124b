"""Login attempt limiting: after ``limit`` failures within ``window_s`` for one
username or from one client address, further attempts are refused until the
oldest failure leaves the window (a right password included: the point is that
guessing stops)."""

from __future__ import annotations

import time
from collections import deque

DEFAULT_LIMIT = 5
DEFAULT_WINDOW_S = 60.0


class LoginThrottle:
    def __init__(
        self, limit: int = DEFAULT_LIMIT, window_s: float = DEFAULT_WINDOW_S
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        # "user:<name>" or "addr:<host>" -> monotonic times of recent failures
        self._failures: dict[str, deque[float]] = {}

    def retry_after(self, keys: list[str], now: float | None = None) -> float:
        """Seconds until an attempt under ``keys`` is allowed (0: now)."""
        now = time.monotonic() if now is None else now
        wait = 0.0
        for key in keys:
            failures = self._recent(key, now)
            if len(failures) >= self.limit:
                wait = max(wait, failures[0] + self.window_s - now)
        return wait

    def failed(self, keys: list[str], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for key in keys:
            self._recent(key, now).append(now)

    def succeeded(self, keys: list[str]) -> None:
        for key in keys:
            self._failures.pop(key, None)

    def _recent(self, key: str, now: float) -> deque[float]:
        failures = self._failures.setdefault(key, deque())
        while failures and failures[0] <= now - self.window_s:
            failures.popleft()
        if not failures:  # keep the table from growing with one-off names
            self._failures.pop(key, None)
            failures = self._failures.setdefault(key, deque())
        return failures
