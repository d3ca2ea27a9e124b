"""Prompt rendering in the front end: text and chat messages to token ids.

The front end tokenises once, before it picks a replica, because the cache-aware
router needs the prompt's block hashes; the replica then generates from token ids.
Both Xavier-on and Xavier-off deployments take this same path, so their outputs are
comparable token for token.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

# Used when the model ships no chat template.
_FALLBACK_ROLE_PREFIX = "<|{role}|>\n"
_FALLBACK_TURN_END = "\n"
# How OpenAI content parts become one string (as vLLM joins text parts for templates
# that take string content).
_PART_SEPARATOR = "\n"


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

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included."""
        return len(self._tokenizer)

    def completion_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            with self._lock:
                return list(self._tokenizer.encode(prompt, add_special_tokens=True))
        return [int(token) for token in prompt]

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt of a conversation, ready for the assistant's turn.

        ``messages`` are OpenAI chat messages: ``role`` and ``content``, a string or
        a list of text parts (``{"type": "text", "text": ...}``). The model's chat
        template renders them (with its own default system prompt, if it has one);
        without a template, role markers do.
        """
        plain = [
            {"role": message["role"], "content": message_text(message.get("content"))}
            for message in messages
        ]
        if getattr(self._tokenizer, "chat_template", None):
            # Rendered to text, then encoded as a completion prompt is: one path to
            # token ids whatever apply_chat_template returns in this transformers
            # release (a list in 4.x, a BatchEncoding in 5.x). Templates write their
            # special tokens out, so none are added.
            with self._lock:
                text = self._tokenizer.apply_chat_template(
                    plain, add_generation_prompt=True, tokenize=False
                )
                return list(self._tokenizer.encode(text, add_special_tokens=False))
        text = "".join(
            _FALLBACK_ROLE_PREFIX.format(role=m["role"])
            + m["content"]
            + _FALLBACK_TURN_END
            for m in plain
        )
        text += _FALLBACK_ROLE_PREFIX.format(role="assistant")
        return self.completion_ids(text)


def message_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """A message's content as one string: OpenAI text parts joined, None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(
                f"unsupported content part type {part.get('type')!r}: "
                "only text parts are served"
            )
        texts.append(str(part["text"]))
    return _PART_SEPARATOR.join(texts)
