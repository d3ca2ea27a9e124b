"""The Llama-3.1-8B-shaped model directory: what vLLM and transformers read from it.

Building writes a 4 MB tokenizer (seconds): the tests share one build.
"""

import json

import pytest

from xinference.model.llm.llama_shaped import (
    EOS_IDS,
    LLAMA31_MINI,
    VOCAB_SIZE,
    build_llama31_8b_shaped,
    kv_bytes_per_token,
    special_tokens,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_llama31_8b_shaped(tmp_path_factory.mktemp("models") / "llama")


def test_config_has_llama31_8b_shape(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.intermediate_size,
        config.vocab_size,
    ) == (32, 4096, 32, 8, 128, 14336, 128_256)
    assert str(config.dtype) == "torch.bfloat16"
    assert config.tie_word_embeddings is False
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["rope_scaling"]["rope_type"] == "llama3"
    assert raw["rope_theta"] == 500000.0
    assert kv_bytes_per_token(raw) == 128 * 1024


def test_no_weight_files(model_dir):
    """Only --load-format dummy can serve it; nothing of gigabytes is written."""
    names = {p.name for p in model_dir.iterdir()}
    assert not {n for n in names if n.endswith((".safetensors", ".bin", ".pt"))}
    assert sum(p.stat().st_size for p in model_dir.iterdir()) < 16 << 20


def test_tokenizer_round_trips_and_covers_every_id(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == VOCAB_SIZE
    text = "kaloming the sutavade, 12. exprequ"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    assert max(ids) < 1000  # text encodes into the learned ids only
    # A random-weight model samples any id: each one decodes to text.
    assert tokenizer.decode([5000, 127_999]) == "<filler_5000><filler_127999>"
    for token_id, name in special_tokens().items():
        assert tokenizer.convert_tokens_to_ids(name) == token_id
    assert tokenizer.bos_token_id == 128_000
    assert tokenizer.convert_ids_to_tokens(128_255) == "<|reserved_special_token_247|>"


def test_chat_template_renders_llama3_turns(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "be brief "},
        {"role": "user", "content": "kalo mine"},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nkalo mine<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # vLLM tokenizes the rendered prompt without adding a second BOS.
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert ids[:2] == [128_000, 128_006] and ids.count(128_009) == 2


def test_generation_config_has_the_release_eos_list(model_dir):
    from transformers import GenerationConfig

    generation = GenerationConfig.from_pretrained(model_dir)
    assert generation.eos_token_id == EOS_IDS == [128_001, 128_008, 128_009]
    assert (generation.do_sample, generation.temperature, generation.top_p) == (
        True,
        0.6,
        0.9,
    )


def test_a_build_is_reused_and_other_shapes_rebuild(model_dir):
    marker = model_dir / "xavier-llama-shaped.json"
    stamp = marker.stat().st_mtime_ns
    assert build_llama31_8b_shaped(model_dir) == model_dir
    assert marker.stat().st_mtime_ns == stamp
    build_llama31_8b_shaped(model_dir, **LLAMA31_MINI)
    assert json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="vocab_size is fixed"):
        build_llama31_8b_shaped(model_dir.parent / "other", vocab_size=1024)
