"""The offline tiny-model builder: shape, determinism, reuse."""

from __future__ import annotations

import json

import pytest

from xinference.model.llm.tiny_model import build_tiny_qwen2


@pytest.mark.slow
def test_build_is_deterministic_reused_and_rebuilt_on_other_arguments(tmp_path):
    first = build_tiny_qwen2(tmp_path / "a")
    second = build_tiny_qwen2(tmp_path / "b")
    weights = (first / "model.safetensors").read_bytes()
    assert weights == (second / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (
        second / "tokenizer.json"
    ).read_bytes()

    config = json.loads((first / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    assert config["num_key_value_heads"] == 2
    assert config["vocab_size"] == 1024
    assert config["dtype"] == "bfloat16"

    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_qwen2(tmp_path / "a") == first  # reused as is
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime

    build_tiny_qwen2(tmp_path / "a", num_hidden_layers=3)  # other arguments
    assert json.loads((first / "config.json").read_text())["num_hidden_layers"] == 3


@pytest.mark.slow
def test_tokenizer_round_trips_text(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_qwen2(tmp_path / "m"))
    assert 900 <= len(tokenizer) <= 1024
    text = "the cache loads a snapshot, 42."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
