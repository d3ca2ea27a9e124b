"""Login attempt limiting: at most ``limit`` failed logins within ``window_s`` for
one username and from one client address; once either is reached, further
attempts are refused until the oldest one leaves the window (a right password
included: the point is that guessing stops).

An attempt is counted when it is admitted, before its password is checked, and
in the same step as the check of the limit (nothing awaits in between). Checking
the limit first and counting the failure after the (slow, threaded) password
check would let a burst of concurrent guesses all pass the check before any of
them is counted. A right password then takes its own attempt back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_LIMIT = 5
DEFAULT_WINDOW_S = 60.0
# Past this many keys, the ones whose attempts all left the window are dropped
# (a key is otherwise pruned only when it is asked about again, and guesses at
# ever new names would fill the table).
SWEEP_ABOVE_KEYS = 10_000


@dataclass(frozen=True, slots=True)
class Attempt:
    """An admitted login attempt: the keys it was counted under, and when."""

    keys: tuple[str, ...]
    at: float


class LoginThrottle:
    def __init__(
        self,
        limit: int = DEFAULT_LIMIT,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock  # a test's own clock moves the window on
        # "user:<name>" or "addr:<host>" -> monotonic times of recent attempts
        # that failed or are still being checked
        self._failures: dict[str, deque[float]] = {}

    def admit(self, keys: list[str]) -> Attempt | float:
        """Count an attempt under every key and return it, or, when a key is at
        its limit, count nothing and return the seconds until one is allowed."""
        now = self._clock()
        if len(self._failures) > SWEEP_ABOVE_KEYS:
            for key in list(self._failures):
                self._recent(key, now)
        wait = 0.0
        for key in keys:
            failures = self._recent(key, now)
            if len(failures) >= self.limit:
                wait = max(wait, failures[0] + self.window_s - now)
        if wait > 0:
            return wait
        for key in keys:
            self._failures.setdefault(key, deque()).append(now)
        return Attempt(tuple(keys), now)

    def succeeded(self, attempt: Attempt, clear: list[str]) -> None:
        """``attempt`` had the right password: it was no failure. The keys in
        ``clear`` (the user's) forget their failures too; an address keeps the
        others, so that logging in to one's own account between guesses at
        other accounts does not reset the address's count."""
        for key in attempt.keys:
            failures = self._failures.get(key)
            if failures is not None:
                try:
                    failures.remove(attempt.at)
                except ValueError:  # already out of the window
                    pass
                if not failures:
                    del self._failures[key]
        for key in clear:
            self._failures.pop(key, None)

    def _recent(self, key: str, now: float) -> deque[float]:
        failures = self._failures.get(key)
        if failures is None:
            return deque()
        while failures and failures[0] <= now - self.window_s:
            failures.popleft()
        if not failures:  # keep the table from growing with one-off names
            del self._failures[key]
        return failures
