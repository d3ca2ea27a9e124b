"""The per-host tracker relays of a Xavier deployment: the worker creates one in
its pool, the replicas on it are given it as their tracker, and it goes with the
model. A real worker actor and tracker in a real xoscar pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import xoscar as xo

from xinference.core.deployment import Deployment
from xinference.core.tracker_relays import (
    RELAY_ENV,
    relays_enabled,
    replica_tracker,
    start_relays,
    stop_relays,
)
from xinference.core.worker import WorkerActor
from xinference.model.llm.vllm.xavier.change_log import pack_keys
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor, tracker_uid
from xinference.model.llm.vllm.xavier.tracker_relay import relay_uid

MODEL = "relay-model"
KEYS = hash_full_blocks(list(range(16 * 2)), 16, "relays-test")


def test_the_switch():
    assert relays_enabled({})
    assert not relays_enabled({RELAY_ENV: "0"})
    with pytest.raises(ValueError, match=RELAY_ENV):
        relays_enabled({RELAY_ENV: "off"})


async def test_replicas_of_a_worker_share_its_relay_until_the_model_goes():
    pool = await xo.create_actor_pool("127.0.0.1", n_process=0)
    async with pool:
        address = pool.external_address
        tracker = await xo.create_actor(
            BlockTrackerActor, address=address, uid=tracker_uid(MODEL)
        )
        worker = await xo.create_actor(
            WorkerActor, pool, gpus=[], address=address, uid=WorkerActor.default_uid()
        )
        record = Deployment(spec=SimpleNamespace(model_uid=MODEL))  # type: ignore
        record.workers = {0: worker, 1: worker}
        # without relays the replicas are given the tracker itself
        assert replica_tracker(record, 0, address) == (address, tracker_uid(MODEL))

        await start_relays(record, address)
        assert record.relays == {worker.address: address}  # one for both ranks
        given = replica_tracker(record, 1, address)
        assert given == (address, relay_uid(MODEL))
        relay = await xo.actor_ref(*given)
        await relay.register_replica(1, "nixl://b")
        await relay.update_blocks(1, b"", pack_keys(KEYS))
        assert await tracker.num_blocks(1) == 2
        assert (await relay.mirror_changes(0, -1, 0.0)).reset

        await stop_relays(record)
        assert record.relays == {}
        assert not await xo.has_actor(relay)
