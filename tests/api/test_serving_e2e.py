"""End to end: a real server, real vLLM CPU engines, the CLI, REST and HTTP serving.

Three deployments of the tiny offline model, one after the other (never more than
two engines alive):

- Xavier on, launched with the CLI by registry name, terminated with the CLI;
- Xavier off, launched with the REST API (Python client) by path, terminated with
  the REST API;
- routing only (Xavier on with remote loads off), launched with the REST API.

Both serve the same shared-prefix workload through the OpenAI-compatible API. Round
robin sends each group's second request to the replica that has not seen the
prefix: with Xavier it must load the prefix from the first replica (metrics show
remote hits), and every output must equal the Xavier-off run's.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from xinference.client import Client
from xinference.core.registry import resolve_model
from xinference.deploy.cmdline import cli
from xinference.deploy.demo import Workload
from xinference.model.llm.vllm.xavier.connector.totals_report import REPORTED_WITHIN_S

from ..deploy.local_server import LocalServer, wait_for_no_descendants

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL_NAME = "tiny-qwen2"
GPU_CACHE = "64MiB"
# float32: in bf16, vLLM's CPU outputs change with the mere presence of a KV connector
# (see xinference/deploy/demo.py), which would hide what this test checks.
DTYPE = "float32"
ENGINE_OPTIONS = [
    "--block-size",
    "32",
    "--max-model-len",
    "2048",
    "--enforce-eager",
    "--dtype",
    DTYPE,
]
WORKLOAD = Workload(groups=3, per_group=2, max_tokens=16, prefix_words=240)
PREFIX_BLOCKS = 8  # each group's prefix covers at least this many 32-token blocks
CHAT = [{"role": "user", "content": "name three syllables " * 12}]
# Chats that share a system prompt (``serve_two_way_chats``): several blocks of
# it, then questions of a few blocks each, so that what one replica computes
# after the shared blocks is a run another replica can load.
SYSTEM = {
    "role": "system",
    "content": "You are a careful assistant for a garden shop. "
    + "Answer briefly, name the plant, its season and its water needs. " * 6,
}


def question(topic: str) -> dict[str, str]:
    return {
        "role": "user",
        "content": f"Tell me about {topic}: " + f"when to plant {topic}, " * 10,
    }


EXIT_TIMEOUT_S = 60.0


@dataclass
class Run:
    """What one deployment did, gathered while it was up."""

    launch_output: str = ""
    deployment: dict[str, Any] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)
    listed: Any = None
    texts: list[str] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    # X-Xinference-Xavier-External-Tokens and -Holder of each workload response
    external_tokens: list[int] = field(default_factory=list)
    holders: list[str | None] = field(default_factory=list)
    stream_text: str = ""
    chat_text: str = ""
    # serve_two_way_chats: per chat, (replica, external tokens, holder, text)
    two_way: list[tuple[int, int, str | None, str]] = field(default_factory=list)
    two_way_metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(
        default_factory=dict
    )
    # after the engine processes' totals had time to reach the actors
    reported_metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(
        default_factory=dict
    )
    prefix_lookups: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(
        default_factory=dict
    )
    terminate_output: Any = None
    launched_processes: set[int] = field(default_factory=set)
    leftovers: set[int] = field(default_factory=set)


def serve_workload(
    server: LocalServer, uid: str, run: Run, *, xavier: bool, two_way: bool = False
) -> None:
    with httpx.Client(base_url=server.endpoint, timeout=120) as http:
        for index, prompt in enumerate(WORKLOAD.prompts()):
            if xavier and index % WORKLOAD.per_group:
                # The group's first request returned; its replica publishes the
                # prefix in the background, so wait until peers can find it.
                wait_published(http, uid, WORKLOAD.prompts()[index - 1])
            response = http.post(
                "/v1/completions",
                json=dict(
                    model=uid,
                    prompt=prompt,
                    max_tokens=WORKLOAD.max_tokens,
                    temperature=0,
                ),
            )
            assert response.status_code == 200, response.text
            body = response.json()
            run.texts.append(body["choices"][0]["text"])
            run.replicas.append(int(response.headers["x-xinference-replica"]))
            run.cached_tokens.append(
                body["usage"]["prompt_tokens_details"]["cached_tokens"]
            )
            headers = response.headers
            run.external_tokens.append(
                int(headers["x-xinference-xavier-external-tokens"])
            )
            run.holders.append(headers.get("x-xinference-xavier-holder"))
        with http.stream(
            "POST",
            "/v1/completions",
            json=dict(
                model=uid,
                prompt=WORKLOAD.prompts()[0],
                max_tokens=WORKLOAD.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ),
        ) as response:
            assert response.status_code == 200
            events = [
                json.loads(line[5:])
                for line in response.iter_lines()
                if line.startswith("data:") and not line.endswith("[DONE]")
            ]
        run.stream_text = "".join(c["text"] for e in events for c in e["choices"])
        assert events[-1]["usage"]["completion_tokens"] == WORKLOAD.max_tokens
        response = http.post(
            "/v1/chat/completions",
            json=dict(model=uid, messages=CHAT, max_tokens=8, temperature=0),
        )
        assert response.status_code == 200, response.text
        run.chat_text = response.json()["choices"][0]["message"]["content"]
        if xavier:
            for prompt in WORKLOAD.prompts()[:: WORKLOAD.per_group]:
                response = http.post(
                    f"/v1/models/{uid}/prefix", json={"prompt": prompt}
                )
                assert response.status_code == 200, response.text
                run.prefix_lookups.append(response.json())
        run.metrics = scrape(http)
        if two_way:
            serve_two_way_chats(http, uid, run, xavier=xavier)
            run.two_way_metrics = scrape(http)
            if xavier:
                # What the engine processes counted reaches the actors within
                # REPORTED_WITHIN_S of the last move (the last chat's staging);
                # the margin is for a loaded machine's loop.
                time.sleep(REPORTED_WITHIN_S + 2.0)
                run.reported_metrics = scrape(http)


def scrape(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples[(sample.name, labels)] = sample.value
    return samples


def chat_on_replica(
    http: httpx.Client, uid: str, replica: int, messages: list[dict[str, str]]
) -> httpx.Response:
    """A greedy chat served by ``replica``: round robin alternates the two
    replicas, so a one-token probe first when the next turn is the other's."""
    for _ in range(2):
        probe = http.post(
            "/v1/completions",
            json=dict(model=uid, prompt="probe", max_tokens=1, temperature=0),
        )
        assert probe.status_code == 200, probe.text
        if int(probe.headers["x-xinference-replica"]) != replica:
            break
    response = http.post(
        "/v1/chat/completions",
        json=dict(model=uid, messages=messages, max_tokens=8, temperature=0),
    )
    assert response.status_code == 200, response.text
    assert int(response.headers["x-xinference-replica"]) == replica
    return response


def serve_two_way_chats(
    http: httpx.Client, uid: str, run: Run, *, xavier: bool
) -> None:
    """Chats sharing a system prompt, each on a chosen replica, so that KV must
    move both ways: 0 computes the system prompt; 1 loads it and computes its
    question; 0 asks 1's question and loads it from 1; a conversation's first
    turn on 1, its second on 0, which loads the first turn from 1."""

    def chat(replica: int, messages: list[dict[str, str]], wait: bool) -> None:
        response = chat_on_replica(http, uid, replica, messages)
        headers, body = response.headers, response.json()
        run.two_way.append(
            (
                replica,
                int(headers["x-xinference-xavier-external-tokens"]),
                headers.get("x-xinference-xavier-holder"),
                body["choices"][0]["message"]["content"],
            )
        )
        if xavier and wait:
            # Until peers can find what it published: the run from the first
            # block it computed (it had the cached ones, its own or loaded).
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            wait_listed(http, uid, messages, replica, cached // 32)

    chat(0, [SYSTEM, question("basil")], wait=True)
    chat(1, [SYSTEM, question("tulips")], wait=True)
    chat(0, [SYSTEM, question("tulips")], wait=False)
    first_turn = [SYSTEM, question("roses")]
    chat(1, first_turn, wait=True)
    answer = {"role": "assistant", "content": run.two_way[-1][3]}
    chat(0, [*first_turn, answer, question("ferns")], wait=False)


def wait_listed(
    http: httpx.Client,
    uid: str,
    messages: list[dict[str, str]],
    holder: int,
    after_blocks: int,
) -> None:
    """Until the tracker lists ``holder`` for the run of ``messages``'s blocks
    from ``after_blocks`` on (the blocks it computed itself)."""
    deadline = time.monotonic() + 30.0
    while True:
        response = http.post(
            f"/v1/models/{uid}/prefix",
            json={"messages": messages, "after_blocks": after_blocks},
        )
        assert response.status_code == 200, response.text
        found = response.json()
        if found["holder"] == holder and found["prefix_blocks"] > after_blocks + 1:
            return
        assert time.monotonic() < deadline, f"not published by {holder}: {found}"
        time.sleep(0.05)


def wait_published(http: httpx.Client, uid: str, prompt: str) -> None:
    deadline = time.monotonic() + 30.0
    while True:
        response = http.post(f"/v1/models/{uid}/prefix", json={"prompt": prompt})
        assert response.status_code == 200, response.text
        if response.json()["prefix_blocks"] >= PREFIX_BLOCKS:
            return
        assert time.monotonic() < deadline, f"prefix not published: {response.json()}"
        time.sleep(0.05)


def metric(run: Run, name: str, rank: int, **labels: str) -> float:
    """Sum of ``name`` over the samples of ``rank`` that carry ``labels``."""
    total = 0.0
    for (sample, sample_labels), value in run.metrics.items():
        found = dict(sample_labels)
        if sample == name and found.get("rank") == str(rank):
            if all(found.get(k) == v for k, v in labels.items()):
                total += value
    return total


@pytest.fixture(scope="module")
def xavier_run(server: LocalServer) -> Run:
    """Xavier on: CLI launch by registry name, workload, CLI terminate."""
    run = Run()
    baseline = server.descendants()
    runner = CliRunner()
    invoke = [
        "--endpoint",
        server.endpoint,
        "launch",
        "--model-name",
        MODEL_NAME,
        "--replica",
        "2",
        "--enable-xavier",
        "--xavier-gpu-cache-bytes",
        GPU_CACHE,
        # explicit: the switch must reach the replica processes (and wins over
        # an XAVIER_FAST_PATH the test host may have set)
        "--no-xavier-fast-path",
        *ENGINE_OPTIONS,
    ]
    result = runner.invoke(cli, invoke)
    run.launch_output = result.output
    assert result.exit_code == 0, f"{result.output}\n{server.tail()}"
    try:
        with Client(server.endpoint) as client:
            run.deployment = client.describe_model(MODEL_NAME)
            run.reports = client.replica_reports(MODEL_NAME)
        run.launched_processes = server.descendants() - baseline
        run.listed = runner.invoke(cli, ["--endpoint", server.endpoint, "list"]).output
        serve_workload(server, MODEL_NAME, run, xavier=True, two_way=True)
    finally:
        run.terminate_output = runner.invoke(
            cli, ["--endpoint", server.endpoint, "terminate", "--model-uid", MODEL_NAME]
        )
    run.leftovers = wait_for_no_descendants(server, baseline, EXIT_TIMEOUT_S)
    return run


def launch_by_rest(
    server: LocalServer,
    run: Run,
    xavier: bool,
    two_way: bool = False,
    **options: Any,
) -> None:
    """Launch by path through the REST API, serve the workload, terminate."""
    baseline = server.descendants()
    model_path = str(resolve_model(MODEL_NAME, server.workdir))
    with Client(server.endpoint) as client:
        run.deployment = client.launch_model_detailed(
            model_path=model_path,
            replica=2,
            block_size=32,
            max_model_len=2048,
            enforce_eager=True,
            dtype=DTYPE,
            **options,
        )
        uid = run.deployment["model_uid"]
        try:
            run.reports = client.replica_reports(uid)
            run.launched_processes = server.descendants() - baseline
            run.listed = client.list_models()
            serve_workload(server, uid, run, xavier=xavier, two_way=two_way)
        finally:
            run.terminate_output = client.terminate_model(uid)
    run.leftovers = wait_for_no_descendants(server, baseline, EXIT_TIMEOUT_S)


@pytest.fixture(scope="module")
def plain_run(server: LocalServer) -> Run:
    """Xavier off: REST launch by path, workload, REST terminate. (Module fixtures
    run one after the other: the Xavier deployment is gone by now.)"""
    run = Run()
    launch_by_rest(server, run, xavier=False, two_way=True)
    return run


@pytest.fixture(scope="module")
def routing_only_run(server: LocalServer) -> Run:
    """Xavier on with remote loads off (the routing-only baseline), round robin so
    that each group's second request lands where a load would happen."""
    run = Run()
    launch_by_rest(
        server,
        run,
        xavier=True,
        model_uid="routing-only",
        enable_xavier=True,
        xavier_remote_loads=False,
    )
    return run


# ---- Xavier on: launch through the CLI ---------------------------------------------


def test_cli_launch_states_the_xavier_settings(xavier_run: Run) -> None:
    # progress while the engines load, then the uid and the Xavier line
    assert "loading 2 engine(s)" in xavier_run.launch_output
    assert f"Model uid: {MODEL_NAME}" in xavier_run.launch_output
    assert (
        "Xavier: on, GPU-first, device budget 67108864 bytes, transport nixl"
        in xavier_run.launch_output
    )
    assert "fast path off" in xavier_run.launch_output  # --no-xavier-fast-path
    # the UCX transports the replicas may use (the CPU test host has no CUDA)
    ucx = "(set by you)" if os.environ.get("UCX_TLS") else "UCX picks its transports"
    assert ucx in xavier_run.launch_output
    assert "replica 0: nixl://" in xavier_run.launch_output
    assert "replica 1: nixl://" in xavier_run.launch_output
    assert "Xavier: on" in xavier_run.listed and "2/2" in xavier_run.listed


def test_options_arrive_in_each_replica_process(
    xavier_run: Run, server: LocalServer
) -> None:
    """Asked of each replica's own process: what its engine's connector config
    carries, and the environment it runs with."""
    replicas = {r["rank"]: r for r in xavier_run.deployment["replicas"]}
    # The CPU test host has no CUDA: UCX_TLS only where the user set it.
    expected_tls = os.environ.get("UCX_TLS")
    assert [r["rank"] for r in xavier_run.reports] == [0, 1]
    for report in xavier_run.reports:
        rank = report["rank"]
        # a process of its own, started by the server for this deployment
        assert report["pid"] != server.pid
        assert report["pid"] in xavier_run.launched_processes
        assert report["xavier"] == {
            "enabled": True,
            "gpu_cache_bytes": 64 * 1024 * 1024,
            "transport": "nixl",  # the default
            "cross_layer_blocks": False,
            "remote_loads": True,  # the default
            "fast_path": False,  # --no-xavier-fast-path, carried as given
            "model_uid": MODEL_NAME,
            "rank": rank,
            # the tracker relay of the replica's worker (core/tracker_relays.py)
            "tracker_address": replicas[rank]["worker"],
            "tracker_uid": f"xavier-tracker-relay-{MODEL_NAME}",
            "transfer_address": replicas[rank]["address"],
            "transfer_uid": f"xavier-transfer-{MODEL_NAME}-{rank}",
            "rpc_timeout_s": 10.0,
            "tensor_parallel_size": 1,  # one engine rank per replica here
        }
        assert report["xavier"]["transfer_address"].startswith("nixl://")
        assert report["kv_connector"] == "XavierConnector"
        assert (
            report["kv_connector_module_path"]
            == "xinference.model.llm.vllm.xavier.connector.vllm_facade"
        )
        assert report["disable_hybrid_kv_cache_manager"] is True
        assert "UCX_MEMTYPE_CACHE" not in report["env"]
        assert report["env"].get("UCX_TLS") == expected_tls
        assert report["transfer_actor_alive"] is True
        assert report["block_size"] == 32
    assert xavier_run.reports[0]["pid"] != xavier_run.reports[1]["pid"]


def test_second_replica_serves_the_shared_prefix_from_the_first(
    xavier_run: Run,
) -> None:
    # round robin: each group's first request on replica 0, second on replica 1
    assert xavier_run.replicas == [0, 1] * WORKLOAD.groups
    second = xavier_run.cached_tokens[1 :: WORKLOAD.per_group]
    assert all(tokens >= PREFIX_BLOCKS * 32 for tokens in second), second
    # each response says what Xavier loaded for it, and from whom
    loaded = xavier_run.external_tokens[1 :: WORKLOAD.per_group]
    assert all(
        PREFIX_BLOCKS * 32 <= n <= c for n, c in zip(loaded, second, strict=True)
    ), loaded
    assert xavier_run.holders[1 :: WORKLOAD.per_group] == ["0"] * WORKLOAD.groups
    assert xavier_run.external_tokens[:: WORKLOAD.per_group] == [0] * WORKLOAD.groups
    assert xavier_run.holders[:: WORKLOAD.per_group] == [None] * WORKLOAD.groups
    hits = metric(xavier_run, "xavier_remote_hits_total", 1)
    assert hits >= PREFIX_BLOCKS * WORKLOAD.groups
    assert metric(xavier_run, "xavier_external_tokens_loaded_total", 1) == hits * 32
    assert metric(xavier_run, "xavier_load_errors_total", 1) == 0
    # replica 0 computed every prefix itself
    assert metric(xavier_run, "xavier_remote_hits_total", 0) == 0
    # the default transport READs exactly the payload: wire bytes equal useful bytes
    useful = metric(xavier_run, "xavier_received_useful_bytes_total", 1)
    assert useful > 0
    assert metric(xavier_run, "xavier_received_wire_bytes_total", 1) == useful


def test_sharing_runs_both_ways_across_chats_and_turns(xavier_run: Run) -> None:
    """With a shared system prompt, what replica 1 computes after the blocks it
    loaded from replica 0 is published, and replica 0 loads it: in the same
    chat, and in a conversation's second turn. Before, a replica published
    nothing after loaded blocks and lookups needed one holder of everything from
    block 0, so replica 0 recomputed both."""
    served = [(replica, holder) for replica, _, holder, _ in xavier_run.two_way]
    assert served == [(0, None), (1, "0"), (0, "1"), (1, None), (0, "1")]
    loaded = [tokens for _, tokens, _, _ in xavier_run.two_way]
    assert loaded[0] == loaded[3] == 0 and all(n >= 64 for n in loaded[1:3]), loaded
    assert loaded[4] >= 64, loaded
    before, after = xavier_run.metrics, xavier_run.two_way_metrics
    for rank in (0, 1):  # hits per pair: each replica loaded from the other
        gained = sum(
            value - before.get(key, 0.0)
            for key, value in after.items()
            if key[0] == "xavier_remote_hits_total" and ("rank", str(rank)) in key[1]
        )
        assert gained >= 2, (rank, gained)


def test_the_connector_reports_its_staging_and_its_engine_time(
    xavier_run: Run,
) -> None:
    """Counted in the engine process, reported to the transfer actor within
    seconds: a scrape that long after the last chat has every replica's staging
    (one may have computed nothing before the chats: routing decides)."""
    run = Run(metrics=xavier_run.reported_metrics)
    for rank in (0, 1):
        assert metric(run, "xavier_staged_blocks_total", rank) > 0
        assert metric(run, "xavier_stage_skipped_blocks_total", rank) == 0
        for half in ("scheduler", "worker"):
            seconds = metric(run, "xavier_engine_thread_seconds_total", rank, half=half)
            assert seconds > 0, (rank, half)


def test_router_keys_match_what_the_replicas_registered(xavier_run: Run) -> None:
    """The front end hashes prompts the way the connector does: the tracker knows
    every group's prefix under the keys the cache-aware router would look up."""
    for lookup in xavier_run.prefix_lookups:
        assert lookup["holder"] in (0, 1)
        assert lookup["prefix_blocks"] >= PREFIX_BLOCKS


def test_cli_terminate_prints_a_summary_and_leaves_no_process(xavier_run: Run) -> None:
    result = xavier_run.terminate_output
    assert result.exit_code == 0, result.output
    assert f"Terminated {MODEL_NAME}" in result.output
    # a short human summary per replica, not the raw counters
    lines = result.output.splitlines()
    summaries = [line for line in lines if " Xavier: hits " in line]
    assert [line.split(" Xavier:")[0] for line in summaries] == [
        "  replica 0",
        "  replica 1",
    ], result.output
    assert "faults: " in summaries[1]
    assert re.search(r"\d+ loads?: \d+ through the transfer actor \(p50 ", summaries[1])
    assert all(len(line) < 300 for line in lines), result.output
    assert "buckets" not in result.output
    assert len(xavier_run.launched_processes) >= 2  # sub-pools and their engines
    assert xavier_run.leftovers == set()


# ---- Xavier off: launch through REST -----------------------------------------------


def test_rest_launch_serves_without_xavier(plain_run: Run) -> None:
    assert plain_run.deployment["xavier"] == "Xavier: off"
    assert list(plain_run.listed) == [MODEL_NAME]
    assert plain_run.listed[MODEL_NAME]["status"] == "ready"
    for report in plain_run.reports:
        assert report["xavier"] is None
        assert report["kv_connector"] is None
        assert report["pid"] in plain_run.launched_processes
    assert plain_run.replicas == [0, 1] * WORKLOAD.groups
    # without Xavier the second replica computes the prefix itself
    assert plain_run.cached_tokens[1 :: WORKLOAD.per_group] == [0] * WORKLOAD.groups
    assert plain_run.external_tokens == [0] * len(plain_run.external_tokens)
    assert set(plain_run.holders) == {None}


def test_rest_terminate_leaves_no_process(plain_run: Run) -> None:
    assert plain_run.terminate_output == {
        "model_uid": MODEL_NAME,
        "xavier_counters": {},
    }
    assert plain_run.leftovers == set()


def test_outputs_equal_with_and_without_xavier(xavier_run: Run, plain_run: Run) -> None:
    assert xavier_run.texts == plain_run.texts
    assert all(xavier_run.texts)
    assert xavier_run.stream_text == plain_run.stream_text == xavier_run.texts[0]
    assert xavier_run.chat_text == plain_run.chat_text
    assert [chat[3] for chat in xavier_run.two_way] == [
        chat[3] for chat in plain_run.two_way
    ]


# ---- routing only: Xavier publishes, nobody loads -----------------------------------


def test_routing_only_never_loads_yet_publishes_the_holder(
    routing_only_run: Run, plain_run: Run
) -> None:
    run = routing_only_run
    assert "remote loads off (routing only)" in run.deployment["xavier"]
    assert [r["xavier"]["remote_loads"] for r in run.reports] == [False, False]
    # round robin put each group's second request on the replica without the prefix
    assert run.replicas == [0, 1] * WORKLOAD.groups
    # ... which computed it: nothing was loaded, from anyone
    assert run.cached_tokens[1 :: WORKLOAD.per_group] == [0] * WORKLOAD.groups
    assert run.external_tokens == [0] * len(run.external_tokens)
    assert set(run.holders) == {None}
    for rank in (0, 1):
        assert metric(run, "xavier_remote_hits_total", rank) == 0
    # yet the tracker knows who holds every prefix (what the cache-aware router asks)
    assert len(run.prefix_lookups) == WORKLOAD.groups
    for lookup in run.prefix_lookups:
        assert lookup["holder"] in (0, 1)
        assert lookup["prefix_blocks"] >= PREFIX_BLOCKS
    assert run.texts == plain_run.texts
    assert run.leftovers == set()
