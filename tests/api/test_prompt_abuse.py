"""What one careless or hostile request can do to the serving routes, with the
tiny model's real tokenizer and stand-in replicas (no engine): a text the
tokenizer cannot take is a 400 naming it, never a 500; a prompt that cannot fit
is a fast 400, and it does not hold up the other requests."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from xinference.api import restful_api
from xinference.core.prompting import PromptRenderer
from xinference.model.llm.tiny_model import build_tiny_qwen2

from .stand_in import StandInReplicas, serve_with

pytestmark = pytest.mark.slow  # builds the tiny model once (a few seconds)

CONTEXT = 2048  # the tiny model's max_model_len in the e2e tests
HUGE = 10_000_000  # characters: the 10 MB prompt
# What the chat may take while the huge prompt is refused beside it, beyond what
# it takes alone. Tokenising the huge prompt (what the chat waited for before)
# takes about 10 s here.
CHAT_DELAY_BOUND_S = 2.0


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
    path = build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny")
    return PromptRenderer.load(str(path))


@pytest.fixture
async def http(monkeypatch, renderer):
    replicas = StandInReplicas(renderer, max_model_len=CONTEXT, block_size=16)
    serve_with(monkeypatch, replicas)
    app = restful_api.create_app("127.0.0.1:1")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://t", timeout=120
    ) as client:
        yield client


SURROGATE = "a\ud800b"


async def post_escaped(http: httpx.AsyncClient, path: str, body: Any) -> Any:
    """``body`` as JSON with every non-ASCII character escaped (a lone surrogate
    as ``\\ud800``, as JSON allows): httpx's own encoding cannot carry it."""
    return await http.post(
        path,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", SURROGATE]}, "prompt"),
        ("/v1/completions", {"prompt": SURROGATE, "stream": True}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": SURROGATE}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": SURROGATE}]},
                ],
                "stream": True,
            },
            "messages[1].content",
        ),
        ("/v1/models/m/prefix", {"prompt": SURROGATE}, "prompt"),
        (
            "/v1/models/m/prefix",
            {"messages": [{"role": "user", "content": SURROGATE}]},
            "messages[0].content",
        ),
    ],
)
async def test_a_lone_surrogate_is_a_400_naming_it(http, path, body, param):
    if not path.endswith("/prefix"):
        body = {"model": "m", "max_tokens": 1} | body
    response = await post_escaped(http, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "lone surrogate (U+D800) at character 1" in error["message"]


async def test_a_lone_surrogate_in_a_stop_string_is_a_400_naming_it(http):
    body = {"model": "m", "prompt": "hi", "max_tokens": 1, "stop": ["ok", SURROGATE]}
    response = await post_escaped(http, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stop[1]"


async def test_an_error_quoting_a_lone_surrogate_is_still_an_error(http):
    """FastAPI's 422 echoes the input it refused: with a lone surrogate in it,
    rendering the 422 as UTF-8 failed, and the client got a 500."""
    login = {"username": SURROGATE, "password": "p"}  # a length-checked field
    response = await post_escaped(http, "/token", login)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "username"]
    assert response.content.isascii()


async def test_a_huge_prompt_is_a_fast_400_and_a_chat_beside_it_is_not_held_up(http):
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 1,
    }

    async def timed(body: dict[str, Any], path: str) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        response = await http.post(path, json=body)
        return response, time.monotonic() - started

    alone, alone_s = await timed(chat, "/v1/chat/completions")
    assert alone.status_code == 200, alone.text
    huge = {"model": "m", "prompt": "hello world " * (HUGE // 12), "max_tokens": 1}
    (refused, refused_s), (served, served_s) = await asyncio.gather(
        timed(huge, "/v1/completions"), timed(chat, "/v1/chat/completions")
    )
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["param"] == "prompt" and "max_model_len" in error["message"]
    assert served.status_code == 200, served.text
    assert served_s < alone_s + CHAT_DELAY_BOUND_S, (served_s, alone_s)
    # the huge prompt was refused from its length, not after tokenising it
    assert refused_s < CHAT_DELAY_BOUND_S, refused_s
