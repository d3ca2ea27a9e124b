"""What a tensor-parallel replica's scheduler half sees of its ranks' load reports.

Each worker half (one per engine rank) reports only its own failed blocks and
finished loads; the all-or-nothing rule across ranks rests on vLLM's
``KVOutputAggregator``, which these tests pin down (a vLLM that changed it would
fail here, not silently mix loaded and recomputed KV across ranks): the failed
blocks of all ranks are one union, so every rank recomputes them, and a request's
asynchronous load finishes only once every rank reported it.
"""

from __future__ import annotations

from copy import copy

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    KVOutputAggregator,
)
from vllm.v1.outputs import (  # noqa: E402
    EMPTY_MODEL_RUNNER_OUTPUT,
    KVConnectorOutput,
)

from xinference.model.llm.vllm.xavier.connector.vllm_metadata import (  # noqa: E402
    XavierWorkerMetadata,
)
from xinference.model.llm.vllm.xavier.wire import (  # noqa: E402
    KVGeometry,
    ReplicaIdentity,
)


def rank_output(**fields):
    output = copy(EMPTY_MODEL_RUNNER_OUTPUT)
    output.kv_connector_output = KVConnectorOutput(**fields)
    return output


def test_one_rank_s_failed_blocks_are_failed_for_every_rank():
    aggregator = KVOutputAggregator(expected_finished_count=2)
    merged = aggregator.aggregate(
        [rank_output(invalid_block_ids=set()), rank_output(invalid_block_ids={5, 6})]
    )
    assert merged.kv_connector_output.invalid_block_ids == {5, 6}


def test_a_load_finishes_only_when_every_rank_reported_it():
    aggregator = KVOutputAggregator(expected_finished_count=2)
    first = aggregator.aggregate([rank_output(finished_recving={"r1"}), rank_output()])
    assert not first.kv_connector_output.finished_recving
    second = aggregator.aggregate(
        [rank_output(), rank_output(finished_recving={"r1"}, invalid_block_ids={9})]
    )
    assert second.kv_connector_output.finished_recving == {"r1"}
    assert second.kv_connector_output.invalid_block_ids == {9}


def test_worker_metadata_of_the_ranks_is_merged():
    identity = ReplicaIdentity(
        "m", KVGeometry(2, 64, "bfloat16"), "packed_kv", tensor_parallel_size=2
    )
    aggregator = KVOutputAggregator(expected_finished_count=2)
    merged = aggregator.aggregate(
        [
            rank_output(
                kv_connector_worker_meta=XavierWorkerMetadata(
                    None, {"a": 2}, {"a": 0.5}
                )
            ),
            rank_output(
                kv_connector_worker_meta=XavierWorkerMetadata(
                    identity, {"a": 3}, {"a": 0.25}
                )
            ),
        ]
    )
    meta = merged.kv_connector_output.kv_connector_worker_meta
    assert isinstance(meta, XavierWorkerMetadata)
    assert meta.identity == identity and meta.round_trips == {"a": 3}
    # a request waited for its slowest rank's load
    assert meta.load_seconds == {"a": 0.5}


def test_stale_load_reports_of_the_ranks_are_merged():
    """A request's lease-free load found stale on two ranks fails from the
    earlier block on (vLLM recomputes from the first block any rank failed),
    and every stale location of both ranks is forgotten."""
    from xinference.model.llm.vllm.xavier.connector.stale_loads import StaleLoad

    one = StaleLoad(2, 0, ((b"k2", 4, 10),), 4)
    other = StaleLoad(1, 0, ((b"k1", 2, 8), (b"k2", 4, 10)), 4)
    aggregator = KVOutputAggregator(expected_finished_count=2)
    merged = aggregator.aggregate(
        [
            rank_output(
                kv_connector_worker_meta=XavierWorkerMetadata(
                    None, stale_loads={"r": one}
                )
            ),
            rank_output(
                kv_connector_worker_meta=XavierWorkerMetadata(
                    None, stale_loads={"r": other, "s": one}
                )
            ),
        ]
    )
    meta = merged.kv_connector_output.kv_connector_worker_meta
    assert meta.stale_loads["r"] == StaleLoad(1, 0, ((b"k2", 4, 10), (b"k1", 2, 8)), 4)
    assert meta.stale_loads["s"] == one
