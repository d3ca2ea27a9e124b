"""The character bound that refuses a prompt before tokenising it must never
refuse one that fits: every token covers at most ``longest_token`` characters of
text in the normal form, so a text over the bound really needs the context. It
is given only for tokenizers that turn every character into tokens."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from xinference.core.prompt_bounds import COMPOSITION_FACTOR, chars_per_token
from xinference.model.llm.tiny_model import build_tiny_qwen2


@pytest.fixture(scope="module")
def qwen_shaped(tmp_path_factory):
    """The tiny model's tokenizer: byte-level BPE after NFC, as Qwen2's."""
    path = build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def fast(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def byte_level_bpe() -> Tokenizer:
    """Every byte a token, one merge: a byte-level BPE in miniature."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    vocab["ab"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, [("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


def test_a_byte_level_bpe_is_bounded_by_its_longest_token():
    bound = chars_per_token(fast(byte_level_bpe()))
    assert bound is not None and bound.longest_token == 2 and bound.compose is None
    assert bound.max_chars("x", context=11) == 20


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda t: setattr(t, "normalizer", normalizers.Strip()), "strips text"),
        (lambda t: setattr(t, "normalizer", normalizers.StripAccents()), "drops marks"),
        (
            lambda t: setattr(t, "normalizer", normalizers.Replace(Regex(r"\s+"), " ")),
            "a regex replacement may shorten any run",
        ),
        (
            lambda t: setattr(t, "normalizer", normalizers.Replace("  ", " ")),
            "a shorter replacement",
        ),
        (
            lambda t: setattr(
                t,
                "pre_tokenizer",
                pre_tokenizers.Sequence(
                    [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()]
                ),
            ),
            "drops whitespace",
        ),
        (
            lambda t: setattr(
                t, "pre_tokenizer", pre_tokenizers.Split(" ", behavior="removed")
            ),
            "removes what it splits on",
        ),
    ],
)
def test_a_tokenizer_that_may_drop_text_gets_no_bound(change, why):
    tokenizer = byte_level_bpe()
    change(tokenizer)
    assert chars_per_token(fast(tokenizer)) is None, why


def test_unknown_characters_dropped_or_fused_give_no_bound():
    vocab = {"a": 0, "b": 1, "<unk>": 2}
    # neither bytes nor an unknown token: a character outside the vocabulary
    # vanishes
    assert chars_per_token(fast(Tokenizer(models.BPE(vocab, [])))) is None
    fused = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", fuse_unk=True))
    assert chars_per_token(fast(fused)) is None
    # one unknown token per unknown character: bounded
    single = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    assert chars_per_token(fast(single)).longest_token == len("<unk>")


def test_nfc_counts_a_decomposed_text_four_times(qwen_shaped):
    bound = chars_per_token(qwen_shaped)
    assert bound is not None and bound.compose == "NFC"
    composed = "r\u00e9sum\u00e9 " * 10
    decomposed = unicodedata.normalize("NFD", composed)
    assert bound.max_chars(composed, 100) == 99 * bound.longest_token
    assert bound.max_chars(decomposed, 100) == (
        99 * bound.longest_token * COMPOSITION_FACTOR
    )


# Text a client may send: ASCII and words, accented letters in either normal
# form, CJK, emoji, combining marks piled up, long runs of one character.
_PIECES = st.one_of(
    st.text(min_size=1, max_size=40),
    st.sampled_from(
        ["hello ", "world", "   ", "\n\n", "r\u00e9s", "re\u0301s", "\u6f22\u5b57"]
    ),
    st.sampled_from(["a" * 300, "=" * 120, " " * 90, "\U0001f600" * 7]),
    st.sampled_from(["\u1f00\u0300\u0345", "\u03b1\u0313\u0300\u0345", "\u1100\u1161"]),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(pieces=st.lists(_PIECES, min_size=1, max_size=30))
def test_no_text_over_the_bound_fits(qwen_shaped, pieces):
    """For any text, the tokens it takes cover at most ``longest_token`` of its
    characters each (in the normal form): so the bound never refuses a fit."""
    text = "".join(pieces).encode("utf-8", "replace").decode("utf-8")
    bound = chars_per_token(qwen_shaped)
    tokens = len(qwen_shaped.encode(text, add_special_tokens=False))
    # the context that a text of exactly its bound needs: one more than fits
    context = tokens + 1
    assert len(text) <= bound.max_chars(text, context), (text, tokens)
