"""A stand-in for a model's replicas behind the REST API (no engine), shared by the
tests of the serving routes: a dispatcher that answers every request at once with
one token and records what it served, routed and looked up, and the hook that
puts it behind ``restful_api``'s model hub."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from xinference.api import restful_api
from xinference.core.dispatch import Route
from xinference.core.messages import GenerationChunk, GenerationRequest


def chunk(
    request: GenerationRequest, text: str = "ok", finish: Any = "length"
) -> GenerationChunk:
    """One generated token of ``request``, ``text`` its text."""
    return GenerationChunk(
        text=text,
        token_ids=(5,),
        finish_reason=finish,
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=1,
        cached_prompt_tokens=0,
    )


class StandInReplicas:
    """Answers like a dispatcher whose replicas generate one token at once.

    ``renderer`` tokenises (a real ``PromptRenderer``, or None: fixed ids);
    ``served`` holds every request served, ``routed`` and ``looked_up`` the
    cache salt of every routing and every prefix lookup."""

    def __init__(
        self, renderer: Any = None, *, max_model_len: int = 256, block_size: int = 4
    ) -> None:
        self.deployment = SimpleNamespace(
            model_uid="m",
            max_model_len=max_model_len,
            vocab_size=1000,
            block_size=block_size,
        )
        self.renderer = renderer or SimpleNamespace(
            vocab_size=1000,
            completion_ids=lambda prompt, context=None: [11, 12, 13],
            chat_ids=lambda messages, context=None: [21, 22, 23],
        )
        self.sampling_defaults: dict[str, Any] = {}
        self.served: list[GenerationRequest] = []
        self.routed: list[str | None] = []
        self.looked_up: list[str | None] = []

    async def route(self, token_ids: Any, cache_salt: str | None = None) -> Route:
        self.routed.append(cache_salt)
        return Route(rank=0, holder=None, prefix_blocks=0)

    async def serve(self, route: Route, request: GenerationRequest) -> Any:
        self.served.append(request)
        return chunk(request), 0

    async def stream_served(self, route: Route, request: GenerationRequest) -> Any:
        self.served.append(request)
        yield chunk(request), 0

    async def longest_prefix(
        self, token_ids: Any, cache_salt: str | None = None, after_blocks: int = 0
    ) -> tuple[int | None, int]:
        self.looked_up.append(cache_salt)
        return None, 0


def serve_with(monkeypatch: pytest.MonkeyPatch, stand_in: Any) -> None:
    """Every model uid resolves to ``stand_in``; no supervisor is reached."""

    async def get(self: Any, model_uid: str) -> Any:
        return stand_in

    async def no_supervisor(**_: Any) -> None:
        return None

    monkeypatch.setattr(restful_api.ModelHub, "get", get)
    monkeypatch.setattr(restful_api.xo, "actor_ref", no_supervisor)
