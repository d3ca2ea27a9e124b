"""Prompt rendering in the front end: text and chat messages to token ids.

The front end tokenises once, before it picks a replica, because the cache-aware
router needs the prompt's block hashes; the replica then generates from token ids.
Both Xavier-on and Xavier-off deployments take this same path, so their outputs are
comparable token for token.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

# Used when the model ships no chat template (the offline test models do not).
_FALLBACK_ROLE_PREFIX = "<|{role}|>\n"
_FALLBACK_TURN_END = "\n"


class PromptRenderer:
    """Wraps a Hugging Face tokenizer loaded from the model directory."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        # Callers tokenise in worker threads. A fast tokenizer resets its padding and
        # truncation state on every call (a mutable borrow in Rust), so concurrent
        # calls can fail with "Already borrowed": one at a time.
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model_path: str) -> PromptRenderer:
        """Blocking (reads files, imports transformers): call it from a thread."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path))

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            with self._lock:
                return list(self._tokenizer.encode(prompt, add_special_tokens=True))
        return [int(token) for token in prompt]

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if getattr(self._tokenizer, "chat_template", None):
            with self._lock:
                ids = self._tokenizer.apply_chat_template(
                    list(messages), add_generation_prompt=True, tokenize=True
                )
            if isinstance(ids, dict):  # newer transformers return a BatchEncoding
                ids = ids["input_ids"]
            return [int(token) for token in ids]
        text = "".join(
            _FALLBACK_ROLE_PREFIX.format(role=m["role"])
            + m["content"]
            + _FALLBACK_TURN_END
            for m in messages
        )
        text += _FALLBACK_ROLE_PREFIX.format(role="assistant")
        return self.completion_ids(text)
