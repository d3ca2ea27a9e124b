"""The dispatcher against a real block tracker and test-double replicas.

The replicas here are small actors with the model actor's serving methods (no
engine); the tracker is the real ``BlockTrackerActor`` in an in-process pool, and
the keys are hashed the way the connector registers them.
"""

import pytest
import xoscar as xo

from xinference.core.dispatch import ReplicaDispatcher
from xinference.core.messages import (
    DeploymentInfo,
    GenerationChunk,
    GenerationRequest,
    ReplicaFailed,
    ReplicaInfo,
    ReplicaStates,
    ServiceUnavailable,
    StreamBatch,
)
from xinference.core.options import RouterSettings
from xinference.core.prompting import PromptRenderer
from xinference.core.router import CacheAwareRouter, RoundRobinRouter
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor

NAMESPACE = "m|bfloat16|4"
BLOCK = 4


class ScriptedReplica(xo.StatelessActor):
    """Answers with its rank; streams three chunks, recording closes."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank
        self.closed = []
        self._streams = {}

    async def generate(self, request):
        return GenerationChunk(
            text=f"r{self.rank}", token_ids=(1,), finish_reason="stop"
        )

    async def open_stream(self, request):
        self._streams[request.request_id] = [
            GenerationChunk(text=f"r{self.rank}-{i}", token_ids=(i,)) for i in range(3)
        ]

    async def next_chunks(self, request_id, max_wait_s):
        chunks = self._streams[request_id]
        if not chunks:
            return StreamBatch(chunks=(), done=True)
        return StreamBatch(chunks=(chunks.pop(0),), done=False)

    async def close_stream(self, request_id):
        self.closed.append(request_id)

    async def closed_streams(self):
        return list(self.closed)


@pytest.fixture
async def pool():
    pool = await xo.create_actor_pool("127.0.0.1", n_process=0)
    try:
        yield pool
    finally:
        await pool.stop()


async def make(pool, router, num_replicas=2):
    address = pool.external_address
    tracker = await xo.create_actor(BlockTrackerActor, address=address, uid="tracker")
    replicas = [
        await xo.create_actor(
            ScriptedReplica, rank, address=address, uid=f"replica-{rank}"
        )
        for rank in range(num_replicas)
    ]
    for rank in range(num_replicas):
        await tracker.register_replica(rank, address)
    deployment = DeploymentInfo(
        model_uid="m",
        model_path="/nowhere",
        model_engine="vllm",
        replicas=tuple(
            ReplicaInfo(rank, address, f"replica-{rank}", 0, 100, BLOCK, 0.0)
            for rank in range(num_replicas)
        ),
        router=RouterSettings("cache-aware"),
        xavier_enabled=True,
        xavier_description="Xavier: on",
        tracker_address=address,
        tracker_uid="tracker",
        hash_namespace=NAMESPACE,
    )
    # routing needs no tokenizer: the tests pass token ids
    renderer = PromptRenderer(tokenizer=None)
    dispatcher = ReplicaDispatcher(deployment, renderer, replicas, tracker, router)
    return dispatcher, tracker, replicas


def request(prompt):
    return GenerationRequest(
        request_id=f"req-{len(prompt)}", prompt_token_ids=tuple(prompt)
    )


async def test_cache_aware_routes_to_the_replica_holding_the_prefix(pool):
    dispatcher, tracker, _ = await make(pool, CacheAwareRouter(busy_margin=1))
    prompt = list(range(1, 18))  # 4 full blocks before the last token
    keys = hash_full_blocks(prompt[:-1], BLOCK, NAMESPACE)
    await tracker.register_blocks(1, keys[:3])

    assert await dispatcher.longest_prefix(prompt) == (1, 3)
    route = await dispatcher.route(prompt)
    assert (route.rank, route.holder, route.prefix_blocks) == (1, 1, 3)
    chunk = await dispatcher.generate(route, request(prompt))
    assert chunk.text == "r1"
    assert dispatcher.counters[1].routed_to_holder == 1


async def test_a_busy_holder_is_skipped(pool):
    dispatcher, tracker, _ = await make(pool, CacheAwareRouter(busy_margin=1))
    prompt = list(range(1, 18))
    await tracker.register_blocks(1, hash_full_blocks(prompt[:-1], BLOCK, NAMESPACE))
    dispatcher._in_flight[1] = 2  # two requests running there, none on replica 0
    route = await dispatcher.route(prompt)
    assert route.rank == 0 and route.holder == 1
    assert dispatcher.counters[1].holder_too_busy == 1


async def test_keys_of_another_namespace_are_not_matched(pool):
    dispatcher, tracker, _ = await make(pool, CacheAwareRouter())
    prompt = list(range(1, 18))
    await tracker.register_blocks(1, hash_full_blocks(prompt[:-1], BLOCK, "other|x|4"))
    assert await dispatcher.longest_prefix(prompt) == (None, 0)


async def test_a_dead_tracker_routes_without_cache_knowledge(pool):
    dispatcher, tracker, _ = await make(pool, CacheAwareRouter())
    await xo.destroy_actor(tracker)
    route = await dispatcher.route(list(range(1, 18)))
    assert route.holder is None and route.rank in (0, 1)
    assert dispatcher.tracker_errors == 1


async def test_streams_are_relayed_and_counted_in_flight(pool):
    dispatcher, _, replicas = await make(pool, RoundRobinRouter())
    route = await dispatcher.route([1, 2, 3])
    seen = []
    async for chunk in dispatcher.stream(route, request([1, 2, 3])):
        seen.append(chunk.text)
        assert dispatcher.in_flight[route.rank] == 1
    assert seen == ["r0-0", "r0-1", "r0-2"]
    assert dispatcher.in_flight == (0, 0)
    assert await replicas[0].closed_streams() == []  # finished: nothing to abort


async def test_a_stream_left_early_is_aborted_on_the_replica(pool):
    dispatcher, _, replicas = await make(pool, RoundRobinRouter())
    route = await dispatcher.route([1, 2, 3])
    stream = dispatcher.stream(route, request([1, 2, 3]))
    async for _ in stream:
        break
    await stream.aclose()
    assert await replicas[0].closed_streams() == ["req-3"]
    assert dispatcher.in_flight == (0, 0)


class States:
    """A supervisor's ``replica_states`` answer the test sets."""

    def __init__(self):
        self.value = ReplicaStates()
        self.asked = 0

    async def __call__(self):
        self.asked += 1
        return self.value


async def test_gone_and_unresponsive_replicas_get_no_requests(pool):
    dispatcher, _, _ = await make(pool, RoundRobinRouter(), num_replicas=3)
    states = States()
    dispatcher._states_source = states
    states.value = ReplicaStates(gone={1: "its vLLM engine core died"})
    await dispatcher.refresh_states(force=True)
    assert [(await dispatcher.route([1, 2])).rank for _ in range(4)] == [0, 2, 0, 2]
    states.value = ReplicaStates(gone={1: "dead"}, unresponsive={2: "no answer"})
    await dispatcher.refresh_states(force=True)
    assert {(await dispatcher.route([1, 2])).rank for _ in range(3)} == {0}
    # every live replica unresponsive: wait on them rather than refuse
    states.value = ReplicaStates(gone={1: "dead"}, unresponsive={0: "x", 2: "y"})
    await dispatcher.refresh_states(force=True)
    assert {(await dispatcher.route([1, 2])).rank for _ in range(4)} == {0, 2}


async def test_no_replica_left_is_service_unavailable_with_the_reasons(pool):
    dispatcher, _, _ = await make(pool, RoundRobinRouter())
    states = States()
    states.value = ReplicaStates(gone={0: "engine died", 1: "sub-pool exited"})
    dispatcher._states_source = states
    await dispatcher.refresh_states(force=True)
    with pytest.raises(ServiceUnavailable, match="replica 0: engine died"):
        await dispatcher.route([1, 2])


async def test_states_are_asked_at_most_once_a_second(pool):
    dispatcher, _, _ = await make(pool, RoundRobinRouter())
    states = States()
    dispatcher._states_source = states
    dispatcher._states_at = 0.0  # long ago
    for _ in range(5):
        await dispatcher.route([1, 2])
    assert states.asked == 1


async def test_a_request_whose_replica_vanished_is_served_by_another(pool):
    dispatcher, _, replicas = await make(pool, RoundRobinRouter())
    dispatcher._states_source = States()
    await xo.destroy_actor(replicas[0])
    route = await dispatcher.route([1, 2, 3])
    assert route.rank == 0
    chunk, rank = await dispatcher.serve(route, request([1, 2, 3]))
    assert (chunk.text, rank) == ("r1", 1)
    assert (dispatcher.replica_failures, dispatcher.retries) == (1, 1)
    assert dispatcher.in_flight == (0, 0)
    # the failed replica is avoided for a while even before the supervisor knows
    assert {(await dispatcher.route([1, 2])).rank for _ in range(3)} == {1}
    # a stream that fails before its first chunk is sent to the other replica too
    dispatcher._suspect_until.clear()
    route = await dispatcher.route([1, 2, 3])
    assert route.rank == 0
    seen = [
        (chunk.text, rank)
        async for chunk, rank in dispatcher.stream_served(route, request([1, 2, 3]))
    ]
    assert seen == [("r1-0", 1), ("r1-1", 1), ("r1-2", 1)]


async def test_a_vanished_replica_with_no_other_is_a_clear_failure(pool):
    dispatcher, _, replicas = await make(pool, RoundRobinRouter(), num_replicas=1)
    await xo.destroy_actor(replicas[0])
    route = await dispatcher.route([1, 2, 3])
    with pytest.raises(ReplicaFailed, match="replica 0 failed: its process or actor"):
        await dispatcher.serve(route, request([1, 2, 3]))
