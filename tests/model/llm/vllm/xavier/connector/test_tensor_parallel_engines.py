"""Two real vLLM replicas of tensor_parallel_size 2 share prefix KV rank to rank.

vLLM's CPU backend runs each replica as an engine core plus one worker process per
rank (bound to CPUs 0 and 1, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``; the launcher sets
it the same way, ``core/placement.py``). The model has 4 KV heads, 2 per rank.

1. A reference engine of 2 ranks without Xavier computes the greedy outputs of
   every prompt, then stops.
2. Replica A (rank 0) and replica B (rank 1) run with the connector, each with one
   transfer actor per engine rank in its own sub-pool process (a
   ``TransferActorGroup``, as the launcher creates them).
3. A serves a prompt; B serves another with the same prefix and loads it from A,
   each of its ranks from the same rank of A; its outputs equal the reference.
4. B's rank 1 fails its part of a load (an injected fault): vLLM recomputes the
   blocks on both ranks and the outputs still equal the reference.
5. B's rank 1 worker process is killed: vLLM's executor notices and B's engine
   fails its requests, while A serves on. (Through the serving layer, a replica
   whose engine died is marked gone by the liveness monitor, ``core/liveness.py``;
   not started here.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import psutil  # noqa: E402
import xoscar as xo  # noqa: E402

from xinference.model.llm.tiny_model import build_tiny_qwen2  # noqa: E402
from xinference.model.llm.vllm.xavier.actor.rank_group import (  # noqa: E402
    TransferActorGroup,
)
from xinference.model.llm.vllm.xavier.actor.transfer_actor import (  # noqa: E402
    TransferActorConfig,
)
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks  # noqa: E402

from ..vllm_support import (  # noqa: E402
    BLOCK_SIZE,
    EngineFailed,
    EngineProcess,
    XavierCluster,
    engine_kwargs,
    xavier_external_tokens,
)
from .instrumented_connector import injected_faults  # noqa: E402
from .test_real_engines import tokens  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

MODEL_UID = "xavier-tp2"
NAMESPACE = f"{MODEL_UID}|bfloat16|{BLOCK_SIZE}"
TP = 2
CPU_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
MAX_TOKENS = 8


PREFIX = tokens(1, 4 * BLOCK_SIZE)
PROMPT_A = PREFIX + tokens(2, 10)
PROMPT_B = PREFIX + tokens(3, 21)
PREFIX_F = tokens(4, 3 * BLOCK_SIZE)
PROMPT_F_A = PREFIX_F + tokens(5, 7)
PROMPT_F_B = PREFIX_F + tokens(6, 30)
PROMPTS = [PROMPT_A, PROMPT_B, PROMPT_F_A, PROMPT_F_B]


def model_path() -> Path:
    """The tiny test model with 4 KV heads, so that each of 2 ranks holds 2."""
    return build_tiny_qwen2(
        Path(tempfile.gettempdir()) / "xavier-tiny-qwen2-kv4", num_key_value_heads=4
    )


@dataclasses.dataclass
class Deployment:
    cluster: XavierCluster
    groups: dict[int, TransferActorGroup]
    engines: dict[int, EngineProcess]
    test_dirs: dict[int, Path]
    reference: dict[tuple[int, ...], tuple[int, ...]]

    def generate(self, rank: int, prompt: list[int]) -> Any:
        (completion,) = self.engines[rank].generate([prompt], MAX_TOKENS)
        return completion

    def rank_stats(self, rank: int) -> list[Any]:
        return self.cluster.call(self.groups[rank].rank_stats())

    def wait_published(self, keys: list[bytes], for_rank: int) -> None:
        self.cluster.wait_published(keys, for_rank, timeout=60.0)

    def faults(
        self, rank: int, *methods: str
    ) -> contextlib.AbstractContextManager[None]:
        """Make the listed connector-half methods of replica ``rank`` raise."""
        return injected_faults(self.test_dirs[rank], *methods)


def reference_outputs() -> dict[tuple[int, ...], tuple[int, ...]]:
    engine = EngineProcess(
        "tp2-reference",
        engine_kwargs(model_path(), tensor_parallel_size=TP),
        env=CPU_BIND,
    ).start()
    try:
        engine.wait_ready()
        outputs = engine.generate(PROMPTS, MAX_TOKENS)
    finally:
        engine.stop()
    return {tuple(p): c.token_ids for p, c in zip(PROMPTS, outputs, strict=True)}


def start_replica(
    cluster: XavierCluster, rank: int, address: str, test_dir: Path
) -> tuple[TransferActorGroup, EngineProcess]:
    config = TransferActorConfig(
        model_uid=MODEL_UID,
        rank=rank,
        tracker_address=cluster.address,
        tracker_uid=cluster.tracker_uid,
        rpc_timeout_s=cluster.rpc_timeout_s,
        tp_size=TP,
    )
    group = cluster.call(TransferActorGroup.create(config, address), 120)
    cluster.transfer_addresses[rank] = address
    settings = cluster.replica_settings(rank)
    settings["tensor_parallel_size"] = TP
    engine = EngineProcess(
        f"tp2-replica-{rank}",
        engine_kwargs(
            model_path(), settings, test_dir=test_dir, tensor_parallel_size=TP
        ),
        env=CPU_BIND,
    ).start()
    return group, engine


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    reference = reference_outputs()
    cluster = XavierCluster(MODEL_UID, rpc_timeout_s=10.0)
    addresses = cluster.call(xo.get_pool_config(cluster.address))
    sub_pools = list(addresses.get_external_addresses())[1:]
    groups: dict[int, TransferActorGroup] = {}
    engines: dict[int, EngineProcess] = {}
    test_dirs = {rank: Path(tempfile.mkdtemp(prefix=f"tp2-{rank}-")) for rank in (0, 1)}
    try:
        for rank in (0, 1):
            groups[rank], engines[rank] = start_replica(
                cluster, rank, sub_pools[rank], test_dirs[rank]
            )
        for rank in (0, 1):
            engines[rank].wait_ready()
        deployment = Deployment(cluster, groups, engines, test_dirs, reference)
        # a warm-up request each (see platform-notes), and the mapping of every rank
        deadline = time.monotonic() + 120
        for rank in (0, 1):
            deployment.generate(rank, tokens(90 + rank, 40))
            while not cluster.call(groups[rank].stats()).mapped:
                assert time.monotonic() < deadline, f"replica {rank} never mapped"
                deployment.generate(rank, tokens(95 + rank, 8))
            deployment.generate(rank, tokens(97 + rank, 8))
        yield deployment
    finally:
        for engine in engines.values():
            engine.stop()
        for group in groups.values():
            with contextlib.suppress(Exception):
                cluster.call(group.close(), 60)
        cluster.close()


def test_every_rank_loads_its_shard_and_outputs_equal_recompute(deployment):
    first = deployment.generate(0, PROMPT_A)
    assert first.token_ids == deployment.reference[tuple(PROMPT_A)]
    keys = hash_full_blocks(PREFIX, BLOCK_SIZE, NAMESPACE)
    deployment.wait_published(keys, for_rank=1)
    before = deployment.rank_stats(1)

    second = deployment.generate(1, PROMPT_B)
    assert xavier_external_tokens(second) == len(PREFIX)
    assert second.token_ids == deployment.reference[tuple(PROMPT_B)]
    after = deployment.rank_stats(1)
    # a remote hit on every rank: each loaded the 4 blocks' shard it holds
    for tp_rank in range(TP):
        loaded = (
            after[tp_rank].actor.cpu_tier_blocks_loaded
            - before[tp_rank].actor.cpu_tier_blocks_loaded
        )
        assert loaded == len(keys), f"tp rank {tp_rank} loaded {loaded} blocks"
    # and the holder served each rank from the same rank
    served = [s.actor.cpu_rows_served for s in deployment.rank_stats(0)]
    assert served[0] == served[1] > 0


def test_one_rank_s_failed_load_is_recomputed_on_every_rank(deployment):
    first = deployment.generate(0, PROMPT_F_A)
    assert first.token_ids == deployment.reference[tuple(PROMPT_F_A)]
    deployment.wait_published(hash_full_blocks(PREFIX_F, BLOCK_SIZE, NAMESPACE), 1)
    before = deployment.rank_stats(1)
    with deployment.faults(1, "start_load_kv@tp1"):
        second = deployment.generate(1, PROMPT_F_B)
    after = deployment.rank_stats(1)
    assert second.token_ids == deployment.reference[tuple(PROMPT_F_B)]
    # rank 1 contained the fault and loaded nothing; rank 0's part loaded, yet the
    # request's blocks were recomputed: the outputs above could not equal the
    # reference if rank 1's heads had stayed unwritten
    assert after[1].actor.connector_faults > before[1].actor.connector_faults
    assert after[1].actor.loads_started == before[1].actor.loads_started
    assert after[0].actor.loads_started == before[0].actor.loads_started + 1


def test_killing_one_rank_s_process_stops_the_replica(deployment):
    engine = deployment.engines[1]
    workers = [
        child
        for child in psutil.Process(engine.pid).children(recursive=True)
        if "_TP1" in " ".join(child.cmdline())
    ]
    assert len(workers) == 1, [c.cmdline() for c in workers]
    os.kill(workers[0].pid, signal.SIGKILL)
    with pytest.raises(EngineFailed):
        deployment.engines[1].generate([PROMPT_B], MAX_TOKENS, timeout=120)
    # the other replica serves on
    again = deployment.generate(0, PROMPT_A)
    assert again.token_ids == deployment.reference[tuple(PROMPT_A)]
