"""The worker half's asynchronous loads: posted without waiting, completions pushed.

``start_load_kv`` runs on the engine's thread, once per step, before the forward:
any wait there is a wait of every request in the batch. So an asynchronous load is
only posted to the background loop (``PostedLoads.post`` returns at once), where
one call on the transfer actor (``run_load``) starts it and answers when it ends.
Its outcome is pushed onto a local queue, which ``get_finished`` drains on the
engine's thread without any actor call: no polling round trip per step, and a load
is seen finished at the first step after it ended.

Nothing is lost: a load that could not be posted, that the actor refused, or whose
call failed or ran past its deadline ends as a completion with an error, which the
worker reports as failed blocks (vLLM recomputes them). A call that failed on our
side may have left the load running in the actor, so it is cancelled first (the
cancel returns once no write of it can land any more).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..aio import BackgroundLoop, with_deadline
from ..wire import LoadRequest, LoadResult

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class InFlightLoad:
    """A load the worker started and has not reported finished yet."""

    req_id: str
    dst_block_ids: tuple[int, ...]
    # vLLM waits for it before this step's forward, not in get_finished
    synchronous: bool = False
    cancel_posted: bool = False  # its request was aborted: cancel_load was sent
    # actor calls on this load's critical path: its start (and wait), and the
    # actor's own calls on the holder
    round_trips: int = 1
    # monotonic time start_load_kv took it up: the load's own time runs from here
    started_s: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class LoadCompletion:
    """How a posted load ended: its result, or the error that ended it here."""

    load_id: str
    outcome: str | LoadResult
    # the worker's calls on its actor for this load: run_load, and a cancel
    round_trips: int = 1
    # monotonic time the outcome was known on the loop (made right after the
    # actor answered): not when get_finished next drained it
    ended_s: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class EndedLoads:
    """Per request whose load ended since the scheduler half was last told,
    counted for benchmarks: the actor round trips on its critical path
    (req_id -> count), and the load's own time (req_id -> seconds from
    ``start_load_kv`` taking it up to its outcome: blocks landed and verified,
    or the error)."""

    round_trips: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def record(self, load: InFlightLoad, ended_s: float | None = None) -> None:
        self.round_trips[load.req_id] = load.round_trips
        end = time.monotonic() if ended_s is None else ended_s
        self.seconds[load.req_id] = end - load.started_s

    def take(self) -> EndedLoads:
        """Everything recorded so far; this object starts empty again."""
        taken = EndedLoads(self.round_trips, self.seconds)
        self.round_trips, self.seconds = {}, {}
        return taken


async def cancel_quietly(actor: Any, load_id: str, rpc_timeout_s: float) -> int:
    """Cancel a load on the actor (it returns once its writes are over); a failure
    is logged, not raised. Returns the round trips it cost (one)."""
    try:
        await with_deadline(actor.cancel_load(load_id), rpc_timeout_s)
    except Exception as exc:
        logger.error("Xavier: cancelling load %s failed: %r", load_id, exc)
    return 1


class PostedLoads:
    """Asynchronous loads running on the background loop, and their completions.

    ``post``, ``cancel_aborted`` and ``drain`` are called from the engine's
    thread; the loop only appends to the completion queue (a deque: appends and
    pops are atomic), so the two threads share nothing else.
    """

    def __init__(
        self, loop: BackgroundLoop, rpc_timeout_s: float, load_timeout_s: float
    ) -> None:
        self._loop = loop
        self._rpc_timeout_s = rpc_timeout_s
        self._load_timeout_s = load_timeout_s
        self._completions: collections.deque[LoadCompletion] = collections.deque()
        # ids of the loads posted and not drained yet
        self._running: set[str] = set()

    def post(self, actor: Any, req: LoadRequest) -> None:
        """Start ``req`` in the background; returns at once."""
        try:
            self._loop.submit(self._run(actor, req))
        except Exception as exc:  # the loop is closed: the load never starts
            self._completions.append(
                LoadCompletion(req.load_id, f"not started: {exc!r}", round_trips=0)
            )
            return
        self._running.add(req.load_id)

    def cancel_aborted(
        self,
        actor: Any,
        in_flight: Mapping[str, InFlightLoad],
        aborted: Container[str],
    ) -> None:
        """Ask the actor to stop the posted loads of aborted requests, once each;
        their completions come through the queue once their writes are over."""
        for load_id, load in in_flight.items():
            if load.req_id not in aborted or load.cancel_posted:
                continue
            if load_id not in self._running:
                continue  # synchronous, or its completion already came
            load.cancel_posted = True
            try:
                self._loop.submit(cancel_quietly(actor, load_id, self._rpc_timeout_s))
            except RuntimeError:
                pass  # the loop is closed: the load's own call ends it

    def drain(self) -> list[LoadCompletion]:
        """The completions pushed since the last call, oldest first."""
        done: list[LoadCompletion] = []
        while self._completions:
            completion = self._completions.popleft()
            self._running.discard(completion.load_id)
            done.append(completion)
        return done

    async def _run(self, actor: Any, req: LoadRequest) -> None:
        # The actor's own wait gives up at load_timeout_s and cancels the load;
        # this outer deadline only covers an actor that stopped answering.
        deadline = self._load_timeout_s + 2 * self._rpc_timeout_s
        outcome: str | LoadResult
        round_trips = 1
        try:
            outcome = await with_deadline(
                actor.run_load(req, self._load_timeout_s), deadline
            )
        except asyncio.CancelledError:
            # The loop is shutting down (the worker closed and cancelled its
            # loads first): report it all the same, for whoever drains.
            self._completions.append(
                LoadCompletion(req.load_id, "the worker shut down", round_trips)
            )
            raise
        except Exception as exc:
            # It may have started before the call failed: stop it before its
            # blocks are reported (and possibly reused).
            round_trips += await cancel_quietly(actor, req.load_id, self._rpc_timeout_s)
            outcome = f"run_load failed: {type(exc).__name__}: {exc}"
        self._completions.append(LoadCompletion(req.load_id, outcome, round_trips))
