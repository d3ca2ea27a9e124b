"""The offline tiny-model builder: shape, determinism, reuse."""

from __future__ import annotations

import json

import pytest

from xinference.model.llm.tiny_model import (
    DEFAULT_SYSTEM_PROMPT,
    TINY_QWEN2,
    build_tiny_qwen2,
)


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


@pytest.mark.slow
def test_the_model_is_shaped_like_a_qwen25_instruct_release(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    path = build_tiny_qwen2(tmp_path / "m")
    files = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "Qwen2Tokenizer"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["pad_token"] == "<|endoftext|>"
    # the template lives in tokenizer_config.json, as in Qwen2.5 releases
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert DEFAULT_SYSTEM_PROMPT in tokenizer_config["chat_template"]
    # added special tokens, where save_pretrained puts them (tokenizer.json)
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    assert added == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert all(t["special"] for t in tokenizer_json["added_tokens"])
    config = json.loads((path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 2)

    generation = GenerationConfig.from_pretrained(path)
    assert generation.eos_token_id == [2, 0]
    assert generation.do_sample is True
    assert (generation.temperature, generation.top_p, generation.top_k) == (
        0.7,
        0.8,
        20,
    )
    assert generation.repetition_penalty == 1.05

    tokenizer = AutoTokenizer.from_pretrained(path)
    # Qwen2Tokenizer in transformers 5.x, Qwen2TokenizerFast in 4.x
    assert type(tokenizer).__name__.startswith("Qwen2Tokenizer")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # special tokens in text are single ids, never split into bytes
    assert tokenizer("<|im_start|>user<|im_end|>")["input_ids"][0] == 1


@pytest.mark.slow
def test_a_model_without_chat_template_and_old_builds_are_rebuilt(tmp_path):
    plain = build_tiny_qwen2(tmp_path / "plain", with_chat_template=False)
    assert "chat_template" not in json.loads(
        (plain / "tokenizer_config.json").read_text()
    )
    assert not (plain / "chat_template.jinja").exists()
    # the same directory asked for with a template is rebuilt with one
    build_tiny_qwen2(tmp_path / "plain")
    assert "chat_template" in json.loads((plain / "tokenizer_config.json").read_text())

    # a directory an older builder marked complete (its marker: the bare config)
    old = tmp_path / "old"
    old.mkdir()
    (old / "xavier-tiny-model.json").write_text(json.dumps(TINY_QWEN2, sort_keys=True))
    build_tiny_qwen2(old)
    assert (old / "generation_config.json").is_file()
