"""What the scheduler half hands the worker half each step, and what the facade
tells the scheduler half about the requests vLLM scheduled. Plain frozen data: it
crosses from vLLM's scheduler process to its worker process inside the connector
metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..wire import LoadRequest, StageItem


@dataclass(frozen=True, slots=True)
class RequestLoad:
    """One request's load for this step; ``load`` is None when it cannot start.

    ``failed_block_ids`` lists the blocks that vLLM counts as externally computed
    but that will not be written (reported as load errors by the worker).
    ``asynchronous``: vLLM was told the load is asynchronous (it waits for the
    request in ``get_finished``); otherwise it completes before this step's
    forward, within ``bound_s`` when that is set (the fast path, ``fast_path.py``).
    None: as the step's ``load_async`` says.
    """

    req_id: str
    load: LoadRequest | None
    failed_block_ids: tuple[int, ...] = ()
    asynchronous: bool | None = None
    bound_s: float | None = None

    def is_async(self, step_default: bool) -> bool:
        return step_default if self.asynchronous is None else self.asynchronous


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """Scheduler -> worker, once per step."""

    loads: tuple[RequestLoad, ...] = ()
    stage: tuple[StageItem, ...] = ()
    load_async: bool = False  # the deployment's default (GPU-first); see RequestLoad


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """What the facade tells about one request scheduled in this step.

    ``block_ids`` are the group-0 block ids vLLM handed over in this step's
    scheduler output: the whole block table when ``whole_table`` (a request
    scheduled for the first time, or resumed after preemption), otherwise only the
    blocks appended since the last step (possibly none).
    """

    req_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int
    block_ids: Sequence[int] = ()
    whole_table: bool = False
