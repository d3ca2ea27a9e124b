"""The two objects vLLM carries between the connector's halves each step.

``XavierConnectorMetadata`` goes scheduler -> workers: the step's plan
(``step.py``). ``XavierWorkerMetadata`` comes back workers -> scheduler: what the
worker half learned that the scheduler half must know (the replica identity,
the ended loads' counts, the lease-free loads that found stale locations). vLLM
merges the workers' reports across tensor-parallel ranks (``aggregate``) and
hands the result to the scheduler's connector; how each part is built, merged and
handed on is kept here, together, so a new field touches one module, not three
places of the facade. Only the base classes come from vLLM.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..wire import ReplicaIdentity
from .ranks import merge_round_trips
from .scheduler import SchedulerSide
from .stale_loads import StaleLoad, merge_stale_loads
from .step import StepMetadata
from .vllm_compat import FinishedParams
from .worker import WorkerSide


class XavierConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler -> workers."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


class XavierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the replica identity, once the caches are mapped; of
    the loads that ended, the actor round trips (req_id -> count) and their own
    time (req_id -> seconds); and the lease-free loads that found stale
    locations (req_id -> ``StaleLoad``)."""

    def __init__(
        self,
        identity: ReplicaIdentity | None,
        round_trips: dict[str, int] | None = None,
        load_seconds: dict[str, float] | None = None,
        stale_loads: dict[str, StaleLoad] | None = None,
    ) -> None:
        self.identity = identity
        self.round_trips = round_trips or {}
        self.load_seconds = load_seconds or {}
        self.stale_loads = stale_loads or {}

    @classmethod
    def taken_from(cls, worker: WorkerSide) -> XavierWorkerMetadata | None:
        """What ``worker`` has to report since the last step (None: nothing)."""
        identity = worker.take_identity_report()
        ended = worker.take_ended_loads()
        stale_loads = worker.take_stale_loads()
        if identity is None and not ended.round_trips and not stale_loads:
            return None
        return cls(identity, ended.round_trips, ended.seconds, stale_loads)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Tensor-parallel ranks: the identity any rank reported (every rank's
        shard has the same geometry), each load's largest round-trip count."""
        if not isinstance(other, XavierWorkerMetadata):
            return self
        return XavierWorkerMetadata(
            self.identity or other.identity,
            merge_round_trips(self.round_trips, other.round_trips),
            merge_round_trips(self.load_seconds, other.load_seconds),
            merge_stale_loads(self.stale_loads, other.stale_loads),
        )

    def deliver(
        self,
        scheduler: SchedulerSide,
        finished_params: FinishedParams,
        invalid_block_ids: set[int],
    ) -> None:
        """Hand the report, and the blocks vLLM was told failed, to the scheduler."""
        if self.identity is not None:
            scheduler.set_identity(self.identity)
        scheduler.record_load_round_trips(self.round_trips, self.load_seconds)
        finished_params.complete(self.round_trips, self.load_seconds)
        # before the failed blocks: a stale load's holder is not at fault
        scheduler.loads_stale(self.stale_loads)
        scheduler.loads_failed(invalid_block_ids)
