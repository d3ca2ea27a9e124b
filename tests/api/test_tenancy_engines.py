"""Tenants and abuse with real engines: a real ``xinference local`` server, two
vLLM CPU replicas of the tiny model with Xavier on, round-robin routing.

- The same prompt under two cache salts: under the other salt it is a miss on
  the other replica (nothing is loaded from the replica that holds it), under
  the same salt a hit (loaded from it); on the replica that computed it under
  one salt, the other salt's request does not reuse it either (vLLM's own cache
  is salted too).
- A 10 MB prompt is refused from its length while a small chat beside it is
  served without waiting for it.
- Terminating the model logs no ERROR (vLLM's EngineDeadError), kills no engine
  process and leaves no shared memory for Python's resource tracker to report.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from xinference.core.registry import resolve_model

from ..deploy.local_server import LocalServer, wait_for_no_descendants

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

UID = "tenancy"
BLOCK = 32
PROMPT = "Context 7: " + "kalo mine suta ri " * 60 + "\nQuestion: ta?"
OTHER = "Context 9: " + "suta ri kalo " * 20
PUBLISH_TIMEOUT_S = 30.0
HUGE_CHARS = 10_000_000
# What a small chat may take beside the huge prompt beyond what it takes alone
# (tokenising the huge prompt took about 10 s here before it was refused unread).
CHAT_DELAY_BOUND_S = 2.0


EXIT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[LocalServer, httpx.Client, int]]:
    """The server, a client, and where in its log the model's launch ended."""
    server = LocalServer(tmp_path_factory.mktemp("xinference-home")).start()
    server.baseline = server.descendants()  # type: ignore[attr-defined]
    http = httpx.Client(base_url=server.endpoint, timeout=600)
    try:
        launched = http.post(
            "/v1/models",
            json=dict(
                model_path=str(resolve_model("tiny-qwen2", server.workdir)),
                model_uid=UID,
                replica=2,
                enable_xavier=True,
                xavier_gpu_cache_bytes="64MiB",
                block_size=BLOCK,
                max_model_len=2048,
                enforce_eager=True,
                dtype="float32",
            ),
        )
        assert launched.status_code == 200, f"{launched.text}\n{server.tail()}"
        yield server, http, server.log_path.stat().st_size
    finally:
        http.delete(f"/v1/models/{UID}")  # the last test terminated it already
        http.close()
        killed = server.stop()
        assert killed == [], f"left behind: {killed}\n{server.tail()}"


def complete(http: httpx.Client, prompt: str, salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = dict(model=UID, prompt=prompt, max_tokens=2, temperature=0)
    if salt is not None:
        body["cache_salt"] = salt
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    headers = response.headers
    return {
        "rank": int(headers["x-xinference-replica"]),
        "external": int(headers["x-xinference-xavier-external-tokens"]),
        "holder": headers.get("x-xinference-xavier-holder"),
        "cached": response.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def lookup(http: httpx.Client, salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": PROMPT}
    if salt is not None:
        body["cache_salt"] = salt
    response = http.post(f"/v1/models/{UID}/prefix", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def published(http: httpx.Client, salt: str, holder: int) -> int:
    """Wait until ``holder`` publishes PROMPT's blocks under ``salt``; how many."""
    deadline = time.monotonic() + PUBLISH_TIMEOUT_S
    while True:
        found = lookup(http, salt)
        full = (found["prompt_tokens"] - 1) // BLOCK
        if found["holder"] == holder and found["prefix_blocks"] == full:
            return full
        assert time.monotonic() < deadline, f"not published: {found}"
        time.sleep(0.05)


def test_a_prompt_is_shared_only_under_its_own_salt(served):
    _, http, _ = served
    first = complete(http, PROMPT, "tenant-a")
    blocks = published(http, "tenant-a", first["rank"])
    assert blocks >= 4
    for other in (None, "tenant-b"):  # nobody else finds it
        assert lookup(http, other)["holder"] is None
    # round robin: the other replica, the other salt: a miss, nothing loaded
    second = complete(http, PROMPT, "tenant-b")
    assert second["rank"] != first["rank"]
    assert (second["external"], second["cached"]) == (0, 0)
    filler = complete(http, OTHER, None)  # the next turn goes to the first
    assert filler["rank"] == first["rank"]
    # the other replica again, the same salt as the first: loaded from it
    third = complete(http, PROMPT, "tenant-a")
    assert third["rank"] == second["rank"]
    assert third["external"] == blocks * BLOCK
    assert third["holder"] == str(first["rank"])
    # the first replica holds PROMPT under tenant-a only: tenant-b's request
    # there is no local hit, and loads what the second replica computed for it
    published(http, "tenant-b", second["rank"])
    fourth = complete(http, PROMPT, "tenant-b")
    assert fourth["rank"] == first["rank"]
    assert fourth["external"] == blocks * BLOCK
    assert fourth["holder"] == str(second["rank"])


def test_a_huge_prompt_does_not_hold_up_a_chat(served):
    _, http, _ = served
    chat = {
        "model": UID,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 1,
    }

    def timed(path: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        response = http.post(path, json=body)
        return response, time.monotonic() - started

    alone, alone_s = timed("/v1/chat/completions", chat)
    assert alone.status_code == 200, alone.text
    huge = {"model": UID, "prompt": "hello world " * (HUGE_CHARS // 12)}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        refusing = pool.submit(timed, "/v1/completions", huge)
        serving = pool.submit(timed, "/v1/chat/completions", chat)
        (refused, refused_s), (answered, answered_s) = (
            refusing.result(),
            serving.result(),
        )
    assert refused.status_code == 400, refused.text[:300]
    # refused from its length in characters, before it was tokenised
    assert "characters, more than can fit" in refused.json()["error"]["message"]
    assert refused_s < CHAT_DELAY_BOUND_S, refused_s
    assert answered.status_code == 200, answered.text
    assert answered_s < alone_s + CHAT_DELAY_BOUND_S, (answered_s, alone_s)


def test_terminate_stops_the_engines_without_errors(served):
    """Last in the module: it terminates the model."""
    server, http, launched_at = served
    terminated = http.delete(f"/v1/models/{UID}")
    assert terminated.status_code == 200, terminated.text
    # the replicas' processes, their resource trackers included, have exited:
    # whatever they had to say about leaks is in the log
    baseline = server.baseline  # type: ignore[attr-defined]
    assert not wait_for_no_descendants(server, baseline, EXIT_TIMEOUT_S)
    log = server.log_path.read_text(errors="replace")[launched_at:]
    lines = log.splitlines()
    assert not [line for line in lines if " ERROR " in line], server.tail(80)
    for sign in ("EngineDeadError", "leaked shared_memory", "force killing"):
        assert sign not in log, f"{sign!r} in the log:\n{server.tail(80)}"
