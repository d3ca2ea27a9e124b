"""The local model registry."""

import json

import pytest

from xinference.core.registry import UnknownModelError, registered_models, resolve_model


def test_builtin_names(tmp_path):
    models = registered_models(tmp_path)
    assert {
        "tiny-qwen2",
        "qwen2.5-0.5b-shaped",
        "llama-3.1-8b-shaped",
        "llama-3.1-shaped-mini",
    } <= set(models)


def test_user_entries_name_local_directories(tmp_path):
    model = tmp_path / "mine"
    model.mkdir()
    (tmp_path / "models.json").write_text(json.dumps({"mine": str(model)}))
    assert resolve_model("mine", tmp_path) == model
    (tmp_path / "models.json").write_text(json.dumps({"gone": str(tmp_path / "x")}))
    with pytest.raises(UnknownModelError, match="missing"):
        resolve_model("gone", tmp_path)


def test_unknown_names_list_the_known_ones(tmp_path):
    with pytest.raises(UnknownModelError, match="known: .*tiny-qwen2"):
        resolve_model("nope", tmp_path)


def test_a_broken_registry_file_is_reported(tmp_path):
    (tmp_path / "models.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        registered_models(tmp_path)


@pytest.mark.slow
def test_builtin_tiny_model_builds_offline(tmp_path):
    path = resolve_model("tiny-qwen2", tmp_path)
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert path == tmp_path / "models" / "tiny-qwen2"


@pytest.mark.slow
def test_builtin_llama_shapes_build_offline_without_weights(tmp_path):
    big = resolve_model("llama-3.1-8b-shaped", tmp_path)
    mini = resolve_model("llama-3.1-shaped-mini", tmp_path)
    layers = [
        json.loads((path / "config.json").read_text())["num_hidden_layers"]
        for path in (big, mini)
    ]
    assert layers == [32, 2]
    assert not list(big.glob("*.safetensors")) and (big / "tokenizer.json").is_file()
