"""Drop-in: upstream Xinference's published client and the ``openai`` package against
a real server with real vLLM CPU engines.

One Xavier deployment of the tiny offline model, launched by upstream's client with
``wait_ready=False`` and followed with its progress call, served through both
clients (chat, generate, streams, a refused parameter), terminated by upstream's
client. Then a second launch is terminated while it is still starting.
"""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from xinference_client import RESTfulClient as UpstreamClient
from xinference_client.client.restful.restful_client import RESTfulChatModelHandle

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
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(
            model=UID, messages=MESSAGES, max_tokens=8, logprobs=True
        )


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
