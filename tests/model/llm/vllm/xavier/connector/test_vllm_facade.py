"""The facade against vLLM's own types, without an engine: what it reads from a
scheduler output and a cross-layer cache, and how it contains its halves' faults.

The real-engine tests (``test_real_engines.py``) run the same paths inside vLLM;
these pin down each fallback one call at a time.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
)
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from xinference.model.llm.vllm.xavier.connector.step import (  # noqa: E402
    RequestLoad,
    StepMetadata,
)
from xinference.model.llm.vllm.xavier.connector.vllm_compat import (  # noqa: E402
    cross_layer_views,
    scheduled_requests,
)
from xinference.model.llm.vllm.xavier.connector.vllm_facade import (  # noqa: E402
    XavierConnector,
    _log_where_the_engine_logs,
)
from xinference.model.llm.vllm.xavier.connector.vllm_metadata import (  # noqa: E402
    XavierConnectorMetadata,
    XavierWorkerMetadata,
)

from .test_vllm_compat import PLAIN, vllm_config


def output(new: list[Any], cached: CachedRequestData, scheduled: dict[str, int]) -> Any:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = new
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = scheduled
    return out


def new_request(req_id: str, block_ids: list[int], computed: int) -> Any:
    # NewRequestData has many more fields; the facade reads these three.
    return types.SimpleNamespace(
        req_id=req_id, block_ids=(block_ids,), num_computed_tokens=computed
    )


def test_scheduled_requests_take_block_ids_from_the_scheduler_output():
    cached = CachedRequestData.make_empty()
    cached.req_ids = ["running", "resumed", "decoding"]
    cached.resumed_req_ids = {"resumed"}
    cached.new_block_ids = [([7],), ([3, 4, 5],), None]
    cached.num_computed_tokens = [64, 32, 90]
    out = output(
        [new_request("fresh", [1, 2], 0)],
        cached,
        {"fresh": 40, "running": 16, "resumed": 50, "decoding": 1},
    )
    got = {r.req_id: r for r in scheduled_requests(out)}
    assert (got["fresh"].block_ids, got["fresh"].whole_table) == ([1, 2], True)
    assert got["fresh"].num_scheduled_tokens == 40
    assert (got["running"].block_ids, got["running"].whole_table) == ([7], False)
    assert (got["resumed"].block_ids, got["resumed"].whole_table) == ([3, 4, 5], True)
    assert (tuple(got["decoding"].block_ids), got["decoding"].whole_table) == (
        (),
        False,
    )
    assert got["running"].num_computed_tokens == 64


class NHDBackend:
    """A backend whose memory order puts blocks first, then layers (as FlashAttention
    does for vLLM's cross-layer cache)."""

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> Any:
        assert include_num_layers_dimension
        return (1, 0, 3, 2, 4)


def test_cross_layer_views_are_the_layers_in_their_logical_shape():
    blocks, layers, tokens, heads, width = 5, 3, 16, 2, 8
    physical = torch.randn(blocks, layers, tokens, heads, width)
    views = cross_layer_views(physical, NHDBackend)  # type: ignore[arg-type]
    assert len(views) == layers
    for layer, view in enumerate(views):
        assert view.shape == (blocks, heads, tokens, width)
        assert torch.equal(view, physical[:, layer].permute(0, 2, 1, 3))
    views[1][2, 0, 3].fill_(7.0)  # a view, not a copy
    assert torch.all(physical[2, 1, 3, 0] == 7.0)


def test_a_stride_order_that_does_not_fit_is_refused():
    class Wrong:
        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension: bool) -> Any:
            return (0, 1, 2)

    with pytest.raises(ValueError, match="does not fit"):
        cross_layer_views(torch.zeros(2, 2, 2, 2, 2), Wrong)  # type: ignore[arg-type]


# ---- contained faults ----------------------------------------------------------------


class Raising:
    """A connector half whose every method raises; ``fallbacks`` records the
    recovery calls the facade makes."""

    def __init__(self, **fallbacks: Any) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._fallbacks = fallbacks

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            if name in self._fallbacks:
                return self._fallbacks[name]
            raise RuntimeError(f"broken {name}")

        return call


@pytest.fixture
def scheduler_connector() -> Iterator[tuple[XavierConnector, Raising]]:
    connector = XavierConnector(vllm_config(), KVConnectorRole.SCHEDULER, PLAIN)
    failed = StepMetadata(loads=(RequestLoad("r", None, (4, 5)),))
    half = Raising(
        drop_reservation=None,
        abandon_load=None,
        fail_pending_loads=failed,
        close=None,
    )
    connector._scheduler = half  # type: ignore[assignment]
    try:
        yield connector, half
    finally:
        connector.shutdown()


def request(req_id: str = "r") -> Any:
    return types.SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(100)),
        all_token_ids=list(range(100)),
        skip_reading_prefix_cache=False,
        cache_salt=None,
    )


def blocks(*ids: int) -> Any:
    group = [types.SimpleNamespace(block_id=i, is_null=False) for i in ids]
    return types.SimpleNamespace(blocks=(group,))


def test_a_failed_lookup_is_a_miss_and_releases_its_reservation(scheduler_connector):
    connector, half = scheduler_connector
    assert connector.get_num_new_matched_tokens(request(), 0) == (0, False)
    assert ("drop_reservation", ("r",)) in half.calls
    assert connector._faults.counts["get_num_new_matched_tokens"] == 1


def test_a_failed_allocation_fails_the_promised_blocks(scheduler_connector):
    """vLLM already counts the external tokens (and may wait for them): the request's
    blocks must be reported failed so it recomputes and stops waiting."""
    connector, half = scheduler_connector
    connector.update_state_after_alloc(request(), blocks(4, 5, 6), 64)
    assert ("abandon_load", ("r", (4, 5, 6))) in half.calls
    half.calls.clear()
    connector.update_state_after_alloc(request(), blocks(4, 5, 6), 0)
    assert not any(name == "abandon_load" for name, _ in half.calls)


def test_a_failed_step_still_fails_its_pending_loads(scheduler_connector):
    connector, half = scheduler_connector
    meta = connector.build_connector_meta(
        output([], CachedRequestData.make_empty(), {})
    )
    assert meta.step.loads == (RequestLoad("r", None, (4, 5)),)
    assert ("fail_pending_loads", ()) in half.calls


def test_a_failed_finish_reports_nothing(scheduler_connector):
    connector, _ = scheduler_connector
    assert connector.request_finished(request(), [1]) == (False, None)


def test_a_request_finished_in_its_load_step_gets_its_workers_counts():
    """vLLM calls request_finished before update_connector_output in the same
    update_from_output: a one-token answer whose synchronous load ran in that
    step still reports the worker's round trips and the load's own time."""
    connector = XavierConnector(vllm_config(), KVConnectorRole.SCHEDULER, PLAIN)
    params = {"xavier_round_trips": 1, "xavier_load_ms": None}
    half = Raising(
        request_finished=params,
        record_load_round_trips=None,
        loads_stale=None,
        loads_failed=None,
        close=None,
    )
    connector._scheduler = half  # type: ignore[assignment]
    try:
        finished, sent = connector.request_finished(request(), [1])
        assert sent is params and not finished

        def report(round_trips: int, seconds: float) -> Any:
            meta = XavierWorkerMetadata(None, {"r": round_trips}, {"r": seconds})
            return KVConnectorOutput(kv_connector_worker_meta=meta)

        connector.update_connector_output(report(2, 0.004))
        assert params == {"xavier_round_trips": 1 + 2, "xavier_load_ms": 4.0}
        # completed once: a later report is not this request's
        connector.update_connector_output(report(5, 1.0))
        assert params == {"xavier_round_trips": 3, "xavier_load_ms": 4.0}
        assert connector._faults.total == 0
    finally:
        connector.shutdown()


def test_worker_faults_fail_the_step_loads_and_skip_staging():
    connector = XavierConnector(vllm_config(), KVConnectorRole.WORKER, PLAIN)
    half = Raising(fail_step_loads=None, close=None)
    connector._worker = half  # type: ignore[assignment]
    step = StepMetadata(loads=(RequestLoad("r", None, (1,)),))
    connector.bind_connector_metadata(XavierConnectorMetadata(step))
    try:
        connector.start_load_kv(None)  # type: ignore[arg-type]
        assert ("fail_step_loads", (step,)) in half.calls
        connector.wait_for_save()  # contained: nothing staged
        assert connector.get_finished({"r"}) == (None, None)
        connector.register_kv_caches({"model.layers.0.self_attn.attn": torch.zeros(1)})
        assert connector._faults.total == 4
    finally:
        connector.shutdown()


def test_fallbacks_that_fail_too_stay_in_the_connector():
    """The scheduler's fallbacks themselves raise (dropping the reservation,
    abandoning the load): nothing reaches vLLM, every fault is counted, and the
    blocks vLLM was promised are still reported failed in the next step, so the
    request recomputes them instead of using unwritten KV or waiting for a load
    that never comes. A worker whose step loads can be neither started nor
    failed stops the engine: no later step can safely tell vLLM about them."""
    connector = XavierConnector(vllm_config(), KVConnectorRole.SCHEDULER, PLAIN)
    half = Raising(close=None)  # every fallback raises as well
    connector._scheduler = half  # type: ignore[assignment]
    try:
        assert connector.get_num_new_matched_tokens(request(), 0) == (0, False)
        connector.update_state_after_alloc(request(), blocks(4, 5, 6), 64)
        assert ("abandon_load", ("r", (4, 5, 6))) in half.calls
        meta = connector.build_connector_meta(
            output([], CachedRequestData.make_empty(), {})
        )
        assert meta.step.loads == (RequestLoad("r", None, (4, 5, 6)),)
        # reported once: the next step carries nothing more
        meta = connector.build_connector_meta(
            output([], CachedRequestData.make_empty(), {})
        )
        assert meta.step.loads == ()
        assert connector.request_finished(request(), [1]) == (False, None)
        faults = connector._faults.counts
        assert faults["releasing a reservation"] == 1
        assert faults["abandoning a load"] == 1
        assert faults["build_connector_meta"] == 4  # the step and its fallback, twice
    finally:
        connector.shutdown()

    connector = XavierConnector(vllm_config(), KVConnectorRole.WORKER, PLAIN)
    worker = Raising(close=None)
    connector._worker = worker  # type: ignore[assignment]
    step = StepMetadata(loads=(RequestLoad("r", None, (1,)),))
    connector.bind_connector_metadata(XavierConnectorMetadata(step))
    try:
        with pytest.raises(RuntimeError, match="neither start nor fail"):
            connector.start_load_kv(None)  # type: ignore[arg-type]
        assert ("fail_step_loads", (step,)) in worker.calls
        assert connector._faults.counts["failing this step's loads"] == 1
    finally:
        connector.shutdown()


def test_in_an_unconfigured_process_xavier_logs_at_the_replicas_level(monkeypatch):
    """vLLM's engine core configures only vLLM's loggers; Xavier's INFO lines there
    (EngineTime's summary) must still reach the replica's log."""
    ours = logging.getLogger("xinference")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", ours.level)
    monkeypatch.setenv("XINFERENCE_LOG_LEVEL", "debug")
    _log_where_the_engine_logs()
    assert [type(h) for h in ours.handlers] == [logging.StreamHandler]
    assert ours.level == logging.DEBUG
    # a process that logs somewhere already is left alone
    _log_where_the_engine_logs()
    assert len(ours.handlers) == 1


def test_stale_loads_travel_to_the_scheduler_before_their_failed_blocks():
    """The worker's stale-load reports ride the step's worker metadata; the
    scheduler half gets them before the failed block ids of the same output,
    so it knows those failures are not the holder's (no backoff)."""
    from vllm.v1.outputs import KVConnectorOutput

    from xinference.model.llm.vllm.xavier.connector.load_completions import (
        EndedLoads,
    )
    from xinference.model.llm.vllm.xavier.connector.stale_loads import StaleLoad

    report = StaleLoad(1, 0, ((b"k" * 16, 2, 8),), 3)
    worker = XavierConnector(vllm_config(), KVConnectorRole.WORKER, PLAIN)
    worker_half = Raising(
        take_identity_report=None,
        take_ended_loads=EndedLoads(),
        take_stale_loads={"r": report},
        close=None,
    )
    worker._worker = worker_half  # type: ignore[assignment]
    scheduler = XavierConnector(vllm_config(), KVConnectorRole.SCHEDULER, PLAIN)
    scheduler_half = Raising(
        record_load_round_trips=None, loads_stale=None, loads_failed=None, close=None
    )
    scheduler._scheduler = scheduler_half  # type: ignore[assignment]
    try:
        meta = worker.build_connector_worker_meta()
        assert isinstance(meta, XavierWorkerMetadata)
        scheduler.update_connector_output(
            KVConnectorOutput(invalid_block_ids={5, 6}, kv_connector_worker_meta=meta)
        )
        assert [name for name, _ in scheduler_half.calls] == [
            "record_load_round_trips",
            "loads_stale",
            "loads_failed",
        ]
        assert scheduler_half.calls[1][1] == ({"r": report},)
        assert scheduler_half.calls[2][1] == ({5, 6},)
    finally:
        worker.shutdown()
        scheduler.shutdown()
