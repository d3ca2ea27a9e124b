"""Free vLLM engine arguments: checked by vLLM's own parser before a launch starts.

Building vLLM's parser imports vLLM (seconds): these tests share one parser.
"""

import pytest

from xinference.core.engine_args import (
    EngineArgumentError,
    check_names,
    parse_cli_value,
    validate_engine_args,
)
from xinference.core.options import LaunchOptionError, LaunchSpec

pytestmark = pytest.mark.slow


def test_values_come_back_as_vllm_parses_them():
    parsed = validate_engine_args(
        {
            "max-num-batched-tokens": "1k",  # vLLM's human-readable int
            "enable_chunked_prefill": False,
            "kv_cache_dtype": "auto",
            "trust_remote_code": True,
            "quantization": None,  # None: vLLM's default, not passed
        },
        xavier=False,
    )
    assert parsed == (
        ("enable_chunked_prefill", False),
        ("kv_cache_dtype", "auto"),
        ("max_num_batched_tokens", 1000),
        ("trust_remote_code", True),
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ({"swap_spice": 4}, "unknown launch option 'swap_spice'"),
        ({"max_num_batched_tokens": "many"}, "invalid engine argument"),
        ({"kv_cache_dtype": "fp3"}, "invalid choice: 'fp3'"),
        ({"enable_chunked_prefill": "sometimes"}, "invalid engine argument"),
        ({"model": "/elsewhere"}, "'model' cannot be set here"),
        ({"kv_transfer_config": {}}, "set by enable_xavier"),
        ({"data_parallel_size": 2}, "use replica"),
    ],
)
def test_bad_engine_arguments_are_refused(args, message):
    with pytest.raises(EngineArgumentError, match=message):
        validate_engine_args(args, xavier=False)


@pytest.mark.parametrize(
    "name, meant",
    [
        ("enable-xavire", "'enable_xavier' (--enable-xavier)"),  # a launch option
        ("replicas", "'replica' (--replica)"),
        (
            "max_num_batched_tokns",
            "'max_num_batched_tokens' (--max-num-batched-tokens)",
        ),
    ],
)
def test_a_misspelt_option_is_named_with_the_one_meant(name, meant):
    launch_options = {"enable_xavier", "replica", "block_size"}
    with pytest.raises(EngineArgumentError, match="did you mean") as raised:
        check_names([name], launch_options)
    assert str(raised.value).endswith(f"did you mean {meant}?")
    with pytest.raises(EngineArgumentError) as raised:
        check_names(["zzz_qqq"], launch_options)
    assert "did you mean" not in str(raised.value)  # nothing close: no guess
    check_names(["replica", "max-num-batched-tokens"], launch_options)


def test_xavier_refuses_what_it_cannot_work_without():
    with pytest.raises(EngineArgumentError, match="conflicts with enable_xavier"):
        validate_engine_args({"enable_prefix_caching": False}, xavier=True)
    assert validate_engine_args({"enable_prefix_caching": False}, xavier=False) == (
        ("enable_prefix_caching", False),
    )


def test_a_launch_carries_its_engine_arguments(tmp_path):
    spec = LaunchSpec.from_options(
        model_path=str(tmp_path),
        replica=2,
        enable_xavier=True,
        max_num_batched_tokens=512,
        quantization="fp8",  # upstream's key, a vLLM argument here
    )
    assert dict(spec.engine.extra) == {
        "max_num_batched_tokens": 512,
        "quantization": "fp8",
    }
    with pytest.raises(LaunchOptionError, match="unknown launch option 'enable_xavir'"):
        LaunchSpec.from_options(model_path=str(tmp_path), enable_xavir=True)


@pytest.mark.parametrize(
    "text, value",
    [
        ("true", True),
        ("False", False),
        ("none", None),
        ("12", 12),
        ("0.5", 0.5),
        ('{"a": 1}', {"a": 1}),
        ("bf16", "bf16"),
    ],
)
def test_cli_values_read_as_upstream_reads_them(text, value):
    assert parse_cli_value(text) == value


def test_load_format_dummy_reaches_vllm_from_the_command_line(tmp_path):
    """`xinference launch ... --load-format dummy` (a free argument: the 8B-shaped
    benchmark model has no weight files) arrives in the engine's arguments."""
    from xinference.core.messages import ReplicaSpec
    from xinference.core.vllm_engine import build_engine_args
    from xinference.deploy.cmdline import _free_arguments

    free = _free_arguments(["--load-format", "dummy"])
    assert free == {"load_format": "dummy"}
    spec = LaunchSpec.from_options(model_path=str(tmp_path), replica=2, **free)
    assert dict(spec.engine.extra) == {"load_format": "dummy"}
    replica = ReplicaSpec(
        model_uid=spec.model_uid,
        rank=0,
        num_replicas=2,
        model_path=str(tmp_path),
        engine=spec.engine,
    )
    assert build_engine_args(replica).load_format == "dummy"
