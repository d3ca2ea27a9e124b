"""A cluster on one machine: supervisor and two workers as separate processes on
distinct loopback addresses (127.0.0.1, .2, .3), real vLLM CPU engines.

One scenario, run once (module fixture), then checked piece by piece:

1. a 2-replica Xavier deployment spreads one replica per worker; each replica's
   sub-pool (and its transfer actor) runs under its own worker's process;
2. a prompt served by the replica on one worker, sent again, is served by the
   replica on the other worker with its prefix loaded from the first, and the
   output equals the first replica's (which computed everything);
3. the worker of the prefix's holder is killed, with its whole process tree (as a
   host that loses power), while two clients send requests: each request completes
   correctly or fails fast with a clear error; the supervisor marks the replica
   gone within the heartbeat bound, the tracker forgets it, and every later
   request is served by the survivor; a prefix only the lost replica held, asked
   for right after the kill, is recomputed by the survivor without waiting;
4. the worker comes back on the same address, registers, and a new 2-replica
   deployment spans both workers again, now with Xavier's xoscar transport: a
   prefix computed on one worker is loaded on the other.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pytest
from click.testing import CliRunner

from xinference.client import Client
from xinference.deploy.cmdline import cli
from xinference.deploy.demo import Workload

from .cluster_nodes import free_port, node_env, supervisor_node, worker_node

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL_NAME = "tiny-qwen2"
SUPERVISOR_HOST = "127.0.0.1"
WORKER_HOSTS = ("127.0.0.2", "127.0.0.3")
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 5.0
# The supervisor's bound is timeout + interval; the rest is slack for a busy CI host.
GONE_BOUND_S = HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S + 4.0
FAIL_FAST_S = 15.0  # a request to a dead replica must fail sooner than this
ENGINE = dict(
    block_size=32,
    max_model_len=2048,
    enforce_eager=True,
    dtype="float32",  # see test_serving_e2e: bf16 CPU outputs vary with a connector
)
PREFIX_BLOCKS = 8
WORKLOAD = Workload(groups=2, per_group=1, max_tokens=12, prefix_words=240)
TRAFFIC_PROMPT = "count the shapes: circle square triangle " * 4


@dataclass
class Outcome:
    status: int
    seconds: float
    text: str = ""
    replica: int | None = None
    detail: str = ""
    after_gone: bool = False


@dataclass
class Scenario:
    workers: dict[str, str] = field(default_factory=dict)  # host -> address
    worker_pids: dict[str, int] = field(default_factory=dict)  # host -> pid
    deployment: dict[str, Any] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)
    report_parents: dict[int, str] = field(default_factory=dict)  # rank -> host
    listed: str = ""
    # step 2: (first response, second response) per prompt
    pairs: list[tuple[httpx.Response, httpx.Response]] = field(default_factory=list)
    holder_before: dict[str, Any] = field(default_factory=dict)
    stats: list[dict[str, Any]] = field(default_factory=list)
    # the loaders' peer checks, as the workers logged them
    peer_checks: list[str] = field(default_factory=list)
    # step 3
    victim_rank: int = -1
    victim_host: str = ""
    orphan_reference: str = ""  # the victim's output for a prefix only it computed
    orphan_outcomes: list[Outcome] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    reference: str = ""
    gone_after_s: float | None = None
    gone: dict[str, str] = field(default_factory=dict)
    holder_after: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    listed_after: str = ""
    workers_after: list[dict[str, Any]] = field(default_factory=list)
    terminate_seconds: float = 0.0
    # step 4
    rejoined: list[dict[str, Any]] = field(default_factory=list)
    relaunched: dict[str, Any] = field(default_factory=dict)
    relaunched_response: httpx.Response | None = None
    relaunched_pair: tuple[httpx.Response, httpx.Response] | None = None
    leftovers: list[int] = field(default_factory=list)


def completion(http: httpx.Client, uid: str, prompt: str, **extra: Any):
    return http.post(
        "/v1/completions",
        json=dict(model=uid, prompt=prompt, max_tokens=12, temperature=0) | extra,
    )


def wait_until(predicate, timeout: float, what: str, step: float = 0.1) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(step)
    return time.monotonic() - started


def descendants_hosts(pid: int, nodes: dict[str, Any]) -> str | None:
    for host, node in nodes.items():
        if pid in {process.pid for process in node.tree()}:
            return host
    return None


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Scenario:
    workdir = tmp_path_factory.mktemp("cluster")
    env = node_env(workdir, str(HEARTBEAT_INTERVAL_S), str(HEARTBEAT_TIMEOUT_S))
    supervisor = supervisor_node(workdir, SUPERVISOR_HOST, env).start()
    endpoint = supervisor.announced
    ports = {host: free_port(host) for host in WORKER_HOSTS}
    nodes = {
        host: worker_node(
            workdir, f"worker-{host}", endpoint, host, ports[host], env
        ).start()
        for host in WORKER_HOSTS
    }
    run = Scenario()
    all_nodes = [supervisor, *nodes.values()]
    try:
        _run(run, endpoint, nodes, ports, workdir, env, all_nodes)
    except BaseException:
        for node in all_nodes:
            print(f"---- {node.name} ----\n{node.tail(80)}")
        raise
    finally:
        for node in [*nodes.values(), supervisor]:
            run.leftovers += node.stop()
    return run


def _run(run, endpoint, nodes, ports, workdir, env, all_nodes) -> None:
    http = httpx.Client(base_url=endpoint, timeout=120)
    wait_until(lambda: len(http.get("/v1/workers").json()) == 2, 30, "two workers")
    run.workers = {w["host"]: w["address"] for w in http.get("/v1/workers").json()}
    run.worker_pids = {host: node.pid for host, node in nodes.items()}

    # 1. one replica per worker
    with Client(endpoint, timeout=900) as client:
        run.deployment = client.launch_model_detailed(
            model_name=MODEL_NAME,
            replica=2,
            enable_xavier=True,
            xavier_gpu_cache_bytes="64MiB",
            **ENGINE,
        )
        run.reports = client.replica_reports(MODEL_NAME)
    for report in run.reports:
        run.report_parents[report["rank"]] = descendants_hosts(report["pid"], nodes)
    run.listed = CliRunner().invoke(cli, ["--endpoint", endpoint, "list"]).output

    # 2. a prefix computed on one worker, loaded on the other
    for prompt in WORKLOAD.prompts():
        first = completion(http, MODEL_NAME, prompt)
        assert first.status_code == 200, first.text
        wait_until(
            lambda prompt=prompt: http.post(
                f"/v1/models/{MODEL_NAME}/prefix", json={"prompt": prompt}
            ).json()["prefix_blocks"]
            >= PREFIX_BLOCKS,
            30,
            "the prefix to be published",
            0.05,
        )
        second = completion(http, MODEL_NAME, prompt)
        assert second.status_code == 200, second.text
        run.pairs.append((first, second))
    prompt = WORKLOAD.prompts()[0]
    run.holder_before = http.post(
        f"/v1/models/{MODEL_NAME}/prefix", json={"prompt": prompt}
    ).json()
    run.stats = http.get(f"/v1/models/{MODEL_NAME}/stats").json()
    run.peer_checks = [
        line
        for node in nodes.values()
        for line in node.log_path.read_text(errors="replace").splitlines()
        if "READ of" in line and "UCX transports for this peer" in line
    ]

    # 3. the holder's worker dies mid-traffic
    run.victim_rank = int(run.holder_before["holder"])
    by_rank = {r["rank"]: r for r in run.deployment["replicas"]}
    run.victim_host = by_rank[run.victim_rank]["worker"].rsplit(":", 1)[0]
    reference = completion(http, MODEL_NAME, TRAFFIC_PROMPT)
    assert reference.status_code == 200, reference.text
    run.reference = reference.json()["choices"][0]["text"]
    # a prefix only the victim computes: sequential requests alternate, so one of
    # two consecutive new prompts lands on it
    for prompt_index in (2, 3):
        orphan_prompt = Workload(groups=4, per_group=1, prefix_words=240).prompts()[
            prompt_index
        ]
        response = completion(http, MODEL_NAME, orphan_prompt)
        assert response.status_code == 200, response.text
        if int(response.headers["x-xinference-replica"]) == run.victim_rank:
            run.orphan_reference = response.json()["choices"][0]["text"]
            break
    wait_until(
        lambda: http.post(
            f"/v1/models/{MODEL_NAME}/prefix", json={"prompt": orphan_prompt}
        ).json()["holder"]
        == run.victim_rank,
        30,
        "the victim's prefix to be published",
        0.05,
    )
    gone_seen = threading.Event()
    stop = threading.Event()
    lock = threading.Lock()

    def client_loop() -> None:
        with httpx.Client(base_url=endpoint, timeout=120) as own:
            while not stop.is_set():
                started = time.monotonic()
                after = gone_seen.is_set()
                response = completion(own, MODEL_NAME, TRAFFIC_PROMPT)
                outcome = Outcome(
                    response.status_code, time.monotonic() - started, after_gone=after
                )
                if response.status_code == 200:
                    outcome.text = response.json()["choices"][0]["text"]
                    outcome.replica = int(response.headers["x-xinference-replica"])
                else:
                    outcome.detail = response.json().get("detail", response.text)
                with lock:
                    run.outcomes.append(outcome)

    clients = [threading.Thread(target=client_loop) for _ in range(2)]
    for thread in clients:
        thread.start()
    try:
        wait_until(lambda: len(run.outcomes) >= 4, 120, "traffic before the kill")
        killed_at = time.monotonic()
        run.killed = nodes[run.victim_host].kill_host()
        # At once, before the supervisor's verdict: the tracker still names the
        # dead replica as the prefix's holder. Served by the survivor, the load
        # from the dead holder must fail fast and the prefix be recomputed; routed
        # to the dead replica, the request fails fast.
        for _ in range(2):
            started = time.monotonic()
            response = completion(http, MODEL_NAME, orphan_prompt)
            outcome = Outcome(response.status_code, time.monotonic() - started)
            if response.status_code == 200:
                outcome.text = response.json()["choices"][0]["text"]
                outcome.replica = int(response.headers["x-xinference-replica"])
            else:
                outcome.detail = response.json().get("detail", response.text)
            run.orphan_outcomes.append(outcome)

        def gone() -> bool:
            body = http.get(f"/v1/models/{MODEL_NAME}").json()
            run.gone = body.get("gone", {})
            return str(run.victim_rank) in run.gone

        wait_until(gone, 60, "the replica to be marked gone", 0.1)
        run.gone_after_s = time.monotonic() - killed_at
        # give the front end its refresh period, then count what follows
        time.sleep(1.5)
        gone_seen.set()
        count = len(run.outcomes)
        wait_until(lambda: len(run.outcomes) >= count + 6, 120, "traffic after")
    finally:
        stop.set()
        for thread in clients:
            thread.join(150)
    run.holder_after = http.post(
        f"/v1/models/{MODEL_NAME}/prefix", json={"prompt": prompt}
    ).json()
    run.listed_after = CliRunner().invoke(cli, ["--endpoint", endpoint, "list"]).output
    run.workers_after = http.get("/v1/workers").json()
    started = time.monotonic()
    with Client(endpoint, timeout=300) as client:
        client.terminate_model(MODEL_NAME)
    run.terminate_seconds = time.monotonic() - started

    # 4. the worker comes back and serves again
    host = run.victim_host
    nodes[host] = worker_node(
        workdir, f"worker-{host}-again", endpoint, host, ports[host], env
    ).start()
    all_nodes.append(nodes[host])
    wait_until(lambda: len(http.get("/v1/workers").json()) == 2, 30, "the rejoin")
    run.rejoined = http.get("/v1/workers").json()
    # Xavier again across both workers, this time with the xoscar transport
    with Client(endpoint, timeout=900) as client:
        run.relaunched = client.launch_model_detailed(
            model_name=MODEL_NAME,
            model_uid="again",
            replica=2,
            enable_xavier=True,
            xavier_transport="xoscar",
            xavier_gpu_cache_bytes="64MiB",
            **ENGINE,
        )
        try:
            run.relaunched_response = completion(http, "again", TRAFFIC_PROMPT)
            prompt = WORKLOAD.prompts()[1]
            first = completion(http, "again", prompt)
            wait_until(
                lambda: http.post(
                    "/v1/models/again/prefix", json={"prompt": prompt}
                ).json()["prefix_blocks"]
                >= PREFIX_BLOCKS,
                30,
                "the prefix to be published",
                0.05,
            )
            run.relaunched_pair = (first, completion(http, "again", prompt))
        finally:
            client.terminate_model("again")
    http.close()


def host_of(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def test_replicas_spread_one_per_worker_each_in_its_workers_processes(scenario):
    replicas = scenario.deployment["replicas"]
    assert sorted(host_of(r["worker"]) for r in replicas) == sorted(WORKER_HOSTS)
    for replica in replicas:
        assert replica["worker"] == scenario.workers[host_of(replica["worker"])]
        # the sub-pool listens on its worker's host, with NIXL (Xavier)
        assert replica["address"].startswith("nixl://")
        assert host_of(replica["address"]) == host_of(replica["worker"])
        # and its process (engine, transfer actor) is under that worker's process
        assert scenario.report_parents[replica["rank"]] == host_of(replica["worker"])
    by_rank = {replica["rank"]: replica for replica in replicas}
    for report in scenario.reports:
        # the transfer actor lives in the replica's own sub-pool, on its worker
        assert report["transfer_actor_alive"] is True
        assert (
            report["xavier"]["transfer_address"] == by_rank[report["rank"]]["address"]
        )
        # the replica reaches the block tracker (on the supervisor's side) through
        # its worker's tracker relay
        assert report["xavier"]["tracker_address"] == by_rank[report["rank"]]["worker"]
    for replica in replicas:
        assert f"replica {replica['rank']}: ready on worker {replica['worker']}" in (
            scenario.listed
        )


def test_a_prefix_computed_on_one_worker_is_loaded_on_the_other(scenario):
    for first, second in scenario.pairs:
        assert (
            first.headers["x-xinference-replica"]
            != second.headers["x-xinference-replica"]
        )
        assert first.headers["x-xinference-xavier-external-tokens"] == "0"
        loaded = int(second.headers["x-xinference-xavier-external-tokens"])
        assert loaded >= PREFIX_BLOCKS * 32
        assert (
            second.headers["x-xinference-xavier-holder"]
            == first.headers["x-xinference-replica"]
        )
        # the loaded KV gives what computing it did
        text = [r.json()["choices"][0]["text"] for r in (first, second)]
        assert text[0] and text[0] == text[1]
    loaded = sum(
        s["xavier"]["actor"]["device_tier_blocks_loaded"]
        + s["xavier"]["actor"]["cpu_tier_blocks_loaded"]
        for s in scenario.stats
    )
    assert loaded >= PREFIX_BLOCKS * len(scenario.pairs)
    # the loader's first READ from its peer is logged in its worker's log with the
    # peer's host and the UCX transports that can join them (tcp at least: the
    # workers' addresses differ, UCX connects over its own interfaces)
    assert scenario.peer_checks, "no peer check logged"
    assert all("(on this host)" in line for line in scenario.peer_checks)
    assert all(
        "tcp" in line.rsplit("for this peer:", 1)[1] for line in scenario.peer_checks
    )


def test_a_lost_worker_is_marked_gone_within_the_bound_and_forgotten(scenario):
    assert scenario.killed  # the worker and the processes under it
    assert not any(psutil.pid_exists(pid) for pid in scenario.killed)
    assert scenario.gone_after_s is not None and scenario.gone_after_s <= GONE_BOUND_S
    reason = scenario.gone[str(scenario.victim_rank)]
    assert scenario.victim_host in reason and "heartbeat" in reason
    # the tracker forgot what the lost replica held
    assert scenario.holder_before["holder"] == scenario.victim_rank
    assert scenario.holder_after["holder"] != scenario.victim_rank
    assert [host_of(w["address"]) for w in scenario.workers_after] == [
        h for h in WORKER_HOSTS if h != scenario.victim_host
    ]
    assert f"replica {scenario.victim_rank}: gone" in scenario.listed_after
    assert "1/2" in scenario.listed_after
    # terminating the degraded model does not wait on the dead worker
    assert scenario.terminate_seconds < 60


def test_requests_during_the_loss_complete_or_fail_fast(scenario):
    survivor = 1 - scenario.victim_rank
    assert scenario.outcomes
    for outcome in scenario.outcomes:
        if outcome.status == 200:
            assert outcome.text == scenario.reference
        else:
            assert outcome.status == 503, outcome
            assert "unreachable" in outcome.detail or "gone" in outcome.detail
            assert outcome.seconds < FAIL_FAST_S, outcome
    after = [o for o in scenario.outcomes if o.after_gone]
    assert len(after) >= 6
    assert all(o.status == 200 and o.replica == survivor for o in after), after


def test_a_prefix_held_only_by_the_lost_replica_is_recomputed_without_waiting(
    scenario,
):
    """Right after the kill the tracker still names the dead replica as the holder:
    the survivor's load from it fails fast and it computes the prefix itself."""
    assert scenario.orphan_reference
    served = [o for o in scenario.orphan_outcomes if o.status == 200]
    assert served, scenario.orphan_outcomes
    for outcome in scenario.orphan_outcomes:
        assert outcome.seconds < FAIL_FAST_S, outcome
        if outcome.status != 200:
            assert outcome.status == 503 and "unreachable" in outcome.detail
    for outcome in served:
        assert outcome.replica == 1 - scenario.victim_rank
        assert outcome.text == scenario.orphan_reference


def test_a_worker_that_comes_back_serves_again(scenario):
    hosts = sorted(host_of(w["address"]) for w in scenario.rejoined)
    assert hosts == sorted(WORKER_HOSTS)
    replicas = scenario.relaunched["replicas"]
    assert sorted(host_of(r["worker"]) for r in replicas) == sorted(WORKER_HOSTS)
    response = scenario.relaunched_response
    assert response is not None and response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == scenario.reference


def test_the_xoscar_transport_loads_across_workers_too(scenario):
    assert scenario.relaunched["xavier"].startswith("Xavier: on")
    assert "transport xoscar" in scenario.relaunched["xavier"]
    assert scenario.relaunched_pair is not None
    first, second = scenario.relaunched_pair
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert (
        first.headers["x-xinference-replica"] != second.headers["x-xinference-replica"]
    )
    assert int(second.headers["x-xinference-xavier-external-tokens"]) >= (
        PREFIX_BLOCKS * 32
    )
    texts = [r.json()["choices"][0]["text"] for r in (first, second)]
    assert texts[0] == texts[1]


def test_nothing_is_left_behind(scenario):
    assert scenario.leftovers == []
