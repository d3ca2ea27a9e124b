"""Parity with ``vllm serve``: the same requests to vLLM's own OpenAI server and to
ours, on the same tiny offline model, compared field by field.

One server pair for the whole module: vLLM's server (``python -m
vllm.entrypoints.openai.api_server``, the CPU build) and one replica of ours,
Xavier off (what a field means is the engine's, and Xavier never sees a field:
its prompts are token ids either way). Each request is greedy, sent streamed
and not, and the answers must agree: the status code, and for a 200 each
choice's index, text, finish reason and logprobs (floats to a small tolerance),
and the usage; for a 400, both refuse. Only the fields the parity table of
``docs/user-guide.md`` lists as vLLM's are sent here.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from xinference.client import Client
from xinference.core.registry import resolve_model

from ..deploy.local_server import LocalServer, engine_env, wait_for_no_descendants

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

MODEL_NAME = "tiny-qwen2"
SERVED = "parity"  # the model's name on both servers
ENGINE = dict(max_model_len=512, block_size=32, dtype="float32", seed=0)
READY_TIMEOUT_S = 900.0
EXIT_TIMEOUT_S = 60.0
PROMPT = "The quick brown fox jumps over the lazy dog and"
MESSAGES = [{"role": "user", "content": "name three syllables " * 3}]
# within this of each other, two logprobs are the same (one engine build, one
# dtype, batches of one: only the order of float sums may differ)
LOGPROB_TOLERANCE = 1e-3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def model_path(server: LocalServer) -> str:
    return str(resolve_model(MODEL_NAME, server.workdir))


@pytest.fixture(scope="module")
def vllm_server(server: LocalServer, model_path: str) -> Iterator[str]:
    """vLLM's own OpenAI server on the model; its base URL."""
    port = free_port()
    log = (Path(server.workdir) / "vllm-serve.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_path,
            "--served-model-name",
            SERVED,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            str(ENGINE["max_model_len"]),
            "--block-size",
            str(ENGINE["block_size"]),
            "--dtype",
            str(ENGINE["dtype"]),
            "--seed",
            str(ENGINE["seed"]),
            "--enforce-eager",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=engine_env(Path(server.workdir)),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        process.terminate()
        try:
            process.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def pair(server: LocalServer, vllm_server: str, model_path: str) -> Iterator[Any]:
    """(vLLM's base URL, ours): both serving the model. Ours loads while vLLM's
    server, started first, loads too."""
    baseline = server.descendants()
    with Client(server.endpoint) as client:
        client.launch_model_detailed(
            model_path=model_path,
            model_uid=SERVED,
            replica=1,
            enforce_eager=True,
            **ENGINE,
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(timeout=10) as http:
            while True:
                try:
                    if http.get(f"{vllm_server}/v1/models").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                log = Path(server.workdir) / "vllm-serve.log"
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(1.0)
        try:
            yield vllm_server, server.endpoint
        finally:
            client.terminate_model(SERVED)
    assert not wait_for_no_descendants(server, baseline, EXIT_TIMEOUT_S)


# ---- sending and reading ------------------------------------------------------------


def send(base: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, the whole answer: a JSON body, or a streamed one's events)."""
    with httpx.Client(timeout=300) as http:
        if not body.get("stream"):
            response = http.post(f"{base}{path}", json=body)
            return response.status_code, response.json()
        with http.stream("POST", f"{base}{path}", json=body) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code, response.json()
            events = [
                json.loads(line.removeprefix("data: "))
                for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
    return 200, events


def choices(answer: Any, chat: bool) -> dict[int, dict[str, Any]]:
    """Each choice's index -> text, finish reason and logprobs; a stream's
    chunks joined (their logprobs concatenated) as a client would."""
    joined: dict[int, dict[str, Any]] = {}
    streamed = isinstance(answer, list)
    for part in answer if streamed else [answer]:
        for choice in part.get("choices", []):
            entry = joined.setdefault(
                choice["index"], {"text": "", "finish_reason": None, "logprobs": None}
            )
            if chat:
                message = choice["delta"] if streamed else choice["message"]
                entry["text"] += message.get("content") or ""
            else:
                entry["text"] += choice["text"]
            entry["finish_reason"] = choice["finish_reason"] or entry["finish_reason"]
            entry["logprobs"] = _join_logprobs(
                entry["logprobs"], choice.get("logprobs")
            )
    return joined


def _join_logprobs(so_far: Any, more: Any) -> Any:
    if more is None:
        return so_far
    if so_far is None:
        return json.loads(json.dumps(more))
    for key, values in more.items():
        so_far[key] = (so_far.get(key) or []) + (values or [])
    return so_far


def usage(answer: Any) -> dict[str, int] | None:
    last = answer[-1] if isinstance(answer, list) else answer
    found = last.get("usage") if last else None
    if not found:
        return None
    return {k: found[k] for k in ("prompt_tokens", "completion_tokens")}


def same(ours: Any, theirs: Any, where: str = "") -> None:
    """Equal, floats to ``LOGPROB_TOLERANCE`` (-9999.0 is minus infinity)."""
    if isinstance(theirs, float) or isinstance(ours, float):
        assert math.isclose(ours, theirs, abs_tol=LOGPROB_TOLERANCE), where
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and set(ours) == set(theirs), where
        for key in theirs:
            same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), where
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            same(a, b, f"{where}[{index}]")
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def compare(pair: Any, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """Send ``body`` to both servers; they must agree. Both answers."""
    theirs_url, ours_url = pair
    chat = path.endswith("chat/completions")
    body = {"model": SERVED, "temperature": 0, **body}
    status, theirs = send(theirs_url, path, body)
    our_status, ours = send(ours_url, path, body)
    assert our_status == status, (body, ours, theirs)
    if status != 200:
        assert ours["error"]["message"], ours
        return ours, theirs
    same(choices(ours, chat), choices(theirs, chat), f"{path} {body}")
    same(usage(ours), usage(theirs), "usage")
    return ours, theirs


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
STREAMED = [False, True]


# ---- completions ----------------------------------------------------------------


@pytest.mark.parametrize("stream", STREAMED)
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"logprobs": 3},
        {"logprobs": 0},
        {"n": 2, "temperature": 1.0, "seed": 7, "logprobs": 1},
        {"n": 2},  # vLLM refuses n > 1 with greedy sampling
        {"frequency_penalty": 1.5, "presence_penalty": 1.0, "repetition_penalty": 1.3},
        {"logit_bias": {"100": 100}},
        {"min_tokens": 8, "stop_token_ids": [2, 0]},
        {"stop_token_ids": [100], "logit_bias": {"100": 100}},
        {"stop": ["e"], "include_stop_str_in_output": True},
        {"allowed_token_ids": [100, 101, 102]},
        {"skip_special_tokens": False, "spaces_between_special_tokens": False},
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"response_format": {"type": "json_object"}, "max_tokens": 12},
    ],
    ids=repr,
)
def test_completions_answer_as_vllm_serve(pair, fields, stream):
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": stream, **fields}
    if stream:
        body["stream_options"] = {"include_usage": True}
    compare(pair, COMPLETIONS, body)


def test_a_batch_of_prompts_numbers_its_choices_as_vllm_serve(pair):
    ours, _ = compare(
        pair,
        COMPLETIONS,
        {
            "prompt": [PROMPT, "Once"],
            "n": 2,
            "temperature": 1,
            "seed": 5,
            "max_tokens": 4,
        },
    )
    assert [choice["index"] for choice in ours["choices"]] == [0, 1, 2, 3]


# ---- chat ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", STREAMED)
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"logprobs": True},
        {"logprobs": True, "top_logprobs": 3},
        {"n": 2, "temperature": 1.0, "seed": 3},
        {"frequency_penalty": -1.0, "presence_penalty": 0.5},
        {"min_tokens": 6, "stop_token_ids": [2, 0]},
        {"chat_template_kwargs": {"enable_thinking": False, "tokenize": True}},
        {"structured_outputs": {"regex": "[a-c]{3}"}},
    ],
    ids=repr,
)
def test_chat_answers_as_vllm_serve(pair, fields, stream):
    body = {"messages": MESSAGES, "max_tokens": 8, "stream": stream, **fields}
    compare(pair, CHAT, body)


# ---- refusals: both servers answer 400 ------------------------------------------------


@pytest.mark.parametrize(
    "path, fields",
    [
        (COMPLETIONS, {"n": 0}),
        (COMPLETIONS, {"logprobs": -5}),
        (COMPLETIONS, {"frequency_penalty": 9}),
        (COMPLETIONS, {"min_tokens": 20}),
        (COMPLETIONS, {"logit_bias": {"10000000": 1}}),
        (COMPLETIONS, {"response_format": {"type": "json_schema"}}),
        (CHAT, {"top_logprobs": 2}),
        (CHAT, {"logprobs": True, "top_logprobs": -3}),
        (CHAT, {"n": 2}),  # greedy
        (CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}),
    ],
    ids=repr,
)
def test_what_vllm_serve_refuses_is_a_400_here(pair, path, fields):
    prompt = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": MESSAGES}
    ours, _ = compare(pair, path, {**prompt, "max_tokens": 8, **fields})
    assert ours["error"]["type"] == "invalid_request_error"


# ---- tokenize and detokenize ----------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": PROMPT},
        {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True},
        {"messages": MESSAGES},
        {"messages": MESSAGES, "return_token_strs": True},
    ],
    ids=repr,
)
def test_tokenize_answers_as_vllm_serve(pair, body):
    theirs_url, ours_url = pair
    status, theirs = send(theirs_url, "/tokenize", {"model": SERVED, **body})
    assert send(ours_url, "/tokenize", {"model": SERVED, **body}) == (status, theirs)


def test_detokenize_answers_as_vllm_serve(pair):
    theirs_url, ours_url = pair
    _, tokenized = send(ours_url, "/tokenize", {"model": SERVED, "messages": MESSAGES})
    body = {"model": SERVED, "tokens": tokenized["tokens"]}
    status, theirs = send(theirs_url, "/detokenize", body)
    assert status == 200
    assert send(ours_url, "/detokenize", body) == (status, theirs)
