"""The synchronous fast path between two real vLLM engines (CPU build).

Both replicas are GPU-first with a device tier (on this CPU machine, in host memory),
one host, NIXL between their transfer actors: a remote hit is bounded, so replica B
answers vLLM ``(n, False)`` and loads in the step that schedules the request. The
greedy output of that hit must equal what A computed for the same prompt and what B
gives as a local prefix hit; the connector counts 0 engine passes waited and 0
actor round trips: the grant comes from the locations A published with its keys,
and B's engine process READs the rows and A's generation words itself.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from xinference.model.llm.vllm.xavier.connector.staging_ring import (  # noqa: E402
    MAX_RING_SHARE_OF_BUDGET,
)
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks  # noqa: E402

from ..vllm_support import (  # noqa: E402
    BLOCK_SIZE,
    EngineProcess,
    XavierCluster,
    engine_kwargs,
    tiny_model_path,
    xavier_external_tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

MODEL_UID = "xavier-fast-path"
NAMESPACE = f"{MODEL_UID}|bfloat16|{BLOCK_SIZE}"
MAX_TOKENS = 8
DEVICE_BUDGET = 16 << 20  # each replica's xavier_gpu_cache_bytes


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[XavierCluster, EngineProcess, EngineProcess]]:
    cluster = XavierCluster(MODEL_UID, num_replicas=2, rpc_timeout_s=5.0)
    engines: list[EngineProcess] = []
    try:
        for rank in (0, 1):
            cluster.start_transfer_actor(rank, gpu_cache_bytes=DEVICE_BUDGET)
        for rank in (0, 1):
            kwargs = engine_kwargs(tiny_model_path(), cluster.replica_settings(rank))
            # 8 ms for the bound's fixed part (2 ms by default, for a GPU host): a
            # load's calls take milliseconds of Python on a busy 2-core machine.
            engines.append(
                EngineProcess(
                    f"fast{rank}",
                    kwargs,
                    env={"XAVIER_FAST_PATH": "1", "XAVIER_FAST_PATH_BASE_MS": "8"},
                ).start()
            )
        for rank, engine in enumerate(engines):
            engine.wait_ready()
            cluster.wait_mapped(rank)
            engine.generate([tokens(900 + rank, 40)], MAX_TOKENS)
        yield cluster, engines[0], engines[1]
    finally:
        for engine in engines:
            engine.stop()
        cluster.close()


def remote_hit(
    cluster: XavierCluster, a: EngineProcess, b: EngineProcess, prompt: list[int]
) -> tuple[tuple[int, ...], dict]:
    """A serves ``prompt``; once B can find its blocks, B serves it: B's output
    must equal A's, and B must have loaded every full block from A."""
    (on_a,) = a.generate([prompt], MAX_TOKENS)
    cluster.wait_published(
        hash_full_blocks(prompt[:-1], BLOCK_SIZE, NAMESPACE), for_rank=1
    )
    (remote,) = b.generate([prompt], MAX_TOKENS)
    params = remote.kv_transfer_params or {}
    assert xavier_external_tokens(remote) == (len(prompt) - 1) // BLOCK_SIZE * (
        BLOCK_SIZE
    ), params
    assert remote.token_ids == on_a.token_ids
    return remote.token_ids, params


def test_a_bounded_hit_loads_in_the_lookup_pass_with_exact_outputs(replicas):
    cluster, a, b = replicas
    # The first load from a peer also meets it (one call for its NIXL endpoint).
    remote_hit(cluster, a, b, tokens(6, 2 * BLOCK_SIZE + 3))
    prompt = tokens(7, 5 * BLOCK_SIZE + 9)
    output, params = remote_hit(cluster, a, b, prompt)
    (local,) = b.generate([prompt], MAX_TOKENS)  # now B's own prefix hit
    assert xavier_external_tokens(local) == 0
    assert local.token_ids == output
    # Scheduled in the pass that looked it up, with no actor round trip on its
    # path: no reservation (the grant was made from the locations A published
    # with its keys) and no actor call for the load (B's engine process READ the
    # rows and then A's generation words with its own NIXL agent).
    assert params["xavier_passes_waited"] == 0, params
    assert params["xavier_passes_deferred"] == 0, params
    assert params["xavier_round_trips"] == 0, params
    # B's transfer actor loaded only the first, asynchronous hit (which met A)
    stats = cluster.stats(1).actor
    assert stats.loads_ok == 1 and stats.loads_past_bound == 0
    # and learns of the READ B's engine made itself from the worker, which
    # reports it from its background loop within two seconds
    deadline = time.monotonic() + 10
    while cluster.stats(1).actor.direct_reads < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.stats(1).actor.direct_reads == 1


def test_the_staging_ring_and_the_device_tier_share_the_budget(replicas):
    """The engine's worker sizes its ring out of the replica's budget (half of
    16 MiB here: four steps' blocks would be more) and the actor's device tier
    holds the rest, so the two stay within xavier_gpu_cache_bytes."""
    from xinference.model.llm.llama_shaped import kv_bytes_per_token
    from xinference.model.llm.tiny_model import TINY_QWEN2

    cluster, _, _ = replicas
    block = kv_bytes_per_token(TINY_QWEN2) * BLOCK_SIZE
    ring_blocks = DEVICE_BUDGET // MAX_RING_SHARE_OF_BUDGET // block
    for rank in (0, 1):
        store = cluster.stats(rank).store
        assert store is not None
        assert store.device_capacity_blocks == (
            (DEVICE_BUDGET - ring_blocks * block) // block
        ), (rank, block)
