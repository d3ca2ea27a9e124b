"""``Deployment``: the supervisor's private, mutable record of one launched model.

Shared by the supervisor (which launches and terminates), the worker registry
(a lost worker's replicas are gone) and the liveness monitor (which probes the
replicas): none of them imports another for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .launch_phases import launch_fraction
from .messages import DeploymentInfo, LaunchProgress, ReplicaInfo
from .options import LaunchSpec


@dataclass
class Deployment:
    """One model: its launch options, where each replica runs, and which serve."""

    spec: LaunchSpec
    started: float = field(default_factory=time.monotonic)
    created: float = field(default_factory=time.time)
    state: str = "launching"
    detail: str = "validating"
    phase: str = "validating"  # of launch_phases.LAUNCH_PHASES, while launching
    workers: dict[int, Any] = field(default_factory=dict)  # rank -> worker ref
    tracker: Any = None
    # worker address -> its tracker relay's address (tracker_relays.py)
    relays: dict[str, str] = field(default_factory=dict)
    addresses: dict[int, str] = field(default_factory=dict)  # rank -> sub-pool
    replicas: dict[int, ReplicaInfo] = field(default_factory=dict)  # rank -> loaded
    models: dict[int, Any] = field(default_factory=dict)  # rank -> model actor ref
    model_path: str = ""
    ucx: str = ""  # the UCX transports the replicas may use (placement's account)
    task: asyncio.Task[DeploymentInfo] | None = None  # the launch, while it runs
    # rank -> why it is gone for good (worker lost; engine or process died)
    gone: dict[int, str] = field(default_factory=dict)
    # rank -> why it gets no requests for now (missed its last health probe)
    unresponsive: dict[int, str] = field(default_factory=dict)
    monitor: asyncio.Task[None] | None = None  # replica liveness, while ready
    terminating_since: float | None = None  # when a terminate began (monotonic)

    def live_ranks(self, ranks: Iterable[int]) -> list[int]:
        return sorted(rank for rank in ranks if rank not in self.gone)

    def serving_ranks(self) -> list[int]:
        """Ranks that can answer now (not gone, not missing health probes)."""
        return [
            rank
            for rank in sorted(self.models)
            if rank not in self.gone and rank not in self.unresponsive
        ]

    def hash_namespace(self) -> str | None:
        """The replicas' common hash namespace; they must agree or routing by
        prefix would look up keys no replica registers."""
        names = {replica.hash_namespace for replica in self.replicas.values()}
        if len(names) > 1:
            raise RuntimeError(
                f"replicas disagree on the Xavier hash namespace: {names}"
            )
        return names.pop() if names else None

    def _counted_from(self, state: str) -> float:
        """Where ``elapsed_s`` counts from: the terminate while terminating
        (not the launch, minutes before), else the launch."""
        if state == "terminating" and self.terminating_since is not None:
            return self.terminating_since
        return self.started

    def listed_state(self) -> str:
        """The state as ``GET /v1/models`` lists it: a ready model with replicas
        gone or unresponsive is degraded (still serving on the others)."""
        if self.state == "ready" and (self.gone or self.unresponsive):
            return "degraded"
        return self.state

    def progress(self) -> LaunchProgress:
        state, detail = self.listed_state(), self.detail
        if state == "degraded":
            # Say which replicas do not serve and why.
            detail = "; ".join(
                [f"replica {r} gone: {why}" for r, why in sorted(self.gone.items())]
                + [
                    f"replica {r} unresponsive: {why}"
                    for r, why in sorted(self.unresponsive.items())
                ]
            )
        return LaunchProgress(
            model_uid=self.spec.model_uid,
            state=state,
            replicas_ready=len(self.live_ranks(self.replicas))
            - len([r for r in self.unresponsive if r not in self.gone]),
            replicas_total=self.spec.replica,
            detail=detail,
            elapsed_s=time.monotonic() - self._counted_from(state),
            fraction=(
                1.0
                if self.state == "ready"
                else launch_fraction(self.phase, len(self.replicas), self.spec.replica)
            ),
        )
