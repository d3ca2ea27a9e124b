"""Worker liveness: workers beat, the supervisor declares the silent ones gone.

Each worker calls the supervisor's ``worker_heartbeat`` every ``interval_s``
(``beat_forever``); a worker the supervisor has not heard from for ``timeout_s`` is
gone (``watch_workers`` finds it and hands it to the supervisor, which marks its
replicas gone). A heartbeat answered ``False`` means the supervisor does not know
the worker (it restarted, or declared the worker gone during a network cut): the
worker registers again and can take new replicas.

The bound: a worker that dies or is cut off is declared gone between ``timeout_s``
and ``timeout_s + interval_s`` after its last heartbeat arrived (the watch checks
once per interval). If the supervisor's own event loop stalls (a long blocking
call), the silence is its own, not the workers': a check that runs late by more
than half the timeout restarts every worker's clock instead of expiring them.

Both numbers are settings: ``XINFERENCE_HEARTBEAT_INTERVAL_S`` (default 1) and
``XINFERENCE_HEARTBEAT_TIMEOUT_S`` (default 5), or the supervisor's and worker's
command-line flags.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

INTERVAL_ENV = "XINFERENCE_HEARTBEAT_INTERVAL_S"
TIMEOUT_ENV = "XINFERENCE_HEARTBEAT_TIMEOUT_S"
DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class HeartbeatSettings:
    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"heartbeat interval must be > 0, got {self.interval_s}")
        if not self.timeout_s > self.interval_s:
            raise ValueError(
                f"heartbeat timeout ({self.timeout_s} s) must exceed the interval "
                f"({self.interval_s} s)"
            )

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        interval_s: float | None = None,
        timeout_s: float | None = None,
    ) -> HeartbeatSettings:
        """Explicit values first, then the environment, then the defaults."""
        env = os.environ if env is None else env
        return cls(
            interval_s=(
                interval_s
                if interval_s is not None
                else float(env.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
            ),
            timeout_s=(
                timeout_s
                if timeout_s is not None
                else float(env.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
            ),
        )

    def describe(self) -> str:
        return (
            f"heartbeat every {self.interval_s:g} s, a worker is gone after "
            f"{self.timeout_s:g} s without one"
        )


class WorkerLiveness:
    """When each monitored worker was last heard from (the supervisor's side).

    Pure bookkeeping with the clock passed in, so the rules are testable without
    waiting. Addresses not monitored (the worker sharing the supervisor's process)
    never expire.
    """

    def __init__(self, settings: HeartbeatSettings) -> None:
        self.settings = settings
        self._last: dict[str, float] = {}

    def register(self, address: str, now: float) -> None:
        self._last[address] = now

    def forget(self, address: str) -> None:
        self._last.pop(address, None)

    def beat(self, address: str, now: float) -> bool:
        """Record a heartbeat; False when the worker is not (or no longer) known."""
        if address not in self._last:
            return False
        self._last[address] = now
        return True

    def knows(self, address: str) -> bool:
        return address in self._last

    def silent_for(self, address: str, now: float) -> float | None:
        last = self._last.get(address)
        return None if last is None else now - last

    def restart_clocks(self, now: float) -> None:
        for address in self._last:
            self._last[address] = now

    def expire(self, now: float) -> list[str]:
        """The workers silent for longer than the timeout; they are forgotten."""
        gone = [
            address
            for address, last in self._last.items()
            if now - last > self.settings.timeout_s
        ]
        for address in gone:
            del self._last[address]
        return gone


async def watch_workers(
    liveness: WorkerLiveness,
    on_gone: Callable[[str, str], Awaitable[None]],
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Check ``liveness`` once per interval until cancelled; ``on_gone(address,
    reason)`` for each worker found silent."""
    settings = liveness.settings
    expected = clock() + settings.interval_s
    while True:
        await asyncio.sleep(settings.interval_s)
        now = clock()
        late = now - expected
        expected = now + settings.interval_s
        if late > settings.timeout_s / 2:
            logger.warning(
                "the supervisor's event loop stalled for %.1f s; not counting that "
                "against the workers",
                late,
            )
            liveness.restart_clocks(now)
            continue
        for address in liveness.expire(now):
            reason = (
                f"worker {address} sent no heartbeat for more than "
                f"{settings.timeout_s:g} s"
            )
            try:
                await on_gone(address, reason)
            except Exception:  # the watch must go on for the other workers
                logger.exception("handling the loss of worker %s failed", address)


async def beat_forever(
    beat: Callable[[], Awaitable[bool]],
    register: Callable[[], Awaitable[None]],
    settings: HeartbeatSettings,
    name: str,
) -> None:
    """The worker's side: ``beat()`` every interval (a beat the supervisor is slow
    to answer may take up to the timeout: it still counts when it arrives);
    ``register()`` again when the supervisor answers that it does not know us.
    Failures are logged when they start and when they end, not each time.
    """
    failing: str | None = None
    while True:
        started = time.monotonic()
        try:
            known = await asyncio.wait_for(beat(), settings.timeout_s)
            if not known:
                logger.warning(
                    "%s: the supervisor does not know this worker; registering again",
                    name,
                )
                await asyncio.wait_for(register(), settings.timeout_s)
                logger.info("%s: registered again", name)
            if failing is not None:
                logger.info("%s: heartbeats reach the supervisor again", name)
                failing = None
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if failing is None:
                logger.warning("%s: heartbeat failed: %r (retrying)", name, error)
            failing = repr(error)
        elapsed = time.monotonic() - started
        await asyncio.sleep(max(settings.interval_s - elapsed, 0.0))
