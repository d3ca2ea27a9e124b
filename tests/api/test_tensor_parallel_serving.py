"""Two Xavier replicas of tensor_parallel_size 2 through the user's path.

A real ``xinference local`` server launches them over HTTP (``tensor_parallel_size
2``: the launcher binds each CPU rank's threads, ``VLLM_CPU_OMP_THREADS_BIND``, and
gives each replica a transfer actor per engine rank). A prompt computed on one
replica is loaded by the other, every engine rank its own shard (the ``tp_rank``
series of ``/metrics``), with the holder's output; then one engine rank's process
of the loader is killed, and the replica is marked gone.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xinference.deploy.demo import Workload
from xinference.model.llm.tiny_model import build_tiny_qwen2

from ..deploy.local_server import LocalServer
from .test_faults import complete, listed, replica_processes, state_of, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

UID = "tp2"
WORKLOAD = Workload(groups=1, per_group=3, max_tokens=16, prefix_words=240)
PROMPTS = WORKLOAD.prompts()
NOTICE_BOUND_S = 10.0  # as tests/api/test_faults.py: 1 s interval + 5 s probe


def rank_hits(endpoint: str, rank: int) -> dict[str, float]:
    """tp_rank -> block shards replica ``rank`` loaded from peers."""
    text = httpx.get(f"{endpoint}/metrics").text
    hits: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "xavier_rank_remote_hits_total"
                and labels.get("model_uid") == UID
                and labels.get("rank") == str(rank)
            ):
                hits[labels["tp_rank"]] = sample.value
    return hits


def test_tensor_parallel_replicas_share_kv_and_a_dead_rank_is_noticed(
    server: LocalServer,
) -> None:
    model = build_tiny_qwen2(
        Path(tempfile.gettempdir()) / "xavier-tiny-qwen2-kv4", num_key_value_heads=4
    )
    with httpx.Client(base_url=server.endpoint, timeout=900) as http:
        response = http.post(
            "/v1/models",
            json=dict(
                model_path=str(model),
                model_uid=UID,
                replica=2,
                enable_xavier=True,
                tensor_parallel_size=2,
                block_size=32,
                max_model_len=2048,
                enforce_eager=True,
                dtype="float32",
            ),
        )
        assert response.status_code == 200, response.text
        deployment: dict[str, Any] = response.json()
        try:
            first = complete(http, UID, PROMPTS[0])
            assert first.status == 200, first
            holder = first.replica
            wait_until(
                lambda: http.post(
                    f"/v1/models/{UID}/prefix", json={"prompt": PROMPTS[1]}
                ).json()["prefix_blocks"]
                >= 4,
                30,
                "prefix published",
            )
            # round robin: the next requests go to the other replica too
            outcomes = [complete(http, UID, PROMPTS[1]) for _ in range(2)]
            assert all(o.status == 200 for o in outcomes), outcomes
            assert {o.replica for o in outcomes} == {0, 1}
            assert outcomes[0].text == outcomes[1].text  # loaded == computed
            loader = 1 - holder
            hits = rank_hits(server.endpoint, loader)
            assert set(hits) == {"0", "1"} and hits["0"] == hits["1"] >= 4, hits

            # one engine rank of the loader dies: its replica is gone
            workers = [
                p
                for p in replica_processes(deployment, loader)
                if "_TP1" in " ".join(p.cmdline())
            ]
            assert len(workers) == 1, [p.cmdline() for p in workers]
            workers[0].kill()
            killed = time.monotonic()
            wait_until(
                lambda: state_of(http, UID, loader).startswith("gone"),
                NOTICE_BOUND_S,
                "a dead engine rank noticed",
            )
            print(f"noticed after {time.monotonic() - killed:.1f} s")
            assert "degraded" in listed(server.endpoint)
            survivor = complete(http, UID, PROMPTS[2])
            assert survivor.status == 200 and survivor.replica == holder, survivor
        finally:
            http.delete(f"/v1/models/{UID}")
