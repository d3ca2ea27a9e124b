"""Launch options: every rule that refuses a launch, and what a valid launch yields."""

import pytest

from xinference.core.options import LaunchOptionError, LaunchSpec, default_model_uid


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "my-model"
    path.mkdir()
    return str(path)


def launch(model_dir, **options):
    return LaunchSpec.from_options(model_path=model_dir, **options)


def test_valid_xavier_launch_yields_a_frozen_spec(model_dir):
    spec = launch(
        model_dir, replica=2, enable_xavier=True, xavier_gpu_cache_bytes="256MiB"
    )
    assert spec.model_uid == "my-model"
    assert spec.model_engine == "vllm"
    assert spec.xavier.enabled and spec.xavier.gpu_cache_bytes == 256 * 1024**2
    assert spec.xavier.describe().startswith("Xavier: on, GPU-first")
    with pytest.raises(AttributeError):
        spec.replica = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "size, expected", [(0, 0), ("0", 0), (1024, 1024), ("1GiB", 1024**3), (None, None)]
)
def test_gpu_cache_sizes(model_dir, size, expected):
    spec = launch(model_dir, replica=2, enable_xavier=True, xavier_gpu_cache_bytes=size)
    assert spec.xavier.gpu_cache_bytes == expected
    assert spec.xavier.gpu_first == (expected is not None)


def test_xavier_off_is_the_default(model_dir):
    spec = launch(model_dir)
    assert not spec.xavier.enabled
    assert spec.xavier.describe() == "Xavier: off"


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(replica=1, enable_xavier=True), "needs replica >= 2, got 1"),
        (
            dict(replica=2, enable_xavier=True, model_engine="transformers"),
            "vLLM engine only, got model_engine 'transformers'",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_gpu_cache_bytes=-1),
            "must be non-negative, got -1",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_gpu_cache_bytes="-5MiB"),
            "malformed size '-5MiB'",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_gpu_cache_bytes="lots"),
            "malformed size 'lots'",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_gpu_cache_bytes="1.5GiB"),
            "malformed size",
        ),
        (
            dict(replica=2, enable_xavier=True, tensor_parallel_size=2),
            "tensor_parallel_size and pipeline_parallel_size must be 1, got 2 and 1",
        ),
        (
            dict(replica=2, enable_xavier=True, pipeline_parallel_size=2),
            "must be 1, got 1 and 2",
        ),
        (
            dict(replica=2, xavier_gpu_cache_bytes="256MiB"),
            "xavier_gpu_cache_bytes is set but enable_xavier is not",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_transport="carrier-pigeon"),
            "unknown xavier transport",
        ),
        (
            dict(replica=2, router="cache-aware"),
            "cache-aware router needs enable_xavier",
        ),
        (dict(router="random"), "unknown router 'random'"),
        (dict(replica=0), "replica must be >= 1, got 0"),
        (dict(replica="2"), "replica must be an integer"),
        (dict(model_engine="llama.cpp"), "unsupported model_engine 'llama.cpp'"),
        (dict(enable_xavier="yes"), "enable_xavier must be a boolean"),
        (dict(model_uid="bad uid!"), "model_uid 'bad uid!' must be"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
    ],
)
def test_invalid_options_are_refused_with_a_clear_error(model_dir, options, message):
    with pytest.raises(LaunchOptionError, match=_literal(message)):
        launch(model_dir, **options)


def test_model_source_must_be_exactly_one(model_dir, tmp_path):
    with pytest.raises(LaunchOptionError, match="exactly one of model_name"):
        LaunchSpec.from_options()
    with pytest.raises(LaunchOptionError, match="exactly one of model_name"):
        LaunchSpec.from_options(model_name="tiny-qwen2", model_path=model_dir)
    with pytest.raises(LaunchOptionError, match="is not a directory"):
        LaunchSpec.from_options(model_path=str(tmp_path / "missing"))
    with pytest.raises(LaunchOptionError, match="unknown model_name 'nope'"):
        LaunchSpec.from_options(model_name="nope")


def test_a_registry_name_is_resolved_later(monkeypatch, tmp_path):
    monkeypatch.setenv("XINFERENCE_HOME", str(tmp_path))
    spec = LaunchSpec.from_options(model_name="tiny-qwen2", replica=2)
    assert spec.model_uid == "tiny-qwen2" and spec.model_path is None
    assert spec.with_model_path("/x").model_path == "/x"


def test_default_model_uid():
    assert default_model_uid("tiny-qwen2", None) == "tiny-qwen2"
    assert default_model_uid(None, "/models/Qwen2.5-0.5B/") == "Qwen2.5-0.5B"


def _literal(text):
    import re

    return re.escape(text)
