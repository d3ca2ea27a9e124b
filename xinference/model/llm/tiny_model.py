"""Offline builder of tiny random-weight Qwen2 models for tests and benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a fixed
synthetic corpus, and the weights are drawn from a seeded generator, so every build
with the same arguments produces the same model. ``initializer_range`` is large on
purpose: with the usual 0.02 a random model emits one token forever, which would make
"same output" comparisons meaningless.

Each model directory is shaped like a Qwen2.5-Instruct release, so that everything a
real model exercises (chat template, special tokens, eos list, sampling defaults) is
exercised by the tests too:

- ``tokenizer.json`` and ``tokenizer_config.json`` as ``save_pretrained`` writes a
  ``Qwen2Tokenizer`` (Qwen's pre-tokenizer split, NFC, byte-level BPE), with the
  special tokens ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2) and
  a ChatML chat template with a default system prompt inside ``tokenizer_config.json``
  (where Qwen2.5 releases keep it; ``with_chat_template=False`` leaves it out);
- ``config.json``: eos ``<|im_end|>``, bos ``<|endoftext|>``;
- ``generation_config.json``: ``eos_token_id: [2, 0]`` and the sampling defaults of
  ``GENERATION_DEFAULTS`` (Qwen2.5-Instruct's values).

    build_tiny_qwen2(path)                          # the test model (head size 32)
    build_tiny_qwen2(path, **QWEN25_05B_SHAPED)     # Qwen2.5-0.5B attention shape
    build_tiny_qwen2(path, with_chat_template=False)  # no template: the fallback
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .model_dirs import build_once
from .synthetic_text import synthetic_corpus

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
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2, in this order
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
# Sampling defaults in generation_config.json, the values Qwen2.5-Instruct ships.
GENERATION_DEFAULTS: dict[str, Any] = dict(
    do_sample=True,
    temperature=0.7,
    top_p=0.8,
    top_k=20,
    repetition_penalty=1.05,
)
# ChatML, the format Qwen2.5 uses: a system turn first (the default one unless the
# conversation starts with its own), every turn closed by <|im_end|>.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system = '" + DEFAULT_SYSTEM_PROMPT + "' -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}"
    "{%- for message in turns -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_SEED = 1234
_MARKER = "xavier-tiny-model.json"  # written last: its presence means "complete"
# Part of the marker: a directory built by an older builder (another layout of files)
# is rebuilt. Bump it whenever the files written change.
_FORMAT = 2


def qwen25_05b_shaped(path: str | os.PathLike[str], **overrides: Any) -> Path:
    """Build (or reuse) the Qwen2.5-0.5B-shaped random model at ``path``."""
    return build_tiny_qwen2(path, **{**QWEN25_05B_SHAPED, **overrides})


def build_tiny_qwen2(
    path: str | os.PathLike[str], *, with_chat_template: bool = True, **overrides: Any
) -> Path:
    """Build a random Qwen2 model with a local tokenizer at ``path``; reuse it if present.

    ``overrides`` replace fields of ``TINY_QWEN2`` (any ``Qwen2Config`` field). A
    directory built with other arguments, or by an older builder, is rebuilt. The
    build goes to a temporary sibling directory that is renamed into place, so
    concurrent builders never see a half-written model.
    """
    config = {**TINY_QWEN2, **overrides}
    spec = {"format": _FORMAT, "chat_template": with_chat_template, "config": config}
    return build_once(path, spec, _MARKER, _build)


def _build(directory: Path, spec: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config_fields = spec["config"]
    tokenizer = _train_tokenizer(min(_TOKENIZER_VOCAB, config_fields["vocab_size"]))
    if spec["chat_template"]:
        tokenizer.chat_template = CHAT_TEMPLATE
    # As in Qwen2.5 releases: the template inside tokenizer_config.json, not in a
    # chat_template.jinja of its own.
    tokenizer.save_pretrained(directory, save_jinja_files=False)
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])

    config = Qwen2Config(
        **config_fields,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        tie_word_embeddings=False,
        use_sliding_window=False,
        dtype="bfloat16",
    )
    # A private generator state: building a model must not disturb the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = Qwen2ForCausalLM(config).bfloat16()
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext,
        pad_token_id=endoftext,
        eos_token_id=[im_end, endoftext],
        **GENERATION_DEFAULTS,
    )
    model.save_pretrained(directory, safe_serialization=True)


def _train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE trained on a fixed synthetic corpus (deterministic), with
    the normaliser and pre-tokeniser ``Qwen2Tokenizer`` builds, so that the saved
    files load back as the same tokenizer."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(synthetic_corpus(), trainer=trainer)
    return _qwen2_tokenizer(bpe)


def _qwen2_tokenizer(bpe: Any) -> Any:
    """The trained BPE as the Qwen2 tokenizer class of the installed transformers."""
    import transformers

    # Keywords as a dict: the stubs of the tokenizer classes type some of them
    # narrower than they take them (unk_token None, merges as pairs).
    options: dict[str, Any] = dict(
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        errors="replace",
        split_special_tokens=False,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        # 5.x: one class, built from the vocabulary and merges (it sets up the same
        # normaliser and pre-tokeniser as the trained one).
        trained = json.loads(bpe.to_str())["model"]
        options["vocab"] = trained["vocab"]
        options["merges"] = [tuple(merge) for merge in trained["merges"]]
        return transformers.Qwen2Tokenizer(**options)
    # 4.x: the fast class wraps the trained tokenizer as it is.
    fast_class: Any = transformers.Qwen2TokenizerFast  # type: ignore[attr-defined]
    return fast_class(tokenizer_object=bpe, **options)
