"""Prompt rendering in the front end: text and chat messages to token ids.

The front end tokenises once, before it picks a replica, because the cache-aware
router needs the prompt's block hashes; the replica then generates from token ids.
Both Xavier-on and Xavier-off deployments take this same path, so their outputs are
comparable token for token.

Tokenising is the front end's one costly step per request, and the request's
sender chooses its size: a text the tokenizer cannot take (a lone surrogate) is
refused naming the problem, and one too long to fit the model's context is
refused from its length before it is tokenised (``prompt_bounds.py``), so that
one huge prompt costs no more than the longest that fits. Callers encode in
worker threads (the tokenizer releases the GIL while it encodes), each on a
tokenizer copy of its own: a short prompt never waits for a long one.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from .prompt_bounds import CharBound, chars_per_token

# Used when the model ships no chat template.
_FALLBACK_ROLE_PREFIX = "<|{role}|>\n"
_FALLBACK_TURN_END = "\n"
# How OpenAI content parts become one string (as vLLM joins text parts for templates
# that take string content).
_PART_SEPARATOR = "\n"
# Tokenizer copies at most: concurrent encodes beyond it wait for a free one.
TOKENIZER_COPIES = 4


class PromptRefused(ValueError):
    """A prompt the tokenizer cannot take or the model cannot fit: the sender's
    to fix (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class PromptRenderer:
    """Wraps a Hugging Face tokenizer loaded from the model directory."""

    def __init__(self, tokenizer: Any, copies: int = TOKENIZER_COPIES) -> None:
        # Renders chat templates and answers vocabulary questions; it never
        # encodes, so copying it is safe while copies encode.
        self._tokenizer = tokenizer
        self._pool = _TokenizerPool(tokenizer, copies)
        self._bound: CharBound | None = chars_per_token(tokenizer)

    @classmethod
    def load(cls, model_path: str) -> PromptRenderer:
        """Blocking (reads files, imports transformers): call it from a thread."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_path))

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included."""
        return len(self._tokenizer)

    @property
    def char_bound(self) -> CharBound | None:
        """Characters per token at most (None: the tokenizer may drop text)."""
        return self._bound

    def completion_ids(
        self,
        prompt: str | Sequence[int],
        context: int | None = None,
        param: str = "prompt",
        add_special_tokens: bool = True,
    ) -> list[int]:
        """A completion prompt's ids; a text is refused (``PromptRefused``) when
        the tokenizer cannot take it or when it cannot fit ``context`` tokens
        (None or 0: unknown, not checked before encoding)."""
        if isinstance(prompt, str):
            return self._encode(
                prompt, context, param, add_special_tokens=add_special_tokens
            )
        return [int(token) for token in prompt]

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary writes it (``/tokenize``)."""
        return list(self._tokenizer.convert_ids_to_tokens(list(token_ids)))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (``/detokenize``). Blocking: use a thread.
        An id outside the vocabulary is refused (``PromptRefused``)."""
        vocab = len(self._tokenizer)
        for token_id in token_ids:
            if not 0 <= token_id < vocab:
                raise PromptRefused(
                    f"token id {token_id} is outside the vocabulary (0 to "
                    f"{vocab - 1})",
                    "tokens",
                )
        with self._pool.borrowed() as tokenizer:
            return str(tokenizer.decode(list(token_ids)))

    def decode(self, token_id: int) -> str:
        """One token's text (for the rare logprob entry the engine left undecoded)."""
        return str(self._tokenizer.decode([token_id]))

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        context: int | None = None,
        param: str = "messages",
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt of a conversation, ready for the assistant's turn.

        ``messages`` are OpenAI chat messages: ``role`` and ``content``, a string or
        a list of text parts (``{"type": "text", "text": ...}``). The model's chat
        template renders them (with its own default system prompt, if it has one);
        without a template, role markers do. Refused as ``completion_ids`` is.
        ``template_kwargs``: a request's ``chat_template_kwargs``, which the
        template reads as vLLM's server passes them (``template_arguments``).
        """
        plain = [
            {"role": message["role"], "content": message_text(message.get("content"))}
            for message in messages
        ]
        templated = bool(getattr(self._tokenizer, "chat_template", None))
        if templated:
            # Rendered to text, then encoded as a completion prompt is: one path to
            # token ids whatever apply_chat_template returns in this transformers
            # release (a list in 4.x, a BatchEncoding in 5.x). Templates write their
            # special tokens out, so none are added.
            text = self._render(plain, param, template_kwargs or {})
        else:
            text = "".join(
                _FALLBACK_ROLE_PREFIX.format(role=m["role"])
                + m["content"]
                + _FALLBACK_TURN_END
                for m in plain
            )
            text += _FALLBACK_ROLE_PREFIX.format(role="assistant")
        # The rendered text is what must fit (a template may add to the messages
        # or trim them); a bad character is named by its message.
        self._refuse_if_too_long(text, context, param)
        for index, message in enumerate(plain):
            check_text(message["content"], f"{param}[{index}].content")
        return self._encode(text, context, param, add_special_tokens=not templated)

    def _render(
        self, messages: list[dict[str, Any]], param: str, kwargs: Mapping[str, Any]
    ) -> str:
        from jinja2 import TemplateError

        arguments = template_arguments(self._tokenizer.chat_template, kwargs)
        try:
            return str(
                self._tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False, **arguments
                )
            )
        except TemplateError as error:  # the template's own refusal
            raise PromptRefused(
                f"the model's chat template refused these messages: {error}", param
            ) from None

    def _refuse_if_too_long(self, text: str, context: int | None, param: str) -> None:
        if context and self._bound is not None:
            limit = self._bound.max_chars(text, context)
            if len(text) > limit:
                raise PromptRefused(
                    f"the prompt is {len(text)} characters, more than can fit this "
                    f"model's context (max_model_len) of {context} tokens: no token "
                    f"of its tokenizer covers more than "
                    f"{self._bound.longest_token} characters, so at most {limit} "
                    "characters can fit",
                    param,
                )

    def _encode(
        self, text: str, context: int | None, param: str, *, add_special_tokens: bool
    ) -> list[int]:
        self._refuse_if_too_long(text, context, param)
        check_text(text, param)
        with self._pool.borrowed() as tokenizer:
            try:
                return list(
                    tokenizer.encode(text, add_special_tokens=add_special_tokens)
                )
            except (TypeError, ValueError) as error:
                # what the checks above did not foresee, still about the text
                raise PromptRefused(
                    f"the tokenizer cannot take this text: {error}", param
                ) from None


class _TokenizerPool:
    """Copies of one tokenizer, lent one per encoding thread. A fast tokenizer
    resets its padding and truncation state on every call (a mutable borrow in
    Rust), so two threads encoding on one fail with "Already borrowed"; one lock
    instead would make every prompt wait for the encodes in front of it."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        self._original = tokenizer
        self._size = max(size, 1)
        self._free: list[Any] = []
        self._made = 0
        self._changed = threading.Condition()

    @contextmanager
    def borrowed(self) -> Iterator[Any]:
        with self._changed:
            while not self._free and self._made >= self._size:
                self._changed.wait()
            tokenizer = self._free.pop() if self._free else None
            if tokenizer is None:
                self._made += 1
        if tokenizer is None:
            try:
                tokenizer = copy.deepcopy(self._original)
            except BaseException:
                with self._changed:
                    self._made -= 1
                    self._changed.notify()
                raise
        try:
            yield tokenizer
        finally:
            with self._changed:
                self._free.append(tokenizer)
                self._changed.notify()


# What the renderer itself gives the template, and the arguments that would
# change how it is applied rather than what it reads: a request's own value is
# dropped, as vLLM's server drops these.
_RENDERER_ARGUMENTS = frozenset(
    {"messages", "add_generation_prompt", "chat_template", "tokenize"}
)


def template_arguments(
    template: str | dict[str, str] | None, kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Of a request's ``chat_template_kwargs``, those the template reads, as vLLM's
    server keeps them: the others are dropped, not refused (a client may send
    one set of arguments to models whose templates differ)."""
    if not kwargs:
        return {}
    read = _template_variables(template if isinstance(template, str) else None)
    return {
        name: value
        for name, value in kwargs.items()
        if name in read and name not in _RENDERER_ARGUMENTS
    }


@functools.lru_cache(maxsize=8)
def _template_variables(template: str | None) -> frozenset[str]:
    """The names a Jinja template reads from its context."""
    if not template:
        return frozenset()
    import jinja2
    from jinja2 import meta

    environment = jinja2.Environment()
    return frozenset(meta.find_undeclared_variables(environment.parse(template)))


def check_text(text: str, param: str) -> None:
    """Refuse a text the tokenizer cannot take: one that is not valid Unicode (a
    lone surrogate, which JSON's \\u escapes can carry) cannot be encoded to UTF-8."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start]
        raise PromptRefused(
            f"{param} is not valid Unicode text: a lone surrogate "
            f"(U+{ord(bad):04X}) at character {error.start}; send each character "
            "outside the Basic Multilingual Plane as a surrogate pair, or as itself",
            param,
        ) from None


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
