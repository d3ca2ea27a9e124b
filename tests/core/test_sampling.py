"""Default sampling parameters from a model's generation_config.json."""

import json

import pytest

from xinference.core.sampling import NEUTRAL, load_sampling_defaults, resolve

QWEN25 = {
    "bos_token_id": 0,
    "do_sample": True,
    "eos_token_id": [2, 0],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN25))
    return str(tmp_path)


def test_auto_takes_the_models_sampling_values(model_dir):
    assert load_sampling_defaults(model_dir, "auto") == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
    }


def test_vllm_mode_and_a_missing_or_broken_file_give_no_defaults(model_dir, tmp_path):
    assert load_sampling_defaults(model_dir, "vllm") == {}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_sampling_defaults(str(empty), "auto") == {}
    (empty / "generation_config.json").write_text("{not json")
    assert load_sampling_defaults(str(empty), "auto") == {}
    with pytest.raises(ValueError, match="generation_config must be one of"):
        load_sampling_defaults(model_dir, "greedy")


def test_the_requests_own_value_wins_then_the_model_then_neutral(model_dir):
    defaults = load_sampling_defaults(model_dir, "auto")
    assert resolve({}, defaults) == {**NEUTRAL, **defaults}
    assert resolve({}, {}) == NEUTRAL
    chosen = resolve({"temperature": 0.0, "top_k": None, "min_p": 0.1}, defaults)
    # 0.0 is a value (greedy), not "unset"
    assert chosen["temperature"] == 0.0
    assert chosen["top_k"] == 20 and chosen["min_p"] == 0.1
    assert chosen["top_p"] == 0.8 and chosen["repetition_penalty"] == 1.05
