"""The supervisor's liveness monitor against test-double replicas and worker.

The replicas and the worker are small actors with the methods the monitor calls;
the block tracker is the real one, so "the tracker forgets a dead replica" is
checked on what it answers afterwards.
"""

import asyncio
import time

import pytest
import xoscar as xo

from xinference.core.deployment import Deployment
from xinference.core.liveness import LivenessMonitor
from xinference.core.messages import ReplicaInfo
from xinference.core.options import LaunchSpec
from xinference.core.supervisor import SupervisorActor
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor

# The replicas that answer do so in milliseconds; the deadline is long enough
# that a loaded 2-core CI machine (engine processes of earlier tests still
# exiting) does not make them miss it, which once failed CI with 0.5 s.
PROBE_S = 2.0


class FakeReplica(xo.StatelessActor):
    """``health`` answers what the test set: None, a reason, or nothing (hangs)."""

    def __init__(self):
        super().__init__()
        self.answer = None
        self.hang = False

    async def set(self, answer=None, hang=False):
        self.answer, self.hang = answer, hang

    async def health(self):
        if self.hang:
            await asyncio.sleep(3600)
        return self.answer


class FakeWorker(xo.StatelessActor):
    def __init__(self):
        super().__init__()
        self.exited = {}  # address -> reason
        self.removed = []

    async def set_exited(self, address, reason):
        self.exited[address] = reason

    async def replica_health(self, addresses):
        return {address: self.exited.get(address) for address in addresses}

    async def remove_replica(self, address):
        self.removed.append(address)
        return []

    async def removed_addresses(self):
        return list(self.removed)


@pytest.fixture
async def pool():
    pool = await xo.create_actor_pool("127.0.0.1", n_process=0)
    try:
        yield pool
    finally:
        await pool.stop()


async def deployment(pool, tmp_path, num_replicas=3):
    address = pool.external_address
    spec = LaunchSpec.from_options(
        model_path=str(tmp_path), replica=num_replicas, enable_xavier=True
    )
    record = Deployment(spec)
    record.state = "ready"
    worker = await xo.create_actor(FakeWorker, address=address, uid="worker")
    record.workers = {rank: worker for rank in range(num_replicas)}
    record.tracker = await xo.create_actor(
        BlockTrackerActor, address=address, uid="tracker"
    )
    for rank in range(num_replicas):
        record.addresses[rank] = f"sub-pool-{rank}"
        record.models[rank] = await xo.create_actor(
            FakeReplica, address=address, uid=f"replica-{rank}"
        )
        record.replicas[rank] = ReplicaInfo(
            rank, address, f"replica-{rank}", 0, 100, 4, 0.0
        )
        await record.tracker.register_replica(rank, address)
    return record


def monitor(record):
    supervisor = SupervisorActor()
    return LivenessMonitor(
        record,
        supervisor._mark_replicas_gone,
        interval_s=0.05,
        probe_s=PROBE_S,
    )


async def test_a_dead_engine_and_an_exited_pool_are_gone_and_forgotten(pool, tmp_path):
    record = await deployment(pool, tmp_path)
    keys = hash_full_blocks(list(range(16)), 4, "m|float32|4")
    await record.tracker.register_blocks(1, keys)
    await record.tracker.register_blocks(2, keys[:2])
    await record.models[1].set(answer="its vLLM engine core died")
    await record.workers[2].set_exited("sub-pool-2", "its sub-pool process 42 exited")

    await monitor(record).check_once()

    assert record.gone == {
        1: "its vLLM engine core died",
        2: "its sub-pool process 42 exited",
    }
    # the tracker sends nobody to them any more
    assert await record.tracker.replicas() == {0: pool.external_address}
    assert await record.tracker.query_prefix(0, keys) is None
    progress = record.progress()
    assert progress.state == "degraded"
    assert progress.replicas_ready == 1
    assert "replica 1 gone: its vLLM engine core died" in progress.detail
    # their sub-pools are removed (in the background)
    deadline = time.monotonic() + 5
    while len(await record.workers[0].removed_addresses()) < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert sorted(await record.workers[0].removed_addresses()) == [
        "sub-pool-1",
        "sub-pool-2",
    ]


async def test_a_vanished_actor_is_gone(pool, tmp_path):
    record = await deployment(pool, tmp_path, num_replicas=2)
    await xo.destroy_actor(record.models[0])
    await monitor(record).check_once()
    assert record.gone == {0: "its model actor no longer exists"}


async def test_a_replica_that_stops_answering_is_unresponsive_until_it_answers(
    pool, tmp_path
):
    record = await deployment(pool, tmp_path, num_replicas=2)
    watcher = monitor(record)
    await record.models[0].set(hang=True)
    started = time.monotonic()
    await watcher.check_once()
    # one probe deadline, not the hung call's hour
    assert time.monotonic() - started < 2 * PROBE_S
    assert list(record.unresponsive) == [0] and record.gone == {}
    assert record.unresponsive[0] == "no answer to a health probe in 2 s"
    assert record.progress().state == "degraded"
    assert record.progress().replicas_ready == 1
    # not forgotten: it comes back
    assert 0 in await record.tracker.replicas()
    await record.models[0].set(hang=False)
    await watcher.check_once()
    assert record.unresponsive == {} and record.progress().state == "ready"


async def test_the_monitor_runs_until_cancelled(pool, tmp_path):
    record = await deployment(pool, tmp_path, num_replicas=2)
    task = asyncio.create_task(monitor(record).run())
    await record.models[1].set(answer="its vLLM engine core died")
    deadline = time.monotonic() + 5
    while 1 not in record.gone:
        assert time.monotonic() < deadline, "a dead replica was not noticed in 5 s"
        await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.done()


async def test_marking_gone_twice_logs_and_forgets_once(pool, tmp_path, caplog):
    record = await deployment(pool, tmp_path, num_replicas=2)
    supervisor = SupervisorActor()
    await supervisor._mark_replicas_gone(record, [1], "worker lost")
    await supervisor._mark_replicas_gone(record, [1], "something else")
    assert record.gone == {1: "worker lost"}
    assert [r.message for r in caplog.records].count(
        next(r.message for r in caplog.records if "gone (worker lost)" in r.message)
    ) == 1
    # a tracker that is gone is ignored
    await xo.destroy_actor(record.tracker)
    await supervisor._mark_replicas_gone(record, [0], "worker lost")
    assert record.gone == {0: "worker lost", 1: "worker lost"}
