"""Offline builder of a Llama-3.1-8B-shaped model directory with no weight files.

For benchmarks whose prefill must cost what a production 8B model's costs: vLLM
serves the directory with ``--load-format dummy`` (random weights drawn on the
device), so nothing is downloaded and nothing of 16 GB is written or carried.

What is real-shaped and what is not:

- ``config.json`` is Llama 3.1 8B's as Meta ships it: 32 layers, hidden 4096, 32
  heads and 8 KV heads of size 128 (128 KiB of BF16 KV per token), MLP 14336,
  BF16, the ``llama3`` RoPE scaling and 131,072 positions, untied embeddings.
- The vocabulary has Llama 3.1's 128,256 ids, so the embedding and the LM head
  (2 x 128,256 x 4,096 BF16 weights, 2 GiB) and the sampler's work per token are
  the real ones. Training a byte-level BPE with 128,000 merges offline is not
  cheap, and nothing here needs it: a prompt's prefill cost depends on how many
  tokens it has, not on which. So ids ``0 .. LEARNED_VOCAB-1`` are a BPE learned
  from ``tiny_model``'s synthetic corpus (what text prompts tokenize into and what
  the benchmarks' random token prompts draw from), ids up to 127,999 are inert
  filler tokens that text never encodes to but that decode to readable text (a
  random-weight model samples any id), and ids 128,000-128,255 are Llama 3.1's
  special tokens under their real names and ids.
- The tokenizer carries a Llama-3-style chat template (header tokens, ``<|eot_id|>``;
  transformers writes it to ``chat_template.jinja``) and the Instruct release's
  bos/eos; ``generation_config.json`` has the release's eos list and sampling
  defaults.

    build_llama31_8b_shaped(path)                          # the 8B shape
    build_llama31_8b_shaped(path, **LLAMA31_MINI)          # a CPU-sized stand-in
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .model_dirs import build_once
from .synthetic_text import synthetic_corpus

VOCAB_SIZE = 128_256
LEARNED_VOCAB = 1_000  # ids the BPE learned; the benchmarks' prompt ids lie below
FIRST_SPECIAL_ID = 128_000
BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"
# Llama 3.1's named special tokens at their ids; every other id from 128,000 on is
# <|reserved_special_token_N|>, N counting up from 0 over the unnamed ones.
_NAMED_SPECIALS = {
    128_000: BOS,
    128_001: "<|end_of_text|>",
    128_004: "<|finetune_right_pad_id|>",
    128_006: "<|start_header_id|>",
    128_007: "<|end_header_id|>",
    128_008: "<|eom_id|>",
    128_009: EOT,
    128_010: "<|python_tag|>",
}
EOS_IDS = [128_001, 128_008, 128_009]

LLAMA31_8B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=VOCAB_SIZE,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    attention_bias=False,
    attention_dropout=0.0,
    mlp_bias=False,
    pretraining_tp=1,
    initializer_range=0.02,
    tie_word_embeddings=False,
    use_cache=True,
    bos_token_id=FIRST_SPECIAL_ID,
    eos_token_id=EOS_IDS,
    torch_dtype="bfloat16",
    # The release's; transformers 5 reads a tokenizer of a config without one as
    # a possibly broken Mistral tokenizer and warns.
    transformers_version="4.43.0",
)

# The CPU dry run's stand-in: the same vocabulary, tokenizer and RoPE, head size
# 128 (which vLLM's CPU attention supports), two narrow layers.
LLAMA31_MINI: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
)

# Llama 3's turn format: a header naming the role, a blank line, the content, an
# end-of-turn token; the prompt ends with an open assistant header.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)

_MARKER = "xavier-llama-shaped.json"  # the spec a complete build was made from


def special_tokens() -> dict[int, str]:
    """id -> name of every special token, 128,000 .. 128,255, as Llama 3.1 has them."""
    names: dict[int, str] = {}
    reserved = 0
    for token_id in range(FIRST_SPECIAL_ID, VOCAB_SIZE):
        if token_id in _NAMED_SPECIALS:
            names[token_id] = _NAMED_SPECIALS[token_id]
        else:
            names[token_id] = f"<|reserved_special_token_{reserved}|>"
            reserved += 1
    return names


def build_llama31_8b_shaped(path: str | os.PathLike[str], **overrides: Any) -> Path:
    """Write the model directory at ``path`` (no weights); reuse a complete one.

    ``overrides`` replace ``config.json`` fields (e.g. fewer layers for a test);
    a directory built from other fields is rebuilt (``model_dirs.build_once``).
    """
    return build_once(path, {**LLAMA31_8B, **overrides}, _MARKER, _write)


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """K and V of every layer for one token, BF16: 128 KiB for the 8B shape."""
    head_dim = config.get(
        "head_dim", config["hidden_size"] // config["num_attention_heads"]
    )
    return (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    )


def _write(directory: Path, config: dict[str, Any]) -> None:
    if config["vocab_size"] != VOCAB_SIZE:
        raise ValueError(
            f"vocab_size is fixed at Llama 3.1's {VOCAB_SIZE}: the tokenizer's "
            f"special tokens sit at its last ids (got {config['vocab_size']})"
        )
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        "bos_token_id": FIRST_SPECIAL_ID,
        "eos_token_id": EOS_IDS,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "transformers_version": LLAMA31_8B["transformers_version"],
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))


def _tokenizer() -> Any:
    """The learned BPE, padded with filler ids and Llama 3.1's special tokens."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.train_from_iterator(
        synthetic_corpus(),
        trainer=trainers.BpeTrainer(
            vocab_size=LEARNED_VOCAB,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    learned = json.loads(learner.to_str())["model"]
    vocab: dict[str, int] = dict(learned["vocab"])
    # Filler: printable ASCII, which the byte-level decoder maps to itself, so a
    # sampled filler id decodes to "<filler_N>"; no merge produces one, so text
    # never encodes to them.
    for token_id in range(len(vocab), FIRST_SPECIAL_ID):
        vocab[f"<filler_{token_id}>"] = token_id
    # tokenizers writes a merge as a pair (older releases: "left right")
    pairs = (m.split(" ") if isinstance(m, str) else m for m in learned["merges"])
    merges = [(str(left), str(right)) for left, right in pairs]
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = special_tokens()
    bpe.add_special_tokens(
        [AddedToken(specials[i], special=True) for i in sorted(specials)]
    )
    for token_id, name in specials.items():
        if bpe.token_to_id(name) != token_id:
            raise AssertionError(
                f"{name} got id {bpe.token_to_id(name)}, not {token_id}"
            )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=_NAMED_SPECIALS[128_004],
        unk_token=None,
        model_max_length=LLAMA31_8B["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
