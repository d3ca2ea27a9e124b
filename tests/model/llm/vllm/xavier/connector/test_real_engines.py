"""Two real vLLM engines share prefix KV through the Xavier connector.

Setup (module scope, at most two engines alive at a time):

1. A reference engine without Xavier computes the greedy outputs of every prompt the
   tests use, then stops. "Equals recompute" below means "equals these".
2. A real ``nixl://`` xoscar pool holds the block tracker and one transfer actor per
   replica, each in its own sub-pool process.
3. Replica A (rank 0, CPU snapshots, synchronous loads before the forward) and
   replica B (rank 1, GPU-first settings with a zero device budget: asynchronous
   loads between scheduler steps) start with the connector; each serves one
   unrelated warm-up request first (see platform-notes: SIGILL on CPU otherwise).

Both replicas load ``InstrumentedXavierConnector`` (``instrumented_connector.py``):
the production connector plus two controls, each a file in the replica's test
directory. ``corrupt_keys`` makes replica A overwrite listed blocks with noise
before staging them (the control that proves B really uses the transferred bytes);
``faults`` makes listed methods of a connector half raise (the engine must contain
the fault and recompute).
"""

from __future__ import annotations

import contextlib
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks  # noqa: E402

from ..vllm_support import (  # noqa: E402
    BLOCK_SIZE,
    Completion,
    EngineProcess,
    RefusingHolder,
    XavierCluster,
    engine_kwargs,
    tiny_model_path,
    xavier_external_tokens,
)
from .instrumented_connector import (  # noqa: E402
    CORRUPT_KEYS_FILE,
    injected_faults,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

MODEL_UID = "xavier-e2e"
NAMESPACE = f"{MODEL_UID}|bfloat16|{BLOCK_SIZE}"
MAX_TOKENS = 8
MISS_DEADLINE_S = 20.0  # a miss path must not cost more than this per request


def tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids from a seeded generator (never 0, the model's EOS)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


# Shared prefix of 6 full blocks, then distinct tails (A's tail is not a full block).
PREFIX = tokens(1, 6 * BLOCK_SIZE)
PROMPT_A = PREFIX + tokens(2, 20)
PROMPT_B = PREFIX + tokens(3, 41)
# The other direction: B holds, A (synchronous loads) loads.
PREFIX_R = tokens(4, 4 * BLOCK_SIZE)
PROMPT_R_B = PREFIX_R + tokens(5, 10)
PROMPT_R_A = PREFIX_R + tokens(6, 33)
# Corruption control.
PREFIX_C = tokens(7, 5 * BLOCK_SIZE)
PROMPT_C_A = PREFIX_C + tokens(8, 9)
PROMPT_C_B = PREFIX_C + tokens(9, 30)
# 16 concurrent requests: 4 prefixes x 4 tails, over both replicas. Before them, A
# serves one seed per prefix 0 and 1, B one per prefix 2 and 3.
GROUP_PREFIXES = [tokens(100 + p, 3 * BLOCK_SIZE + 7 * p) for p in range(4)]
SEEDS = {
    0: [GROUP_PREFIXES[p] + tokens(150 + p, 5) for p in (0, 1)],
    1: [GROUP_PREFIXES[p] + tokens(150 + p, 5) for p in (2, 3)],
}
CONCURRENT = [
    GROUP_PREFIXES[p] + tokens(200 + 10 * p + t, 11 + 5 * t)
    for p in range(4)
    for t in range(4)
]
# Miss paths: prompts whose keys the tracker attributes to a holder that cannot serve.
PROMPT_EVICTED = tokens(300, 4 * BLOCK_SIZE + 5)
PROMPT_REFUSED = tokens(301, 4 * BLOCK_SIZE + 5)
PROMPT_GONE = tokens(302, 4 * BLOCK_SIZE + 5)
WARMUP = {0: tokens(900, 40), 1: tokens(901, 40)}
# A conversation: turn 1 (2 full blocks and a tail) answered with 64 tokens, then
# turn 2 = turn 1 + the answer + the next user message.
TURN1 = tokens(500, 2 * BLOCK_SIZE + 10)
TURN1_MAX_TOKENS = 64
USER2 = tokens(501, 20)
# Contained faults: (holder's prompt, loader's prompt) sharing 4 full blocks.
FAULT_PAIRS = {
    name: (prefix + tokens(seed + 1, 9), prefix + tokens(seed + 2, 13))
    for name, seed, prefix in (
        (name, seed, tokens(seed, 4 * BLOCK_SIZE))
        for name, seed in (
            ("on_allocated", 400),
            ("build_step", 410),
            ("start_load_kv", 420),
            ("wait_for_save", 430),
            ("after", 440),
        )
    )
}

ALL_PROMPTS = [
    PROMPT_A,
    PROMPT_B,
    PROMPT_R_B,
    PROMPT_R_A,
    PROMPT_C_A,
    PROMPT_C_B,
    *SEEDS[0],
    *SEEDS[1],
    *CONCURRENT,
    PROMPT_EVICTED,
    PROMPT_REFUSED,
    PROMPT_GONE,
    *(prompt for pair in FAULT_PAIRS.values() for prompt in pair),
]


def lookup_keys(prompt: list[int]) -> list[bytes]:
    """The keys a loader looks up: full blocks of the prompt minus its last token."""
    return hash_full_blocks(prompt[:-1], BLOCK_SIZE, NAMESPACE)


class Deployment:
    def __init__(self) -> None:
        self.model = tiny_model_path()
        self.reference: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.cluster: XavierCluster | None = None
        self.engines: dict[int, EngineProcess] = {}
        # rank -> the directory of that replica's test controls
        self.test_dirs = {
            rank: Path(tempfile.mkdtemp(prefix=f"xavier-test-{rank}-"))
            for rank in (0, 1)
        }
        self.corrupt_file = self.test_dirs[0] / CORRUPT_KEYS_FILE

    def compute_reference(self) -> None:
        engine = EngineProcess("reference", engine_kwargs(self.model)).start()
        try:
            engine.wait_ready()
            # One prompt per call: no batching effects in the reference.
            for prompt in ALL_PROMPTS:
                (completion,) = engine.generate([prompt], MAX_TOKENS)
                self.reference[tuple(prompt)] = completion.token_ids
            (answer,) = engine.generate([TURN1], TURN1_MAX_TOKENS)
            self.reference[tuple(TURN1)] = answer.token_ids
            turn2 = self.turn2(answer.token_ids)
            (completion,) = engine.generate([turn2], MAX_TOKENS)
            self.reference[tuple(turn2)] = completion.token_ids
        finally:
            engine.stop()

    def start_replicas(self) -> None:
        self.cluster = XavierCluster(MODEL_UID, num_replicas=2, rpc_timeout_s=5.0)
        self.cluster.start_transfer_actor(0, gpu_cache_bytes=None)
        self.cluster.start_transfer_actor(1, gpu_cache_bytes=0)
        for rank in (0, 1):
            kwargs = engine_kwargs(
                self.model,
                self.cluster.replica_settings(rank),
                test_dir=self.test_dirs[rank],
            )
            self.engines[rank] = EngineProcess(f"replica{rank}", kwargs).start()
        for rank, engine in self.engines.items():
            engine.wait_ready()
            # The worker maps its caches in the background after the engine is up
            # (the nixl transport's agent alone takes about half a second to start)
            # and the scheduler learns the replica's identity, without which it
            # looks nothing up remotely, from the first step after that: wait for
            # the mapping, then warm up.
            self.cluster.wait_mapped(rank)
            engine.generate([WARMUP[rank]], MAX_TOKENS)

    def faults(
        self, rank: int, *methods: str
    ) -> contextlib.AbstractContextManager[None]:
        """Make the listed connector-half methods of replica ``rank`` raise."""
        return injected_faults(self.test_dirs[rank], *methods)

    @staticmethod
    def turn2(answer: tuple[int, ...]) -> list[int]:
        return TURN1 + list(answer) + USER2

    def expected(self, prompt: list[int]) -> tuple[int, ...]:
        return self.reference[tuple(prompt)]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        if self.cluster is not None:
            self.cluster.close()


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    deployment = Deployment()
    try:
        deployment.compute_reference()
        deployment.start_replicas()
        yield deployment
    finally:
        deployment.close()


def serve(deployment: Deployment, rank: int, prompt: list[int]) -> Completion:
    (completion,) = deployment.engines[rank].generate([prompt], MAX_TOKENS)
    return completion


def serve_and_publish(
    deployment: Deployment, rank: int, prompt: list[int]
) -> Completion:
    """Serve ``prompt`` on ``rank`` and wait until the other replica can find its
    full blocks (Xavier publishes them in the background)."""
    completion = serve(deployment, rank, prompt)
    assert deployment.cluster is not None
    deployment.cluster.wait_published(
        hash_full_blocks(prompt, BLOCK_SIZE, NAMESPACE), for_rank=1 - rank
    )
    return completion


def shared_full_blocks(a: list[int], b: list[int]) -> int:
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common // BLOCK_SIZE


def test_remote_hit_supplies_the_shared_prefix_and_matches_recompute(deployment):
    """A serves a prompt; B serves another with the same 6-block prefix: B loads
    all 6 blocks from A (asynchronously) and generates what it would compute."""
    a = serve_and_publish(deployment, 0, PROMPT_A)
    assert a.token_ids == deployment.expected(PROMPT_A)
    assert xavier_external_tokens(a) == 0

    b = serve(deployment, 1, PROMPT_B)
    shared = shared_full_blocks(PROMPT_A, PROMPT_B) * BLOCK_SIZE
    assert shared == 6 * BLOCK_SIZE
    assert xavier_external_tokens(b) == shared
    assert (b.kv_transfer_params or {})["xavier_holder_rank"] == 0
    assert b.num_cached_tokens == shared
    assert b.token_ids == deployment.expected(PROMPT_B)
    # Both engines' schedulers follow the tracker's index through their mirrors
    # (each poll tells the tracker how far that mirror is).
    assert deployment.cluster is not None
    followed = deployment.cluster.call(deployment.cluster.tracker.mirror_versions())
    assert {0, 1} <= set(followed), followed
    stats = deployment.cluster.stats(1)
    assert stats.actor.loads_ok >= 1


def test_synchronous_load_the_other_way_matches_recompute(deployment):
    """B holds, A loads: the synchronous path (load before the forward)."""
    serve_and_publish(deployment, 1, PROMPT_R_B)
    a = serve(deployment, 0, PROMPT_R_A)
    assert xavier_external_tokens(a) == 4 * BLOCK_SIZE
    assert (a.kv_transfer_params or {})["xavier_holder_rank"] == 1
    assert a.token_ids == deployment.expected(PROMPT_R_A)


def test_the_next_turn_on_the_other_replica_loads_the_answer_too(deployment):
    """Turn 1 on A; turn 2 (turn 1, A's answer, a new message) on B: B loads the
    blocks of A's answer as well as the prompt's, and answers as A does from its
    own prefix cache."""
    (first,) = deployment.engines[0].generate([TURN1], TURN1_MAX_TOKENS)
    assert first.token_ids == deployment.expected(TURN1)
    turn2 = deployment.turn2(first.token_ids)
    # A computed KV for every token but the last one it generated (sampled, never
    # fed back): those full blocks are what B can load.
    held_blocks = (len(TURN1) + len(first.token_ids) - 1) // BLOCK_SIZE
    prompt_blocks = len(TURN1) // BLOCK_SIZE
    assert held_blocks >= prompt_blocks + 2  # the answer fills blocks of its own
    assert deployment.cluster is not None
    deployment.cluster.wait_published(
        lookup_keys(turn2)[:held_blocks], for_rank=1
    )  # A publishes in the background, after the request returned

    remote = serve(deployment, 1, turn2)
    assert xavier_external_tokens(remote) == held_blocks * BLOCK_SIZE
    assert (remote.kv_transfer_params or {})["xavier_holder_rank"] == 0
    local = serve(deployment, 0, turn2)  # a local prefix-cache hit on A
    assert xavier_external_tokens(local) == 0
    assert local.num_cached_tokens >= held_blocks * BLOCK_SIZE
    assert remote.token_ids == local.token_ids == deployment.expected(turn2)


def test_corrupted_transfer_changes_the_output(deployment):
    """Control: A stages noise instead of the prefix's KV; B loads it and its
    output changes, so the equal outputs above come from the transferred bytes."""
    listed = [key.hex() for key in lookup_keys(PROMPT_C_B)]
    deployment.corrupt_file.write_text("\n".join(listed) + "\n")
    try:
        serve_and_publish(deployment, 0, PROMPT_C_A)
    finally:
        deployment.corrupt_file.unlink()
    b = serve(deployment, 1, PROMPT_C_B)
    assert xavier_external_tokens(b) == 5 * BLOCK_SIZE
    assert b.token_ids != deployment.expected(PROMPT_C_B)


def test_sixteen_concurrent_requests_over_both_replicas(deployment):
    """16 requests at once, 8 per replica, each replica getting two tails of every
    prefix: half hit the replica's own prefix cache, half load from the other
    replica while it serves its own batch."""
    engines = deployment.engines
    for rank, seeds in SEEDS.items():
        for seed in seeds:
            assert serve_and_publish(
                deployment, rank, seed
            ).token_ids == deployment.expected(seed)
    batches = {
        0: [p for i, p in enumerate(CONCURRENT) if i % 4 in (0, 1)],
        1: [p for i, p in enumerate(CONCURRENT) if i % 4 in (2, 3)],
    }
    for rank, prompts in batches.items():
        engines[rank].send_generate(prompts, MAX_TOKENS)
    results: dict[tuple[int, ...], tuple[int, Completion]] = {}
    for rank, prompts in batches.items():
        completions, _ = engines[rank].receive_generate(timeout=300)
        results.update(
            (tuple(p), (rank, c)) for p, c in zip(prompts, completions, strict=True)
        )
    assert len(results) == 16
    remote_loads = 0
    for index, prompt in enumerate(CONCURRENT):
        rank, completion = results[tuple(prompt)]
        assert completion.token_ids == deployment.expected(prompt), index
        group = index // 4
        held_by_other = (group >= 2) == (rank == 0)
        prefix_tokens = len(GROUP_PREFIXES[group]) // BLOCK_SIZE * BLOCK_SIZE
        # Every prefix is reused, locally or from the peer.
        assert completion.num_cached_tokens >= prefix_tokens, index
        if xavier_external_tokens(completion):
            assert held_by_other, index
            remote_loads += 1
    assert remote_loads >= 4, remote_loads


def timed_miss(deployment: Deployment, prompt: list[int]) -> Completion:
    started = time.monotonic()
    completion = serve(deployment, 1, prompt)
    assert time.monotonic() - started < MISS_DEADLINE_S
    assert xavier_external_tokens(completion) == 0
    assert completion.token_ids == deployment.expected(prompt)
    return completion


def test_evicted_snapshot_is_a_miss(deployment):
    """The tracker still says A holds the prefix, but A's store no longer has it."""
    cluster = deployment.cluster
    cluster.call(cluster.tracker.register_blocks(0, lookup_keys(PROMPT_EVICTED)))
    cluster.wait_published(lookup_keys(PROMPT_EVICTED), for_rank=1)
    timed_miss(deployment, PROMPT_EVICTED)


def test_refused_lease_is_a_miss(deployment):
    cluster = deployment.cluster
    address = cluster.start_peer(RefusingHolder, 5)
    cluster.call(cluster.tracker.register_blocks(5, lookup_keys(PROMPT_REFUSED)))
    cluster.wait_published(lookup_keys(PROMPT_REFUSED), for_rank=1)
    timed_miss(deployment, PROMPT_REFUSED)
    import xoscar as xo

    from xinference.model.llm.vllm.xavier.config import transfer_actor_uid

    peer = cluster.call(xo.actor_ref(address, transfer_actor_uid(MODEL_UID, 5)))
    assert cluster.call(peer.refusals()) == 1


def test_holder_gone_is_a_miss(deployment):
    """The tracker lists a replica whose process is gone (nothing listens)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cluster = deployment.cluster
    cluster.call(cluster.tracker.register_replica(6, f"nixl://127.0.0.1:{port}"))
    cluster.call(cluster.tracker.register_blocks(6, lookup_keys(PROMPT_GONE)))
    cluster.wait_published(lookup_keys(PROMPT_GONE), for_rank=1)
    timed_miss(deployment, PROMPT_GONE)


# ---- faults inside the connector: contained, recomputed, the engine goes on ----


def fault_count(deployment: Deployment, rank: int) -> int:
    return deployment.cluster.stats(rank).actor.connector_faults


@pytest.mark.parametrize(
    "method, holder, loader",
    [
        # B loads asynchronously: a request vLLM parks until its load is reported
        # must not wait forever when the scheduler half fails on its allocation...
        ("on_allocated", 0, 1),
        # ...or when building the step that would start the load fails.
        ("build_step", 0, 1),
        # A loads synchronously, before the forward: a worker half that fails to
        # start the load must not let the forward read unwritten blocks.
        ("start_load_kv", 1, 0),
    ],
)
def test_a_fault_on_the_load_path_is_contained_and_recomputed(
    deployment, method, holder, loader
):
    holder_prompt, loader_prompt = FAULT_PAIRS[method]
    serve_and_publish(deployment, holder, holder_prompt)
    before = fault_count(deployment, loader)
    with deployment.faults(loader, method):
        completion = serve(deployment, loader, loader_prompt)
    assert completion.token_ids == deployment.expected(loader_prompt)
    assert xavier_external_tokens(completion) == 0
    deadline = time.monotonic() + 10
    while fault_count(deployment, loader) == before and time.monotonic() < deadline:
        time.sleep(0.1)  # the count reaches the actor without blocking the engine
    assert fault_count(deployment, loader) > before


def test_a_fault_while_staging_costs_the_peer_a_miss_only(deployment):
    """A's worker fails to stage its blocks: nothing is published, so B computes
    the shared prefix itself, and both outputs are right."""
    holder_prompt, loader_prompt = FAULT_PAIRS["wait_for_save"]
    with deployment.faults(0, "wait_for_save"):
        a = serve(deployment, 0, holder_prompt)
    assert a.token_ids == deployment.expected(holder_prompt)
    b = serve(deployment, 1, loader_prompt)
    assert xavier_external_tokens(b) == 0
    assert b.token_ids == deployment.expected(loader_prompt)


def test_remote_hits_work_again_once_the_faults_stop(deployment):
    holder_prompt, loader_prompt = FAULT_PAIRS["after"]
    serve_and_publish(deployment, 0, holder_prompt)
    b = serve(deployment, 1, loader_prompt)
    assert xavier_external_tokens(b) == 4 * BLOCK_SIZE
    assert b.token_ids == deployment.expected(loader_prompt)
