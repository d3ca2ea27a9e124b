"""Launch options: every rule that refuses a launch, and what a valid launch yields."""

import pytest

from xinference.core.options import LaunchOptionError, LaunchSpec, default_model_uid
from xinference.model.llm.vllm.xavier.config import format_size


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
    "size, expected",
    [
        (0, 0),
        ("0", 0),
        (1024, 1024),
        ("1GiB", 1024**3),
        ("2GB", 2 * 1000**3),
        ("256MiB", 256 * 1024**2),
        ("1TiB", 1024**4),
        ("1TB", 1000**4),
        ("3 tib", 3 * 1024**4),
        (None, None),
    ],
)
def test_gpu_cache_sizes(model_dir, size, expected):
    spec = launch(model_dir, replica=2, enable_xavier=True, xavier_gpu_cache_bytes=size)
    assert spec.xavier.gpu_cache_bytes == expected
    assert spec.xavier.gpu_first == (expected is not None)


def test_routing_only_keeps_publishing_and_turns_loads_off(model_dir):
    spec = launch(
        model_dir,
        replica=2,
        enable_xavier=True,
        xavier_remote_loads=False,
        router="cache-aware",
    )
    assert spec.xavier.enabled and not spec.xavier.remote_loads
    assert spec.xavier.describe().endswith(", remote loads off (routing only)")
    assert launch(model_dir, replica=2, enable_xavier=True).xavier.remote_loads


def test_xavier_off_is_the_default(model_dir):
    spec = launch(model_dir)
    assert not spec.xavier.enabled
    assert spec.xavier.describe() == "Xavier: off"


def test_generation_config_defaults_to_auto_and_reaches_the_engine(model_dir):
    from xinference.core.messages import ReplicaSpec
    from xinference.core.vllm_engine import build_engine_args

    assert launch(model_dir).engine.generation_config == "auto"
    spec = launch(model_dir, generation_config="vllm")
    assert spec.engine.generation_config == "vllm"
    replica = ReplicaSpec(
        model_uid=spec.model_uid,
        model_path=str(model_dir),
        rank=0,
        num_replicas=1,
        engine=spec.engine,
        xavier=None,
    )
    assert build_engine_args(replica).generation_config == "vllm"


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
            dict(replica=2, enable_xavier=True, pipeline_parallel_size=2),
            "pipeline_parallel_size must be 1, got 2",
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
        (
            dict(replica=2, xavier_remote_loads=False),
            "xavier_remote_loads=false (routing only) needs enable_xavier",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_remote_loads="no"),
            "xavier_remote_loads must be a boolean, got 'no'",
        ),
        (
            dict(replica=2, enable_xavier=True, xavier_fast_path="yes"),
            "xavier_fast_path must be a boolean, got 'yes'",
        ),
        (
            dict(replica=2, xavier_fast_path=False),
            "xavier_fast_path is set but enable_xavier is not",
        ),
        (dict(router="random"), "unknown router 'random'"),
        (dict(replica=0), "replica must be >= 1, got 0"),
        (dict(replica="2"), "replica must be an integer"),
        (dict(model_engine="llama.cpp"), "unsupported model_engine 'llama.cpp'"),
        (dict(enable_xavier="yes"), "enable_xavier must be a boolean"),
        (dict(model_uid="bad uid!"), "model_uid 'bad uid!' must be"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
        # upstream Xinference's launch keys
        (dict(model_type="embedding"), "model_type 'embedding' is not served here"),
        (dict(model_format="ggufv2"), "model_format 'ggufv2' is not supported"),
        (dict(n_gpu=None), "n_gpu=None (CPU only) cannot be chosen"),
        (dict(n_gpu="none"), "n_gpu=None (CPU only) cannot be chosen"),
        (dict(n_gpu=0), "n_gpu must be >= 1, got 0"),
        (dict(n_gpu=2, tensor_parallel_size=4), "n_gpu=2 and tensor_parallel_size=4"),
        (dict(gpu_idx=[0, 0]), "gpu_idx repeats a GPU: [0, 0]"),
        (dict(gpu_idx=[-1]), "gpu_idx must be >= 0, got -1"),
        (dict(gpu_idx="0,1"), "gpu_idx must be a GPU index or a list of them"),
        (
            dict(peft_model_config={"lora_list": [{"lora_name": "a"}]}),
            "peft_model_config (LoRA adapters) is not supported",
        ),
        (dict(n_worker=2), "n_worker=2 is not supported"),
        (dict(request_limits=4), "request_limits=4 is not supported"),
        (dict(envs={"A": "1"}), "envs={'A': '1'} is not supported"),
        (dict(generation_config="greedy"), "generation_config must be one of auto"),
    ],
)
def test_invalid_options_are_refused_with_a_clear_error(model_dir, options, message):
    with pytest.raises(LaunchOptionError, match=_literal(message)):
        launch(model_dir, **options)


def test_a_model_source_is_required(model_dir, tmp_path):
    with pytest.raises(LaunchOptionError, match="give model_name"):
        LaunchSpec.from_options()
    with pytest.raises(LaunchOptionError, match="is not a directory"):
        LaunchSpec.from_options(model_path=str(tmp_path / "missing"))
    with pytest.raises(LaunchOptionError, match="unknown model_name 'nope'"):
        LaunchSpec.from_options(model_name="nope")


def test_a_registry_name_is_resolved_later(monkeypatch, tmp_path):
    monkeypatch.setenv("XINFERENCE_HOME", str(tmp_path))
    spec = LaunchSpec.from_options(model_name="tiny-qwen2", replica=2)
    assert spec.model_uid == "tiny-qwen2" and spec.model_path is None
    assert spec.with_model_path("/x").model_path == "/x"


def test_a_name_with_a_path_names_the_model_and_the_path_is_loaded(model_dir):
    # Upstream launches a model by its name from a local path: any name will do.
    spec = LaunchSpec.from_options(model_name="qwen2.5-instruct", model_path=model_dir)
    assert spec.model_uid == "qwen2.5-instruct"
    assert spec.model_path == model_dir and spec.model_name == "qwen2.5-instruct"


def test_upstream_clients_default_payload_is_accepted(model_dir):
    """What upstream's client sends for a plain launch: every key, mostly null."""
    spec = launch(
        model_dir,
        model_type="LLM",
        model_engine=None,
        model_size_in_billions=None,
        model_format=None,
        quantization=None,
        replica=2,
        n_worker=1,
        n_gpu="auto",
        peft_model_config=None,
        request_limits=None,
        worker_ip=None,
        gpu_idx=None,
        replica_config=None,
        enable_thinking=None,
        enable_virtual_env=None,
        virtual_env_packages=None,
        virtual_env_find_links=None,
        envs=None,
        enable_xavier=True,
    )
    assert spec.model_engine == "vllm" and spec.replica == 2 and spec.xavier.enabled
    assert spec.engine.extra == () and spec.gpu_idx is None and spec.worker_ip is None


def test_upstream_placement_keys_have_their_meaning(model_dir):
    spec = launch(model_dir, n_gpu=2, gpu_idx=[1, 0], worker_ip="127.0.0.1")
    assert spec.engine.tensor_parallel_size == 2
    assert spec.gpu_idx == (1, 0) and spec.worker_ip == "127.0.0.1"
    assert launch(model_dir, gpu_idx=3).gpu_idx == (3,)


@pytest.mark.parametrize(
    "options", [dict(tensor_parallel_size=2), dict(n_gpu=2), dict(n_gpu="2")]
)
def test_xavier_accepts_tensor_parallel_replicas(model_dir, options):
    spec = launch(model_dir, replica=2, enable_xavier=True, **options)
    assert spec.xavier.enabled and spec.engine.tensor_parallel_size == 2


def test_default_model_uid():
    assert default_model_uid("tiny-qwen2", None) == "tiny-qwen2"
    assert default_model_uid(None, "/models/Qwen2.5-0.5B/") == "Qwen2.5-0.5B"


def _literal(text):
    import re

    return re.escape(text)


def test_remote_loads_reach_the_connector_settings(model_dir):
    """The switch travels in kv_connector_extra_config as a plain dict."""
    from xinference.model.llm.vllm.xavier.config import XavierReplicaSettings

    spec = launch(model_dir, replica=2, enable_xavier=True, xavier_remote_loads=False)
    settings = XavierReplicaSettings(spec.xavier, "m", 1, "t", "tu", "nixl://x", "xu")
    back = XavierReplicaSettings.from_dict(settings.to_dict())
    assert back.config == spec.xavier and back.config.remote_loads is False


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (1536, "1.5 KiB"),
        (256 * 1024**2, "256.0 MiB"),
        (1024**4, "1.0 TiB"),
        (2048 * 1024**4, "2048.0 TiB"),
    ],
)
def test_sizes_are_written_for_people(nbytes, text):
    assert format_size(nbytes) == text
