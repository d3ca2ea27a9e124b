"""What became of the loads the worker half started, until vLLM and the scheduler
half have been told.

The worker half starts loads three ways (a lease-free READ, a bounded or waited
synchronous call, a posted asynchronous one) and each can end in several places
(its reply, a deadline, a pushed completion, a fault before it started). Whichever
way, the end is recorded here, once, the same way: its failed blocks go to
``get_block_ids_with_load_errors`` (vLLM recomputes them), an asynchronous one's
request to ``get_finished`` (vLLM stops waiting for it), its counts to the
scheduler half (``EndedLoads``), and a lease-free load's stale locations to the
scheduler half too (``stale_loads.py``). Kept apart from ``worker.py`` so the
bookkeeping that must never lose a failed block is one small piece, not spread
over the code that talks to the actor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..wire import LoadResult
from .load_completions import EndedLoads, InFlightLoad
from .stale_loads import StaleLoad
from .step import StepMetadata

logger = logging.getLogger(__name__)


class LoadOutcomes:
    """The worker's loads in flight, and the outcomes of those that ended."""

    def __init__(self) -> None:
        # load_id -> load not yet reported finished
        self.in_flight: dict[str, InFlightLoad] = {}
        # requests whose load ended (or never started) but are not yet reported
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        # round trips and own time of the ended loads, until the scheduler is told
        self._ended = EndedLoads()
        # req_id -> its lease-free load's stale blocks, until the scheduler is told
        self._stale_loads: dict[str, StaleLoad] = {}

    def ended(
        self,
        load_id: str,
        outcome: str | LoadResult | StaleLoad | None,
        ended_s: float | None = None,
    ) -> None:
        """Record the end of a load: ``outcome`` is its result, its stale blocks
        (only those and the blocks after them fail), or the error that ended it
        here (None: it succeeded); ``ended_s`` when it ended (None: now)."""
        load = self.in_flight.pop(load_id, None)
        if load is None:
            return
        error, failed = outcome, load.dst_block_ids
        if isinstance(outcome, LoadResult):
            error = None if outcome.ok else outcome.error
            load.round_trips += outcome.round_trips
        elif isinstance(outcome, StaleLoad):
            error, failed = outcome.describe(), outcome.failed_blocks(failed)
            self._stale_loads[load.req_id] = outcome
        self._ended.record(load, ended_s)
        if error is not None:
            logger.warning(
                "Xavier: load %s of request %s failed, recomputing %d blocks: %s",
                load_id,
                load.req_id,
                len(failed),
                error,
            )
            self._load_errors.update(failed)
        if not load.synchronous:
            self._finished_recving.add(load.req_id)

    def fail(self, req_id: str, block_ids: Iterable[int], asynchronous: bool) -> None:
        """A load that never started: its blocks failed."""
        self._load_errors.update(block_ids)
        if asynchronous:  # vLLM waits for it in get_finished
            self._finished_recving.add(req_id)

    def fail_not_started(self, step: StepMetadata) -> None:
        """Fail every load of ``step`` that is not in flight; those that are stay
        there: their deadlines end them."""
        for item in step.loads:
            asynchronous = item.is_async(step.load_async)
            if item.load is None:
                self.fail(item.req_id, item.failed_block_ids, asynchronous)
            elif item.load.load_id not in self.in_flight:
                self.fail(item.req_id, item.load.dst_block_ids, asynchronous)

    def take_finished(self) -> set[str]:
        """The requests whose asynchronous load ended since the last call."""
        done, self._finished_recving = self._finished_recving, set()
        return done

    def take_ended(self) -> EndedLoads:
        """Per request whose load ended since the last call: the actor round
        trips on its critical path and the load's own time (counted)."""
        return self._ended.take()

    def take_stale(self) -> dict[str, StaleLoad]:
        """Per request whose lease-free load found stale locations since the
        last call: what the scheduler half must forget (``stale_loads.py``)."""
        stale, self._stale_loads = self._stale_loads, {}
        return stale

    def take_errors(self) -> set[int]:
        """The failed blocks since the last call, for vLLM to recompute."""
        errors, self._load_errors = self._load_errors, set()
        return errors
