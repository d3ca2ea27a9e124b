"""The OpenAI routes over a stand-in dispatcher (no engine): batches, streams
validated before their 200, the model's sampling defaults reaching the replica."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from xinference.api import restful_api
from xinference.core.dispatch import Route
from xinference.core.messages import GenerationChunk, GenerationRequest

from .stand_in import chunk, serve_with

REFUSED_ID = 900  # a prompt starting with it is refused by the "engine"


class StandIn:
    """Answers like a dispatcher whose replicas echo the prompt's length."""

    def __init__(self) -> None:
        self.deployment = SimpleNamespace(
            model_uid="m", max_model_len=64, vocab_size=1024
        )
        self.renderer = SimpleNamespace(
            vocab_size=1000,
            completion_ids=lambda prompt, context=None: (
                [10 + len(prompt)] * 3 if isinstance(prompt, str) else list(prompt)
            ),
            chat_ids=lambda messages, context=None: [7] * (4 * len(messages)),
        )
        self.sampling_defaults = {"temperature": 0.7, "top_k": 20}
        self.requests: list[GenerationRequest] = []

    async def route(self, token_ids: Any, cache_salt: Any = None) -> Route:
        return Route(rank=len(self.requests) % 2, holder=None, prefix_blocks=0)

    def _refuse(self, request: GenerationRequest) -> None:
        self.requests.append(request)
        if request.prompt_token_ids[0] == REFUSED_ID:
            raise ValueError("the engine refuses this prompt")

    async def serve(self, route: Route, request: GenerationRequest) -> Any:
        self._refuse(request)
        return chunk(request, f"<{len(request.prompt_token_ids)}>", "length"), 0

    async def stream_served(
        self, route: Route, request: GenerationRequest
    ) -> AsyncIterator[tuple[GenerationChunk, int]]:
        self._refuse(request)
        for piece, finish in (("a", None), ("b", "length")):
            yield chunk(request, f"{piece}{len(request.prompt_token_ids)}", finish), 1


@pytest.fixture
def served(monkeypatch):
    stand_in = StandIn()
    serve_with(monkeypatch, stand_in)
    app = restful_api.create_app("127.0.0.1:1")
    with TestClient(app) as http:
        yield http, stand_in


def events(response: Any) -> list[dict[str, Any]]:
    return [
        json.loads(line[5:])
        for line in response.iter_lines()
        if line.startswith("data:") and not line.endswith("[DONE]")
    ]


def test_a_list_of_prompts_gets_one_choice_each(served):
    http, stand_in = served
    body = {"model": "m", "prompt": ["ab", "abcde"], "max_tokens": 4}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [(c["index"], c["text"]) for c in choices] == [(0, "<3>"), (1, "<3>")]
    assert reply.json()["usage"]["prompt_tokens"] == 6
    ids = [r.request_id for r in stand_in.requests]
    assert len(set(ids)) == 2 and all(i.startswith(reply.json()["id"]) for i in ids)

    with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as sse:
        assert sse.status_code == 200
        assert sse.headers["x-xinference-replica"] == "1,1"
        received = events(sse)
    texts = {0: "", 1: ""}
    for event in received:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
    assert texts == {0: "a3b3", 1: "a3b3"}
    # token id prompts, as OpenAI allows them
    tokens = dict(body, prompt=[[1, 2], [3, 4, 5, 6]])
    reply = http.post("/v1/completions", json=tokens)
    assert [c["text"] for c in reply.json()["choices"]] == ["<2>", "<4>"]


def test_a_stream_refused_before_its_first_chunk_is_a_400(served):
    http, _ = served
    body = {"model": "m", "prompt": [REFUSED_ID, 1], "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as sse:
        assert sse.status_code == 400
        sse.read()
        assert "the engine refuses this prompt" in sse.json()["error"]["message"]
    # one refused prompt of a batch refuses the batch, before any output
    body["prompt"] = [[1, 2], [REFUSED_ID, 1]]
    assert http.post("/v1/completions", json=body).status_code == 400
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}] * 20}
    refused = http.post("/v1/chat/completions", json=dict(chat, stream=True))
    assert refused.status_code == 400 and "max_model_len" in refused.text


def test_the_models_defaults_reach_the_replica_unless_the_request_sets_them(served):
    http, stand_in = served
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    own = dict(chat, temperature=0.0, top_k=5)
    assert http.post("/v1/chat/completions", json=own).status_code == 200
    defaulted, chosen = stand_in.requests
    assert (defaulted.temperature, defaulted.top_k, defaulted.top_p) == (0.7, 20, 1.0)
    assert (chosen.temperature, chosen.top_k) == (0.0, 5)
