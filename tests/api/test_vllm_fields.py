"""The fields whose meaning is vLLM's, without an engine: which fields go to vLLM's
request model and which are refused, what vLLM maps them to (and refuses, in its
words), the logprobs laid out as ``vllm serve`` lays them out, and n choices
through the routes. ``test_vllm_parity.py`` compares the same against vLLM's
own server."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from xinference.api import restful_api
from xinference.api.errors import InvalidRequest
from xinference.api.logprobs import chat_logprobs, completion_logprobs
from xinference.api.schemas import ChatCompletionRequest, CompletionRequest
from xinference.api.vllm_sampling import is_request_error, sampling_options
from xinference.core.messages import GenerationChunk, GenerationRequest

from .stand_in import StandInReplicas, chunk, serve_with

pytest.importorskip("vllm", reason="vLLM is not installed")

USER = [{"role": "user", "content": "hi"}]


# ---- which fields go where ----------------------------------------------------------


def test_vllms_fields_are_delegated_and_the_rest_refused():
    chat = ChatCompletionRequest(
        model="m",
        messages=USER,
        n=2,
        logprobs=True,
        top_logprobs=2,
        logit_bias={"5": 1},
        tools=[{"type": "function"}],
        user="label",
    )
    assert chat.delegated() == {
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "logit_bias": {"5": 1},
    }
    assert chat.refused() == ["tools"]
    # top_logprobs is chat's: a completion request that sends it is refused
    completion = CompletionRequest(model="m", prompt="x", logprobs=1, top_logprobs=2)
    assert completion.delegated() == {"logprobs": 1}
    assert completion.refused() == ["top_logprobs"]
    # null is unset, as for vLLM; n=1 asks for nothing
    plain = CompletionRequest(model="m", prompt="x", n=1, frequency_penalty=None)
    assert plain.delegated() == {} and plain.refused() == []


# ---- what vLLM maps them to ---------------------------------------------------------


def test_vllm_maps_the_fields_to_sampling_params():
    options = sampling_options(
        "chat",
        {"logprobs": True, "top_logprobs": 3, "n": 2, "presence_penalty": 0.5},
        None,
        {},
    )
    assert options == {"n": 2, "presence_penalty": 0.5, "logprobs": 3}
    # a completion's logprobs is the count itself; logit_bias keys become ids
    options = sampling_options(
        "completion", {"logprobs": 0, "logit_bias": {"7": 2}, "min_tokens": 2}, 8, {}
    )
    assert options == {"logprobs": 0, "logit_bias": {7: 2.0}, "min_tokens": 2}
    # chat logprobs off: vLLM asks the engine for none
    assert sampling_options("chat", {"logprobs": False}, None, {}) == {}
    assert sampling_options("completion", {}, 8, {}) == {}


def test_structured_outputs_are_vllms_params():
    options = sampling_options(
        "completion", {"response_format": {"type": "json_object"}}, 8, {}
    )
    assert options["structured_outputs"].json_object is True
    choice = sampling_options(
        "chat", {"structured_outputs": {"choice": ["a", "b"]}}, None, {}
    )
    assert choice["structured_outputs"].choice == ["a", "b"]


@pytest.mark.parametrize(
    "kind, fields, message, param",
    [
        ("chat", {"top_logprobs": 2}, "`logprobs` must be set to true", "top_logprobs"),
        ("completion", {"n": 0}, "n must be at least 1, got 0", None),
        ("completion", {"frequency_penalty": 9}, "frequency_penalty must be in", None),
        ("completion", {"frequency_penalty": "x"}, "valid number", "frequency_penalty"),
        ("completion", {"min_tokens": 20}, "min_tokens must be less than", None),
        ("completion", {"logprobs": -5}, "must be a positive value", "logprobs"),
    ],
)
def test_what_vllm_refuses_is_an_invalid_request_in_its_words(
    kind, fields, message, param
):
    with pytest.raises(InvalidRequest, match=message) as refused:
        sampling_options(kind, fields, 16, {})
    assert refused.value.param == param


# ---- logprobs as vllm serve lays them out -------------------------------------------

# the sampled token first (id 7, not the likeliest), then the top ones by rank
STEP = ((7, -1.5, " b"), (3, -0.5, " a"), (9, float("-inf"), " c"))


def test_completion_logprobs_give_top_plus_one_and_offsets():
    laid_out = completion_logprobs(
        [7, 3], [STEP, ((3, -0.25, " a"),)], 1, str, text_offset=4
    )
    assert laid_out == {
        "text_offset": [4, 6],
        "token_logprobs": [-1.5, -0.25],
        "tokens": [" b", " a"],
        # OpenAI's rule: up to logprobs + 1 entries, the sampled one included
        "top_logprobs": [{" b": -1.5, " a": -0.5}, {" a": -0.25}],
    }
    everything = completion_logprobs([7], [STEP], -1, str)
    assert everything["top_logprobs"] == [{" b": -1.5, " a": -0.5, " c": -9999.0}]


def test_chat_logprobs_give_top_entries_with_bytes():
    (token,) = chat_logprobs([7], [STEP], 2, str)["content"]
    assert (token["token"], token["logprob"], token["bytes"]) == (" b", -1.5, [32, 98])
    assert [entry["token"] for entry in token["top_logprobs"]] == [" b", " a"]
    (bare,) = chat_logprobs([7], [STEP], 0, str)["content"]
    assert bare["top_logprobs"] == []
    # an entry the engine left undecoded is decoded by the front end
    (decoded,) = chat_logprobs([7], [((7, -1.0, None),)], 0, lambda i: f"<{i}>")[
        "content"
    ]
    assert decoded["token"] == "<7>" and decoded["bytes"] is None


# ---- n choices through the routes -----------------------------------------------------


class Choices(StandInReplicas):
    """Answers ``n`` choices (``options["n"]``), each one token with a logprob."""

    def __init__(self) -> None:
        super().__init__()
        self.renderer.decode = lambda token_id: f"<{token_id}>"

    def _choices(self, request: GenerationRequest) -> list[GenerationChunk]:
        n = int(request.options.get("n", 1))
        wanted = request.options.get("logprobs") is not None
        return [
            dataclasses.replace(
                chunk(request, f"c{index}"),
                index=index,
                logprobs=(((5, -0.5, f"c{index}"),),) if wanted else None,
            )
            for index in range(n)
        ]

    async def serve(self, route: Any, request: GenerationRequest) -> Any:
        self.served.append(request)
        first, *rest = self._choices(request)
        return dataclasses.replace(first, more=tuple(rest)), 0

    async def stream_served(self, route: Any, request: GenerationRequest) -> Any:
        self.served.append(request)
        for one in reversed(self._choices(request)):
            yield one, 0


@pytest.fixture
def served(monkeypatch):
    stand_in = Choices()
    serve_with(monkeypatch, stand_in)
    with TestClient(restful_api.create_app("127.0.0.1:1")) as http:
        yield http, stand_in


def test_n_choices_are_numbered_and_counted_as_vllm_does(served):
    http, stand_in = served
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "logprobs": 0}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    # each prompt's n choices in turn
    assert [(c["index"], c["text"]) for c in choices] == [
        (0, "c0"),
        (1, "c1"),
        (2, "c0"),
        (3, "c1"),
    ]
    assert choices[1]["logprobs"]["tokens"] == ["c1"]
    usage = reply.json()["usage"]
    # two prompts of 3 tokens, counted once each; four choices of one token
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (6, 4)
    assert [request.options for request in stand_in.served] == [
        {"n": 2, "logprobs": 0}
    ] * 2


def test_streamed_chat_choices_each_open_with_the_role(served):
    http, _ = served
    body = {
        "model": "m",
        "messages": USER,
        "n": 2,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as sse:
        assert sse.status_code == 200
        events = [
            json.loads(line[5:])
            for line in sse.iter_lines()
            if line.startswith("data:") and not line.endswith("[DONE]")
        ]
    *deltas, last = events
    seen = {}
    for event in deltas:
        (choice,) = event["choices"]
        seen[choice["index"]] = choice
        assert choice["delta"]["role"] == "assistant"
        assert choice["logprobs"]["content"][0]["token"] == choice["delta"]["content"]
    assert sorted(seen) == [0, 1]
    assert last["usage"]["prompt_tokens"] == 3  # the one prompt, once
    assert last["usage"]["completion_tokens"] == 2


def test_a_refusal_of_vllms_is_a_400_naming_the_field(served):
    http, stand_in = served
    body = {"model": "m", "messages": USER, "top_logprobs": 2}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    error: dict[str, Any] = reply.json()["error"]
    assert error["param"] == "top_logprobs" and "logprobs" in error["message"]
    assert stand_in.served == []


def test_vllm_checks_the_classic_fields_with_its_own():
    # greedy sampling has one answer: vLLM refuses n > 1 with it
    with pytest.raises(InvalidRequest, match="n must be 1 when using greedy"):
        sampling_options("chat", {"n": 2}, None, {}, {"temperature": 0.0})
    assert sampling_options("chat", {"n": 2}, None, {}, {"temperature": 0.5}) == {
        "n": 2
    }


def test_a_replicas_refusal_in_vllms_client_error_is_the_senders():
    class VLLMClientError(Exception):  # matched by name: vLLM's, pickled back
        pass

    class VLLMValidationError(VLLMClientError):
        pass

    assert is_request_error(VLLMValidationError("no"))
    assert is_request_error(ValueError("no"))
    assert not is_request_error(RuntimeError("engine died"))


def test_tokenize_refuses_what_it_cannot_honour_naming_it(served):
    http, _ = served
    chat = {"model": "m", "messages": USER}
    for refused, name in (
        (dict(chat, add_generation_prompt=False), "add_generation_prompt"),
        (dict(chat, add_special_tokens=True), "add_special_tokens"),
        (dict(chat, tools=[{"type": "function"}]), "tools"),
    ):
        reply = http.post("/tokenize", json=refused)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == name
