"""How many characters a prompt may have before it certainly cannot fit a context:
the check that refuses a huge prompt before the tokenizer spends seconds on it.

One token covers at most as many characters as its longest vocabulary string: a
byte-level BPE string has one character per byte it stands for, a SentencePiece
piece one per character (its ``▁`` for a space), a byte-fallback ``<0x41>`` more
than the one byte it stands for, an added token (``<|im_start|>``) its own text.
So a text of more than ``(context - 1) * longest`` characters needs at least
``context`` tokens, leaving no room to generate: it cannot fit.

That holds only when the tokenizer turns every character into tokens. Some do
not: a normalizer may drop text (``Strip``, ``StripAccents``, BERT's cleaning),
NFC composition merges up to four code points into one, a pre-tokenizer may drop
whitespace (BERT's, ``WhitespaceSplit``), an unknown character may be dropped
(a BPE vocabulary without all bytes and no unknown token) or a run of them fused
into one token. ``chars_per_token`` reads the tokenizer's own configuration and
gives a bound only when none of this can happen (NFC counted by checking the
text itself); otherwise None, and prompts are tokenised to be measured.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any, Literal, cast

NormalForm = Literal["NFC", "NFKC"]
# Normalizers that never make a text shorter (a Replace whose replacement is at
# least as long is checked below; NFC and NFKC compose).
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
# The most code points canonical composition merges into one (a base letter and
# three marks, e.g. U+1F82); a text already in the normal form loses none.
COMPOSITION_FACTOR = 4
# Pre-tokenizers that split without dropping a character (with a behaviour other
# than "Removed" where they have one).
_LOSSLESS_PRE_TOKENIZERS = {
    "ByteLevel",
    "Metaspace",
    "Split",
    "Digits",
    "Punctuation",
    "UnicodeScripts",
}


@dataclass(frozen=True, slots=True)
class CharBound:
    """Characters one token covers at most, for texts in the normal form the
    tokenizer composes to (``compose``: "NFC"/"NFKC", None: no composition)."""

    longest_token: int
    compose: NormalForm | None = None

    def max_chars(self, text: str, context: int) -> int:
        """More characters than this in ``text`` cannot fit ``context`` tokens
        with one to spare."""
        factor = 1
        if self.compose is not None and not (
            text.isascii() or unicodedata.is_normalized(self.compose, text)
        ):
            factor = COMPOSITION_FACTOR
        return (context - 1) * self.longest_token * factor


def chars_per_token(tokenizer: Any) -> CharBound | None:
    """The bound for a Hugging Face tokenizer, or None when its configuration
    lets characters vanish (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: nothing to read the rules from
        return None
    vocab = tokenizer.get_vocab()
    pre_tokenizer = _state(backend.pre_tokenizer)
    byte_level = "ByteLevel" in _kinds(pre_tokenizer)
    if not vocab or not _every_character_tokenised(backend, vocab, byte_level):
        return None
    try:
        compose = _composition(_state(backend.normalizer))
    except _MayShorten:
        return None
    if not _lossless(pre_tokenizer):
        return None
    return CharBound(max(len(token) for token in vocab), compose)


def _state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's configuration (None: there is none)."""
    if component is None:
        return None
    return dict(json.loads(component.__getstate__()))


class _MayShorten(Exception):
    """A normalizer that may make a text shorter by any amount."""


def _composition(config: dict[str, Any] | None) -> NormalForm | None:
    """The normal form the normalizer composes to, None when it never shortens
    a text; ``_MayShorten`` when it may shorten it by any amount."""
    if config is None:
        return None
    kind = config.get("type")
    if kind in _KEEPING_NORMALIZERS:
        return None
    if kind == "NFC" or kind == "NFKC":
        return cast(NormalForm, kind)
    if kind == "Replace":
        pattern = config.get("pattern", {})
        if "String" in pattern and len(config.get("content", "")) >= len(
            pattern["String"]
        ):
            return None
        raise _MayShorten  # a regex, or a shorter replacement
    if kind == "Sequence":
        forms = {_composition(part) for part in config.get("normalizers", [])}
        forms.discard(None)
        if len(forms) > 1:
            raise _MayShorten
        return forms.pop() if forms else None
    raise _MayShorten


def _kinds(config: dict[str, Any] | None) -> set[str]:
    """The types of a pre-tokenizer and of the parts of a sequence of them."""
    if config is None:
        return set()
    parts = config.get("pretokenizers", [])
    return {str(config.get("type"))}.union(*(_kinds(part) for part in parts))


def _lossless(config: dict[str, Any] | None) -> bool:
    if config is None:
        return True
    kind = config.get("type")
    if kind == "Sequence":
        return all(_lossless(part) for part in config.get("pretokenizers", []))
    return kind in _LOSSLESS_PRE_TOKENIZERS and config.get("behavior") != "Removed"


def _every_character_tokenised(
    backend: Any, vocab: dict[str, int], byte_level: bool
) -> bool:
    """Whether the model gives every character a token of its own or a share of
    one: a BPE model with every byte in its vocabulary (byte-level, the text
    turned into byte symbols first, or byte fallback), or an unknown token that
    is not fused over a run."""
    model = backend.model
    if type(model).__name__ != "BPE" or getattr(model, "fuse_unk", False):
        return False
    if getattr(model, "byte_fallback", False) and all(
        f"<0x{byte:02X}>" in vocab for byte in range(256)
    ):
        return True
    if byte_level:
        from tokenizers.pre_tokenizers import ByteLevel

        if all(symbol in vocab for symbol in ByteLevel.alphabet()):
            return True
    return getattr(model, "unk_token", None) is not None
