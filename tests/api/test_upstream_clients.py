"""Drop-in: upstream Xinference's published client and the ``openai`` package against
a real server with real vLLM CPU engines.

One Xavier deployment of the tiny offline model (shaped like a Qwen2.5-Instruct
release: chat template, eos list, sampling defaults), launched by upstream's client
with ``wait_ready=False`` and followed with its progress call, served through both
clients and plain HTTP (chat with the model's template, generate, streams, batches,
refused parameters, requests too large for the model's context), terminated by
upstream's client. Then a second launch is terminated while it is still starting.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from xinference_client import RESTfulClient as UpstreamClient
from xinference_client.client.restful.restful_client import RESTfulChatModelHandle

from xinference.core.prompting import PromptRenderer
from xinference.core.registry import resolve_model

from ..deploy.local_server import LocalServer, wait_for_no_descendants

# Loading two CPU engines can take many minutes on a busy 2-core machine.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

MODEL_NAME = "tiny-qwen2"
UID = "upstream-xavier"
MAX_MODEL_LEN = 256  # small: a reply with no max_tokens runs up to it
READY_TIMEOUT_S = 1200.0
EXIT_TIMEOUT_S = 60.0
MESSAGES = [{"role": "user", "content": "name three syllables " * 4}]


@pytest.fixture(scope="module")
def launched(server: LocalServer) -> dict[str, Any]:
    """Launch without waiting; poll upstream's progress call until ready."""
    client = UpstreamClient(server.endpoint)
    baseline = server.descendants()
    started = time.monotonic()
    uid = client.launch_model(
        model_name=MODEL_NAME,
        model_engine="vllm",
        model_uid=UID,
        replica=2,
        wait_ready=False,
        # ours and vLLM's arguments, passed as upstream passes any extra keyword
        enable_xavier=True,
        block_size=32,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        dtype="float32",
        max_num_batched_tokens=1024,
    )
    returned_after = time.monotonic() - started
    first = client.get_launch_model_progress(uid)
    seen = [first["progress"]]
    while seen[-1] < 1.0:
        assert time.monotonic() - started < READY_TIMEOUT_S, server.tail()
        time.sleep(1.0)
        seen.append(client.get_launch_model_progress(uid)["progress"])
    return dict(
        client=client,
        uid=uid,
        baseline=baseline,
        returned_after=returned_after,
        first=first,
        seen=seen,
    )


def test_launch_returns_at_once_and_progress_reaches_one(launched):
    assert launched["uid"] == UID
    assert launched["first"]["state"] == "launching", launched["first"]
    assert launched["first"]["progress"] < 1.0
    assert launched["seen"] == sorted(launched["seen"]) and launched["seen"][-1] == 1.0


def test_upstream_client_lists_and_describes(launched):
    client = launched["client"]
    models = client.list_models()
    assert list(models) == [UID]
    assert models[UID]["model_type"] == "LLM" and models[UID]["replica"] == 2
    assert "Xavier: on" in models[UID]["xavier"]
    assert client.describe_model(UID)["model_name"] == MODEL_NAME
    assert isinstance(client.get_model(UID), RESTfulChatModelHandle)


def test_generate_config_is_honoured(launched):
    model = launched["client"].get_model(UID)
    reply = model.chat(MESSAGES, generate_config={"max_tokens": 24, "ignore_eos": True})
    assert reply["usage"]["completion_tokens"] == 24
    assert reply["choices"][0]["finish_reason"] == "length"
    text = model.generate(
        "The quick brown", generate_config={"max_tokens": 5, "ignore_eos": True}
    )
    assert text["usage"]["completion_tokens"] == 5


def test_chat_without_max_tokens_runs_to_the_end(launched):
    model = launched["client"].get_model(UID)
    reply = model.chat(MESSAGES, generate_config={"temperature": 0})
    usage, choice = reply["usage"], reply["choices"][0]
    if choice["finish_reason"] == "length":  # the context, not a default budget
        assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    else:
        assert choice["finish_reason"] == "stop"


def test_upstream_stream_has_no_usage_chunk_unless_asked(launched):
    model = launched["client"].get_model(UID)
    chunks = list(
        model.chat(MESSAGES, generate_config={"stream": True, "max_tokens": 8})
    )
    assert chunks and all(chunk["choices"] for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [
        json.loads(line[5:])
        for line in response.iter_lines()
        if line.startswith("data:") and not line.endswith("[DONE]")
    ]


def local_port(response: httpx.Response) -> int:
    """The client side's port of the connection that carried ``response``."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_chat_renders_the_models_template(server, launched):
    """System message, list content, streamed or not: the prompt is the model's
    ChatML template (its default system prompt where the chat has none)."""
    renderer = PromptRenderer.load(str(resolve_model(MODEL_NAME, server.workdir)))
    conversations = [
        MESSAGES,
        [{"role": "system", "content": "Answer briefly."}, *MESSAGES],
        [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "hi"}] * 2},
        ],
    ]
    with httpx.Client(base_url=server.endpoint, timeout=300) as http:
        for messages in conversations:
            expected = len(renderer.chat_ids(messages))
            body = dict(model=UID, messages=messages, max_tokens=4, temperature=0)
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["prompt_tokens"] == expected
            streamed = dict(body, stream=True, stream_options={"include_usage": True})
            with http.stream("POST", "/v1/chat/completions", json=streamed) as stream:
                assert stream.status_code == 200
                events = sse_events(stream)
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[-1]["usage"]["prompt_tokens"] == expected
            text = "".join(e["choices"][0]["delta"]["content"] for e in events[:-1])
            assert text == reply.json()["choices"][0]["message"]["content"]


def test_requests_too_large_for_the_model_are_400s_on_a_kept_connection(
    server, launched
):
    too_long = list(range(10, 10 + MAX_MODEL_LEN))  # no room left to generate
    refusals = [
        (dict(prompt=too_long), "max_model_len) is 256 tokens"),
        (dict(prompt=too_long, stream=True), "max_model_len) is 256 tokens"),
        (dict(prompt=[5, 6, 5000]), "token id 5000 is outside the model's vocab"),
        (dict(prompt="hi", max_tokens=100000), "at most"),
        (dict(prompt="hi", max_tokens=100000, stream=True), "at most"),
    ]
    with httpx.Client(base_url=server.endpoint, timeout=300) as http:
        ports = set()
        for body, message in refusals:
            response = http.post("/v1/completions", json=dict(model=UID, **body))
            assert response.status_code == 400, (body, response.text)
            assert message in response.json()["error"]["message"]
            ports.add(local_port(response))
        chat = dict(
            model=UID,
            messages=[{"role": "user", "content": "kalo " * 400}],
            stream=True,
        )
        response = http.post("/v1/chat/completions", json=chat)
        assert response.status_code == 400 and "max_model_len" in response.text
        assert response.json()["error"]["param"] == "messages"
        ports.add(local_port(response))
        served = http.post(
            "/v1/completions", json=dict(model=UID, prompt="hi", max_tokens=2)
        )
        assert served.status_code == 200, served.text
        ports.add(local_port(served))
        assert len(ports) == 1  # every answer on the one connection


def test_completions_take_a_list_of_prompts(server, launched):
    """One choice per prompt, ``index`` its place in the list, streamed or not."""
    renderer = PromptRenderer.load(str(resolve_model(MODEL_NAME, server.workdir)))
    prompts = ["The quick brown", "kalo mine suta", "ta ri po de"]
    prompt_tokens = sum(len(renderer.completion_ids(p)) for p in prompts)
    body = dict(model=UID, prompt=prompts, max_tokens=3, temperature=0)
    with httpx.Client(base_url=server.endpoint, timeout=300) as http:
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        choices = reply.json()["choices"]
        assert [choice["index"] for choice in choices] == [0, 1, 2]
        assert all(choice["finish_reason"] for choice in choices)
        assert reply.json()["usage"]["prompt_tokens"] == prompt_tokens
        streamed = dict(body, stream=True, stream_options={"include_usage": True})
        with http.stream("POST", "/v1/completions", json=streamed) as stream:
            assert stream.status_code == 200
            events = sse_events(stream)
    finished = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert sorted(finished) == [0, 1, 2]
    assert events[-1]["usage"]["prompt_tokens"] == prompt_tokens


def test_upstream_client_gets_the_reason_and_keeps_working(launched):
    model = launched["client"].get_model(UID)
    with pytest.raises(RuntimeError, match="max_model_len"):
        model.chat([{"role": "user", "content": "kalo " * 400}])
    reply = model.chat(MESSAGES, generate_config={"max_tokens": 2})
    assert reply["usage"]["completion_tokens"] <= 2


def test_openai_package(server, launched):
    client = openai.OpenAI(base_url=f"{server.endpoint}/v1", api_key="unused")
    assert UID in [model.id for model in client.models.list()]
    reply = client.chat.completions.create(
        model=UID, messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert reply.usage.completion_tokens <= 8 and reply.choices[0].message.content
    stream = client.chat.completions.create(
        model=UID,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(chunk.choices for chunk in chunks[:-1])
    scored = client.chat.completions.create(
        model=UID, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = scored.choices[0].logprobs.content
    assert len(content) == scored.usage.completion_tokens
    assert all(len(token.top_logprobs) == 2 for token in content)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model=UID,
            messages=MESSAGES,
            max_tokens=8,
            tools=[{"type": "function", "function": {"name": "f"}}],
        )


def test_openai_client_sends_a_refused_request_once(server, launched):
    sent = []
    http = httpx.Client(event_hooks={"request": [sent.append]})
    client = openai.OpenAI(
        base_url=f"{server.endpoint}/v1", api_key="unused", http_client=http
    )
    with pytest.raises(openai.BadRequestError, match="max_tokens is 100000"):
        client.chat.completions.create(model=UID, messages=MESSAGES, max_tokens=100000)
    assert len(sent) == 1  # a 400 is final: the client does not retry it
    http.close()


def test_upstream_terminate_leaves_nothing(server, launched):
    client = launched["client"]
    client.terminate_model(UID)
    assert client.list_models() == {}
    assert (
        wait_for_no_descendants(server, launched["baseline"], EXIT_TIMEOUT_S) == set()
    )


def test_terminate_during_a_launch(server, launched):
    """Runs after the deployment above is gone: never more than two engines."""
    client = launched["client"]
    baseline = server.descendants()
    uid = client.launch_model(
        model_name=MODEL_NAME,
        model_engine="vllm",
        model_uid="cut-short",
        wait_ready=False,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
    )
    assert client.get_launch_model_progress(uid)["state"] == "launching"
    client.terminate_model(uid)
    assert client.list_models() == {}
    assert wait_for_no_descendants(server, baseline, EXIT_TIMEOUT_S) == set()
