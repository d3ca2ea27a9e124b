"""Logprobs in the response shapes ``vllm serve`` answers with.

A replica returns each generated token's logprobs as vLLM's engine gave them
(``messages.StepLogprobs``: the sampled token's entry first, then the top ones);
these functions lay them out as vLLM's OpenAI server does, so that a client
reads the same fields: completions' ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``, chat's ``content`` list. As there, a logprob
of minus infinity is written as -9999.0 (JSON has no infinity), and ``top`` -1
asks for every entry the engine returned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..core.messages import StepLogprobs

# What JSON carries for a logprob of minus infinity (OpenAI's and vLLM's choice).
FLOOR = -9999.0

Decode = Callable[[int], str]


def _token(token_id: int, text: str | None, decode: Decode) -> str:
    # The engine decodes every token it returns logprobs of; should one lack its
    # text, the front end's tokenizer decodes it alone, as vLLM's server does.
    return text if text is not None else decode(token_id)


def _sampled(
    token_id: int, step: StepLogprobs | None
) -> tuple[int, float, str | None] | None:
    if not step:
        return None
    return next((entry for entry in step if entry[0] == token_id), None)


def completion_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[StepLogprobs | None],
    top: int,
    decode: Decode,
    text_offset: int = 0,
) -> dict[str, Any]:
    """``/v1/completions``' logprobs of ``token_ids``: the sampled token and, as
    OpenAI's API defines it, up to ``top`` + 1 entries of each position;
    ``text_offset`` is where the first token's text starts in the choice."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, step in zip(token_ids, steps, strict=False):
        sampled = _sampled(token_id, step)
        if sampled is None or step is None:
            tokens.append(decode(token_id))
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            tokens.append(_token(token_id, sampled[2], decode))
            token_logprobs.append(max(sampled[1], FLOOR))
            top_logprobs.append(
                {
                    _token(entry[0], entry[2], decode): max(entry[1], FLOOR)
                    for rank, entry in enumerate(step)
                    if top == -1 or rank <= top
                }
            )
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def chat_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[StepLogprobs | None],
    top: int,
    decode: Decode,
) -> dict[str, Any]:
    """``/v1/chat/completions``' logprobs of ``token_ids``: per token, its text,
    logprob and UTF-8 bytes, and its position's ``top`` most likely entries."""
    content: list[dict[str, Any]] = []
    for token_id, step in zip(token_ids, steps, strict=False):
        sampled = _sampled(token_id, step)
        if sampled is None or step is None:
            token = decode(token_id)
            content.append({"token": token, "logprob": FLOOR, "bytes": _bytes(token)})
            content[-1]["top_logprobs"] = []
            continue
        content.append(
            {
                "token": _token(token_id, sampled[2], decode),
                "logprob": max(sampled[1], FLOOR),
                "bytes": None if sampled[2] is None else _bytes(sampled[2]),
                "top_logprobs": [
                    {
                        "token": (text := _token(entry[0], entry[2], decode)),
                        "logprob": max(entry[1], FLOOR),
                        "bytes": _bytes(text),
                    }
                    for rank, entry in enumerate(step)
                    if top == -1 or rank < top
                ],
            }
        )
    return {"content": content}


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
