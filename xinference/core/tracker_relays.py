"""Per-host tracker relays of a Xavier deployment (``xavier/tracker_relay.py``).

The supervisor holds the model's block tracker; every worker that runs replicas
of the model gets a relay in its own pool, and its replicas are given the relay's
address and uid in place of the tracker's, so that the tracker serves one long
poll and one batched update stream per host instead of one per replica (issue 33,
benchmark/results/index-scale.md). ``XINFERENCE_XAVIER_TRACKER_RELAY=0`` at the
supervisor gives the replicas the tracker itself, as before relays.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import xoscar as xo

from ..model.llm.vllm.xavier.tracker import tracker_uid
from ..model.llm.vllm.xavier.tracker_relay import relay_uid
from .deployment import Deployment

logger = logging.getLogger(__name__)

RELAY_ENV = "XINFERENCE_XAVIER_TRACKER_RELAY"
RELAY_TIMEOUT_S = 30.0


def relays_enabled(env: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(RELAY_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{RELAY_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


async def start_relays(record: Deployment, tracker_address: str) -> None:
    """One relay on each worker of ``record`` (``record.relays``: worker address
    -> relay address), all of them following the model's tracker."""
    uid = record.spec.model_uid
    workers = {worker.address: worker for worker in record.workers.values()}
    for address, worker in workers.items():
        record.relays[address] = await xo.wait_for(
            worker.start_tracker_relay(uid, tracker_address, tracker_uid(uid)),
            RELAY_TIMEOUT_S,
        )


def replica_tracker(
    record: Deployment, rank: int, tracker_address: str
) -> tuple[str, str]:
    """(address, uid) replica ``rank`` knows as its tracker: its host's relay, or
    the tracker where there is none."""
    uid = record.spec.model_uid
    relay = record.relays.get(record.workers[rank].address)
    return (
        (tracker_address, tracker_uid(uid))
        if relay is None
        else (relay, relay_uid(uid))
    )


async def stop_relays(record: Deployment) -> None:
    """Destroy the relays (after the replicas left the tracker through them). A
    relay whose worker is gone went with it: logged, not an error."""
    uid = record.spec.model_uid
    workers = {worker.address: worker for worker in record.workers.values()}
    for address in list(record.relays):
        try:
            await xo.wait_for(workers[address].stop_tracker_relay(uid), RELAY_TIMEOUT_S)
        except Exception as error:
            logger.warning("%s: the tracker relay on %s: %r", uid, address, error)
        record.relays.pop(address, None)
