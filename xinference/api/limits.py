"""What a serving request must fit, checked in the front end before it goes out.

vLLM refuses the same requests, but only once a replica has the request: a refusal
there reaches a streamed request after its 200 was sent, and reads as the engine's
wording. Checked here, each is a 400 that names the limit, streamed or not. The
rules are vLLM's: a prompt needs at least one token and one free position after it
in the context; a token id is valid up to the larger of the model's and the
tokenizer's vocabulary; and (as vLLM's OpenAI server has it) ``max_tokens`` may not
ask for more tokens than the context leaves after the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """A deployment's context length and vocabulary size (0: unknown, unchecked)."""

    max_model_len: int
    vocab_size: int

    def check(
        self,
        token_ids: Sequence[int],
        max_tokens: int | None,
        *,
        prompt_param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> None:
        """Raise ``InvalidRequest`` unless the prompt and budget fit the model."""
        if not token_ids:
            raise InvalidRequest(
                "the prompt is empty: at least one token is needed", prompt_param
            )
        if self.vocab_size:
            outside = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if outside:
                raise InvalidRequest(
                    f"token id {outside[0]} is outside the model's vocabulary "
                    f"(valid ids: 0 to {self.vocab_size - 1}; {len(outside)} of the "
                    f"prompt's {len(token_ids)} ids are outside)",
                    prompt_param,
                )
        context = self.max_model_len
        if not context:
            return
        if len(token_ids) >= context:
            raise InvalidRequest(
                f"the prompt is {len(token_ids)} tokens, but this model's context "
                f"(max_model_len) is {context} tokens: it must leave room for at "
                f"least one generated token",
                prompt_param,
            )
        room = context - len(token_ids)
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequest(
                f"{max_tokens_param} is {max_tokens}, but this model's context "
                f"(max_model_len) is {context} tokens and the prompt is "
                f"{len(token_ids)}: at most {room} tokens can be generated",
                max_tokens_param,
            )
