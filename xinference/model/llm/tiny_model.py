"""Offline builder of tiny random-weight Qwen2 models for tests and benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a fixed
synthetic corpus, and the weights are drawn from a seeded generator, so every build
with the same arguments produces the same model. ``initializer_range`` is large on
purpose: with the usual 0.02 a random model emits one token forever, which would make
"same output" comparisons meaningless.

    build_tiny_qwen2(path)                          # the test model (head size 32)
    build_tiny_qwen2(path, **QWEN25_05B_SHAPED)     # Qwen2.5-0.5B attention shape
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# The test model: 2 layers, 4 heads of size 32, 2 KV heads (vLLM's CPU attention
# supports head sizes 32, 64, 80, ...).
TINY_QWEN2: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.5,
)

# Qwen2.5-0.5B's attention shape (24 layers, hidden 896, 14 heads, 2 KV heads, head
# dim 64), so KV bytes per token (12 KiB in bf16) and attention cost match the real
# model; the MLP is narrower than the real one's 4864 units to keep the build small.
QWEN25_05B_SHAPED: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=896,
    intermediate_size=1024,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    initializer_range=0.05,
)

_TOKENIZER_VOCAB = 1000
_EOS = "<|endoftext|>"
_SEED = 1234
_MARKER = "xavier-tiny-model.json"  # written last: its presence means "complete"


def qwen25_05b_shaped(path: str | os.PathLike[str], **overrides: Any) -> Path:
    """Build (or reuse) the Qwen2.5-0.5B-shaped random model at ``path``."""
    return build_tiny_qwen2(path, **{**QWEN25_05B_SHAPED, **overrides})


def build_tiny_qwen2(path: str | os.PathLike[str], **overrides: Any) -> Path:
    """Build a random Qwen2 model with a local tokenizer at ``path``; reuse it if present.

    ``overrides`` replace fields of ``TINY_QWEN2`` (any ``Qwen2Config`` field). A
    directory built with other arguments is rebuilt. The build goes to a temporary
    sibling directory that is renamed into place, so concurrent builders never see
    a half-written model.
    """
    target = Path(path)
    spec = {**TINY_QWEN2, **overrides}
    if _is_built(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _build(staging, spec)
        if target.exists():
            if _is_built(target, spec):  # another builder finished first
                return target
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_built(target: Path, spec: dict[str, Any]) -> bool:
    marker = target / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == _canonical(spec)
    except ValueError:
        return False


def _canonical(spec: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(spec, sort_keys=True, default=str))


def _build(directory: Path, spec: dict[str, Any]) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tokenizer(min(_TOKENIZER_VOCAB, spec["vocab_size"]))
    tokenizer.save_pretrained(directory)
    eos_id = tokenizer.convert_tokens_to_ids(_EOS)

    config = Qwen2Config(
        **spec,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        use_sliding_window=False,
        dtype="bfloat16",
    )
    # A private generator state: building a model must not disturb the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = Qwen2ForCausalLM(config).bfloat16()
    model.generation_config.do_sample = False
    model.save_pretrained(directory, safe_serialization=True)
    (directory / _MARKER).write_text(json.dumps(_canonical(spec), sort_keys=True))


def _train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE trained on a fixed synthetic corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=_EOS,
        pad_token=_EOS,
        bos_token=_EOS,
        unk_token=None,
        model_max_length=1 << 20,
    )


def _corpus() -> list[str]:
    """Deterministic pseudo-English: syllable words in sentences, numbers, punctuation.

    Varied enough for the trainer to learn about a thousand merges.
    """
    syllables = [
        "ka",
        "lo",
        "mi",
        "ne",
        "su",
        "ta",
        "ri",
        "po",
        "de",
        "va",
        "the",
        "and",
        "ing",
        "er",
        "on",
        "st",
        "ch",
        "qu",
        "ex",
        "pre",
        "tion",
        "al",
        "or",
        "en",
    ]
    words = [a + b for a in syllables for b in syllables]
    words += [
        a + b + c for a in syllables[:8] for b in syllables for c in syllables[:6]
    ]
    lines = []
    state = 12345
    for n in range(4000):
        sentence = []
        for _ in range(8):
            state = (state * 1103515245 + 12345) % (1 << 31)  # fixed LCG
            sentence.append(words[state % len(words)])
        lines.append(" ".join(sentence) + f", {n % 1000}. ")
    return lines
