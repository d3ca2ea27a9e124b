"""A lease asked of a holder and not answered yet, between two threads.

The scheduler half asks a holder for a lease on vLLM's scheduler thread, but the
call runs on the connector's background loop; when the answer is slow the
scheduler stops waiting and tells vLLM to ask again later, so the request (or the
scheduler) may give the reservation up before the answer comes. Then exactly one
side must release whatever the holder granted: the loop, if the scheduler had
given up before the answer came; otherwise the scheduler, which sees the answer.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

from ..hashing import BlockHash
from ..wire import LeaseGrant, PrefixHit


@dataclass(eq=False)
class PendingReservation:
    """One reservation in flight: whom it asks, for what, and who lets go of it."""

    hit: PrefixHit
    lease_id: str
    wanted: list[BlockHash]
    first_block: int  # the request's prompt block index of wanted[0]
    future: concurrent.futures.Future[LeaseGrant] | None = None
    started: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _abandoned: bool = False
    _answered: bool = False

    def answered(self) -> bool:
        """The loop's side, once the holder answered or its deadline passed:
        whether the scheduler still wants the answer. False: it gave the
        reservation up first, and the loop must release the lease itself."""
        with self._lock:
            self._answered = True
            return not self._abandoned

    def abandon(self) -> bool:
        """The scheduler's side, giving the reservation up: whether the answer
        had come already. True: the loop left the lease to the scheduler, which
        must release it; False: the loop will."""
        with self._lock:
            self._abandoned = True
            return self._answered

    def done(self) -> bool:
        return self.future is not None and self.future.done()
