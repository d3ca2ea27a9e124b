"""``/tokenize`` and ``/detokenize``, as ``vllm serve`` has them.

The front end holds each model's tokenizer (it tokenises every prompt, for
routing), so these answer without reaching a replica, with what a generation
request would send the engine: a prompt's ids, or a conversation's ids once the
model's chat template rendered it. Request and response fields are vLLM's; a
field of vLLM's these do not honour (``tools``, a request's own
``chat_template``, ...) is a 400 naming it, as on the generation routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from ..core.dispatch import ReplicaDispatcher
from .schemas import ChatMessage

# The fields vLLM's tokenize requests take that are answered here only at the
# value that changes nothing (the renderer always adds the generation prompt).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "tools": (None, []),
    "chat_template": (None,),
}


class _Tokenize(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str
    return_token_strs: bool | None = False

    def refused(self) -> list[str]:
        """The fields this request sets that cannot be honoured here."""
        return sorted(
            name
            for name, value in (self.model_extra or {}).items()
            if name not in _NEUTRAL or value not in _NEUTRAL[name]
        )


class TokenizeCompletion(_Tokenize):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChat(_Tokenize):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    # the chat template writes the special tokens out (vLLM's default: none added)
    add_special_tokens: bool = False

    def refused(self) -> list[str]:
        names = super().refused()
        return (
            sorted(names + ["add_special_tokens"]) if self.add_special_tokens else names
        )


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str
    tokens: list[int]

    def refused(self) -> list[str]:
        return []  # extra fields are a 422 (nothing else to honour)


def add_tokenize_routes(
    app: FastAPI, dispatcher_for: Callable[[Any], Awaitable[ReplicaDispatcher]]
) -> None:
    """``dispatcher_for(body)``: the dispatcher of the model a request names
    (raising ``InvalidRequest`` for the fields ``body.refused()`` names)."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeChat | TokenizeCompletion) -> dict[str, Any]:
        dispatcher = await dispatcher_for(body)
        renderer = dispatcher.renderer
        context = dispatcher.deployment.max_model_len
        if isinstance(body, TokenizeChat):
            messages = [message.plain() for message in body.messages]
            ids = await asyncio.to_thread(
                renderer.chat_ids,
                messages,
                context,
                template_kwargs=body.chat_template_kwargs,
            )
        else:
            ids = await asyncio.to_thread(
                renderer.completion_ids,
                body.prompt,
                context,
                add_special_tokens=body.add_special_tokens,
            )
        return {
            "count": len(ids),
            "max_model_len": context,
            "tokens": ids,
            "token_strs": renderer.token_strs(ids) if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(body: Detokenize) -> dict[str, Any]:
        dispatcher = await dispatcher_for(body)
        text = await asyncio.to_thread(dispatcher.renderer.detokenize, body.tokens)
        return {"prompt": text}
