"""Configurations Xavier cannot serve are refused when the connector is built.

These build real vLLM configs for the tiny model (no engine), then the connector
itself, and check that the message names the setting to change. One test starts a
real engine to show the refusal happens at engine start.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from xinference.model.llm.vllm.xavier.config import (  # noqa: E402
    XavierConfig,
    XavierReplicaSettings,
)
from xinference.model.llm.vllm.xavier.connector import vllm_compat  # noqa: E402
from xinference.model.llm.vllm.xavier.connector.vllm_compat import (  # noqa: E402
    unsupported_reasons,
)
from xinference.model.llm.vllm.xavier.connector.vllm_facade import (  # noqa: E402
    XavierConnector,
)

from ..vllm_support import EngineFailed, EngineProcess, engine_kwargs, tiny_model_path

SETTINGS = XavierReplicaSettings(
    config=XavierConfig(enabled=True),
    model_uid="m",
    rank=0,
    tracker_address="nixl://127.0.0.1:1",
    tracker_uid="xavier-block-tracker-m",
    transfer_address="nixl://127.0.0.1:1",
    transfer_uid="xavier-transfer-m-0",
).to_dict()


@pytest.fixture(scope="module", autouse=True)
def offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def vllm_config(
    policy: Literal["recompute", "fail"] = "recompute", **overrides: Any
) -> Any:
    transfer = KVTransferConfig(
        kv_connector="XavierConnector",
        kv_connector_module_path="xinference.model.llm.vllm.xavier.connector.vllm_facade",
        kv_role="kv_both",
        kv_load_failure_policy=policy,
        kv_connector_extra_config={"xavier": SETTINGS},
    )
    kwargs: dict[str, Any] = dict(
        model=str(tiny_model_path()),
        dtype="bfloat16",
        enforce_eager=True,
        block_size=32,
        max_model_len=512,
        kv_transfer_config=transfer,
        disable_hybrid_kv_cache_manager=True,
    )
    kwargs.update(overrides)
    return EngineArgs(**kwargs).create_engine_config()


def attention(names: list[str]) -> KVCacheGroupSpec:
    spec = FullAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
    )
    return KVCacheGroupSpec(names, spec)


def cache_config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=list(groups)
    )


PLAIN = cache_config(attention(["model.layers.0.self_attn.attn"]))


def refusal(config: Any, kv: KVCacheConfig = PLAIN) -> str:
    with pytest.raises(ValueError) as info:
        XavierConnector(config, KVConnectorRole.SCHEDULER, kv)
    return str(info.value)


def test_supported_configuration_has_no_reasons():
    assert unsupported_reasons(vllm_config(), PLAIN) == []


def test_tensor_parallel_is_supported():
    assert unsupported_reasons(vllm_config(tensor_parallel_size=2), PLAIN) == []


def test_tensor_parallel_size_other_than_launched_is_refused():
    # The replica was launched with tensor_parallel_size 1 (SETTINGS): an engine
    # running 2 ranks would split the KV heads unlike its peers.
    message = refusal(vllm_config(tensor_parallel_size=2))
    assert "the engine runs tensor_parallel_size=2" in message
    assert "launched with 1" in message


def test_pipeline_parallel_is_refused():
    config = vllm_config()
    config.parallel_config.pipeline_parallel_size = 2
    message = refusal(config)
    assert "pipeline_parallel_size=2" in message


def test_lora_is_refused():
    message = refusal(vllm_config(enable_lora=True))
    assert "LoRA is enabled" in message and "enable_lora" in message


def test_multimodal_is_refused(monkeypatch):
    config = vllm_config()
    monkeypatch.setattr(
        type(config.model_config), "is_multimodal_model", property(lambda self: True)
    )
    assert "multimodal model" in refusal(config)


def test_hybrid_attention_is_refused():
    kv = cache_config(
        attention(["model.layers.0.self_attn.attn"]),
        attention(["model.layers.1.self_attn.attn"]),
    )
    message = refusal(vllm_config(), kv)
    assert "2 KV cache groups" in message
    assert "disable_hybrid_kv_cache_manager=True" in message


def test_recurrent_layers_are_refused():
    mamba = MambaSpec(block_size=32, shapes=((4, 4),), dtypes=(torch.float32,))
    kv = cache_config(KVCacheGroupSpec(["model.layers.0.mixer"], mamba))
    message = refusal(vllm_config(), kv)
    assert "MambaSpec" in message and "attention-only model" in message


def test_failing_load_policy_is_refused():
    message = refusal(vllm_config(policy="fail"))
    assert "kv_load_failure_policy='recompute'" in message


def test_old_vllm_is_refused(monkeypatch):
    monkeypatch.setattr(vllm_compat.vllm, "__version__", "0.25.1")
    message = refusal(vllm_config())
    assert "vLLM 0.25.1 is too old" in message and ">= 0.26" in message


def test_newer_vllm_is_warned_about_not_refused(monkeypatch, caplog):
    monkeypatch.setattr(vllm_compat.vllm, "__version__", "0.40.0")
    assert unsupported_reasons(vllm_config(), PLAIN) == []
    with caplog.at_level("WARNING", logger=vllm_compat.__name__):
        vllm_compat.warn_if_untested()
    assert "not been tested with vLLM 0.40.0" in caplog.text
    caplog.clear()
    monkeypatch.setattr(vllm_compat.vllm, "__version__", "0.26.0")
    vllm_compat.warn_if_untested()
    assert caplog.text == ""


def test_missing_settings_are_refused():
    config = vllm_config()
    config.kv_transfer_config.kv_connector_extra_config = {}
    assert "kv_connector_extra_config" in refusal(config)


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_start_fails_with_the_reason():
    """A real engine whose connector refuses its configuration does not start, and
    its log says what to change."""
    kwargs = engine_kwargs(tiny_model_path(), SETTINGS)
    kwargs["kv_transfer"]["kv_load_failure_policy"] = "fail"
    engine = EngineProcess("refused", kwargs).start()
    try:
        with pytest.raises(EngineFailed) as info:
            engine.wait_ready(timeout=180)
        assert "kv_load_failure_policy='recompute'" in info.value.log
    finally:
        engine.stop()
