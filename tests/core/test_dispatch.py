"""The dispatcher against a real block tracker and test-double replicas.

The replicas here are small actors with the model actor's serving methods (no
engine); the tracker is the real ``BlockTrackerActor`` in an in-process pool, and
the keys are hashed the way the connector registers them.
"""

import asyncio
import dataclasses

import pytest
import xoscar as xo

from xinference.core.dispatch import ReplicaDispatcher, ReplicaUnavailable
from xinference.core.messages import (
    DeploymentInfo,
    GenerationChunk,
    GenerationRequest,
    ReplicaFailed,
    ReplicaInfo,
    ReplicaStates,
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

    async def opened_streams(self):
        return list(self._streams)


class DyingMidStream(ScriptedReplica):
    """Sends one chunk of a stream, then its engine dies."""

    async def next_chunks(self, request_id, max_wait_s):
        if self._streams[request_id]:
            return StreamBatch(chunks=(self._streams[request_id].pop(0),), done=False)
        raise ReplicaFailed(self.rank, "its vLLM engine core died")

    async def open_stream(self, request):
        await super().open_stream(request)
        self._streams[request.request_id] = self._streams[request.request_id][:1]


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


async def test_gone_and_unresponsive_replicas_get_no_requests(pool):
    dispatcher, _, _ = await make(pool, RoundRobinRouter(), num_replicas=3)
    dispatcher.update_states(ReplicaStates(gone={1: "its vLLM engine core died"}))
    assert {(await dispatcher.route([1, 2])).rank for _ in range(4)} == {0, 2}
    dispatcher.update_states(
        ReplicaStates(gone={1: "dead"}, unresponsive={2: "no answer"})
    )
    assert {(await dispatcher.route([1, 2])).rank for _ in range(3)} == {0}
    # every live replica unresponsive: wait on them rather than refuse
    dispatcher.update_states(
        ReplicaStates(gone={1: "dead"}, unresponsive={0: "x", 2: "y"})
    )
    assert {(await dispatcher.route([1, 2])).rank for _ in range(4)} == {0, 2}
    # answering again: back in turn
    dispatcher.update_states(ReplicaStates(gone={1: "dead"}))
    assert {(await dispatcher.route([1, 2])).rank for _ in range(4)} == {0, 2}


async def test_a_request_whose_replica_vanished_is_served_by_another(pool):
    dispatcher, _, replicas = await make(pool, RoundRobinRouter())
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
    dispatcher._suspect.clear()
    route = await dispatcher.route([1, 2, 3])
    if route.rank != 0:  # round robin: the next one is replica 0
        route = await dispatcher.route([1, 2, 3])
    assert route.rank == 0
    seen = [
        (chunk.text, rank)
        async for chunk, rank in dispatcher.stream_served(route, request([1, 2, 3]))
    ]
    assert seen == [("r1-0", 1), ("r1-1", 1), ("r1-2", 1)]


async def test_a_stream_that_failed_after_output_went_out_is_not_sent_again(pool):
    """The client has the first chunk already: starting over on another replica
    would send it a second answer glued to the first. The failure reaches the
    client instead, and the other replica never sees the request."""
    dispatcher, _, replicas = await make(pool, RoundRobinRouter())
    dispatcher._replicas[0] = await xo.create_actor(
        DyingMidStream, 0, address=pool.external_address, uid="dying"
    )
    route = await dispatcher.route([1, 2, 3])
    assert route.rank == 0
    seen = []
    with pytest.raises(ReplicaFailed, match="engine core died"):
        async for chunk, rank in dispatcher.stream_served(route, request([1, 2, 3])):
            seen.append((chunk.text, rank))
    assert seen == [("r0-0", 0)]
    assert await replicas[1].opened_streams() == []
    assert (dispatcher.replica_failures, dispatcher.retries) == (0, 0)
    assert dispatcher.in_flight == (0, 0)


async def test_a_vanished_replica_with_no_other_is_a_clear_failure(pool):
    dispatcher, _, replicas = await make(pool, RoundRobinRouter(), num_replicas=1)
    await xo.destroy_actor(replicas[0])
    route = await dispatcher.route([1, 2, 3])
    with pytest.raises(ReplicaUnavailable, match="replica 0 of m at .* unreachable"):
        await dispatcher.serve(route, request([1, 2, 3]))


# ---- replicas that are gone or unreachable ----------------------------------------


async def test_gone_replicas_are_not_routed_to_not_even_as_prefix_holders(pool):
    dispatcher, tracker, _ = await make(pool, CacheAwareRouter(busy_margin=1), 3)
    prompt = list(range(1, 18))
    keys = hash_full_blocks(prompt[:-1], BLOCK, NAMESPACE)
    await tracker.register_blocks(1, keys)
    dispatcher.update_gone({1: "worker 127.0.0.3:1 sent no heartbeat"})

    assert dispatcher.live_ranks() == [0, 2]
    ranks = {(await dispatcher.route(prompt)).rank for _ in range(6)}
    assert ranks <= {0, 2} and ranks


async def test_a_new_dispatcher_starts_with_the_deployments_gone_replicas(pool):
    """A front end that connects after a replica was declared gone learns it from
    the deployment it is built from, not from the next state update (up to a
    second later in production): no request goes there meanwhile."""
    dispatcher, _, replicas = await make(pool, RoundRobinRouter(), 3)
    deployment = dataclasses.replace(
        dispatcher.deployment, gone={1: "its vLLM engine core died"}
    )
    fresh = ReplicaDispatcher(
        deployment, dispatcher.renderer, replicas, None, RoundRobinRouter()
    )
    assert fresh.live_ranks() == [0, 2]
    assert {(await fresh.route([1, 2])).rank for _ in range(6)} == {0, 2}


async def test_round_robin_cycles_over_the_survivors(pool):
    robin, _, _ = await make(pool, RoundRobinRouter(), 3)
    robin.update_gone({0: "gone"})
    assert [(await robin.route([1])).rank for _ in range(4)] == [1, 2, 1, 2]


async def test_no_live_replica_fails_at_once_with_the_reasons(pool):
    from xinference.core.dispatch import ReplicaUnavailable

    dispatcher, _, _ = await make(pool, RoundRobinRouter(), 2)
    dispatcher.update_gone({0: "worker A lost", 1: "worker B lost"})
    with pytest.raises(ReplicaUnavailable, match="worker A lost.*worker B lost"):
        await dispatcher.route([1, 2, 3])


async def test_an_unreachable_replica_fails_the_request_fast_and_is_skipped(pool):
    """A replica whose process is gone: the call fails with a clear error (not a
    hang) and the next routes avoid it until the supervisor decides."""
    from xinference.core.dispatch import ReplicaUnavailable

    dispatcher, _, replicas = await make(pool, RoundRobinRouter(), 2)
    await xo.destroy_actor(replicas[1])  # the actor vanished: ActorNotExist
    route0 = await dispatcher.route([1])
    route1 = await dispatcher.route([1])
    assert (route0.rank, route1.rank) == (0, 1)
    with pytest.raises(ReplicaUnavailable, match="replica 1 of m .* unreachable"):
        await dispatcher.generate(route1, request([1]))
    assert dispatcher.in_flight == (0, 0)
    assert dispatcher.live_ranks() == [0]
    assert [(await dispatcher.route([1])).rank for _ in range(3)] == [0, 0, 0]
    # the supervisor's verdict replaces the suspicion
    dispatcher.update_gone({1: "gone"})
    assert dispatcher.gone == {1: "gone"} and dispatcher.live_ranks() == [0]


class SilentReplica(xo.StatelessActor):
    """Never answers, as a replica behind a network cut."""

    async def generate(self, request):
        await asyncio.sleep(3600)


async def test_a_request_waiting_on_a_replica_declared_gone_ends_at_once(pool):
    from xinference.core.dispatch import ReplicaUnavailable

    dispatcher, _, replicas = await make(pool, RoundRobinRouter(), 2)
    dispatcher._replicas[1] = await xo.create_actor(
        SilentReplica, address=pool.external_address, uid="silent"
    )
    await dispatcher.route([1])
    route = await dispatcher.route([1])
    assert route.rank == 1
    pending = asyncio.ensure_future(dispatcher.generate(route, request([1])))
    await asyncio.sleep(0.2)
    assert not pending.done()
    dispatcher.update_gone({1: "worker 127.0.0.3:1 sent no heartbeat"})
    with pytest.raises(ReplicaUnavailable, match="taken out of service.*heartbeat"):
        await asyncio.wait_for(pending, 5)
    assert dispatcher.in_flight == (0, 0)


async def test_the_router_looks_a_prefix_up_under_the_requests_salt(pool):
    """A prefix cached under one salt draws only requests of that salt: an
    unsalted or differently salted prompt would miss on its holder anyway."""
    dispatcher, tracker, _ = await make(pool, CacheAwareRouter(busy_margin=1))
    prompt = list(range(1, 18))
    await tracker.register_blocks(
        1, hash_full_blocks(prompt[:-1], BLOCK, NAMESPACE, "tenant-a")
    )
    route = await dispatcher.route(prompt, "tenant-a")
    assert (route.rank, route.holder, route.prefix_blocks) == (1, 1, 4)
    for other in (None, "tenant-b"):
        assert (await dispatcher.route(prompt, other)).holder is None
        assert await dispatcher.longest_prefix(prompt, other) == (None, 0)
    assert await dispatcher.longest_prefix(prompt, "tenant-a") == (1, 4)
