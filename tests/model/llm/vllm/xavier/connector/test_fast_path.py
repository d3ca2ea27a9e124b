"""Which hits a GPU-first scheduler half answers ``(n, False)`` (the synchronous fast
path) and what its step hands the worker: the same scripted holder and tracker as
``test_scheduler.py``, with a holder that grants from its device tier."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from xinference.core.options import LaunchSpec
from xinference.model.llm.vllm.xavier.config import (
    XavierConfig,
    XavierReplicaSettings,
)
from xinference.model.llm.vllm.xavier.connector.fast_path import (
    CUDA_COPY_BYTES_PER_S,
    DEFAULT_BASE_S,
    FAST_PATH_BASE_ENV,
    FAST_PATH_ENV,
    FAST_PATH_RATE_ENV,
    HOST_COPY_BYTES_PER_S,
    SyncLoadPolicy,
    address_host,
    direct_reads_wanted,
    fast_path_base_s,
    fast_path_bytes_per_s,
    fast_path_enabled,
    sync_load_policy,
)
from xinference.model.llm.vllm.xavier.connector.scheduler import (
    ScheduledRequest,
    SchedulerSide,
)
from xinference.model.llm.vllm.xavier.wire import (
    CPU_TIER,
    DEVICE_TIER,
    LeaseGrant,
    PrefixHit,
)

from . import test_scheduler as base
from .test_scheduler import BS, Holder, make_side, publish

# the scripted holder's tracker and the background loop, as test_scheduler has them
loop = base.loop
tracker = base.tracker


class DeviceHolder(Holder):
    """Grants as ``Holder`` does, from the tier ``tier``."""

    tier = DEVICE_TIER

    async def reserve(
        self, hit: PrefixHit, keys: list[bytes], lease_id: str, requester: Any
    ) -> LeaseGrant:
        grant = await super().reserve(hit, keys, lease_id, requester)
        return dataclasses.replace(grant, tiers=(self.tier,) * len(grant.keys))


def policy(**overrides: Any) -> SyncLoadPolicy:
    rule = SyncLoadPolicy(**{"enabled": True, "host": "holder", **overrides})
    for port in ("", ":1", ":2", ":1234"):
        rule.met(f"nixl://holder{port}")
    return rule


def test_the_first_load_from_a_holder_is_asynchronous():
    rule = SyncLoadPolicy(enabled=True, host="holder")
    assert rule.bound_s("nixl://holder:9", (DEVICE_TIER,), 1000) is None
    rule.met("nixl://holder:9")
    assert rule.bound_s("nixl://holder:9", (DEVICE_TIER,), 1000) is not None


def fast_side(loop, tracker, holder, sync_loads: SyncLoadPolicy) -> SchedulerSide:
    side = make_side(loop, tracker, holder, load_async=True)
    side._settings = dataclasses.replace(side._settings, sync_loads=sync_loads)
    return side


def test_the_bound_grows_with_the_bytes_and_is_capped():
    rule = policy(base_s=0.002, bytes_per_s=1e9, max_s=0.010)
    addr = "nixl://holder:1234"
    assert rule.bound_s(addr, (DEVICE_TIER,), 1_000_000) == 0.002 + 0.001
    assert rule.bound_s(addr, (DEVICE_TIER,), 9_000_000) is None  # 11 ms > 10 ms
    assert rule.bound_s(addr, (DEVICE_TIER, CPU_TIER), 1000) is None
    assert rule.bound_s("nixl://elsewhere:1234", (DEVICE_TIER,), 1000) is None
    assert policy(enabled=False).bound_s(addr, (DEVICE_TIER,), 1000) is None
    assert address_host("nixl://127.0.0.1:5") == "127.0.0.1"


def test_a_holder_that_missed_its_bound_goes_the_asynchronous_way_for_a_while():
    rule = policy(backoff_s=0.05)
    addr = "nixl://holder:1"
    rule.missed(addr)
    assert rule.bound_s(addr, (DEVICE_TIER,), 1000) is None
    assert rule.bound_s("nixl://holder:2", (DEVICE_TIER,), 1000) is not None
    rule._backed_off[addr] = 0.0  # the backoff is over
    assert rule.bound_s(addr, (DEVICE_TIER,), 1000) is not None


def test_a_bounded_hit_is_answered_synchronously_and_loads_in_that_step(loop, tracker):
    holder = DeviceHolder()
    prompt = list(range(16))  # 3 loadable blocks
    publish(tracker, holder, prompt)
    side = fast_side(loop, tracker, holder, policy())
    assert side.num_new_matched_tokens("r", prompt, 0) == (3 * BS, False)
    side.on_allocated("r", [[4, 5, 6, 7]], 3 * BS)
    step = side.build_step(
        [ScheduledRequest("r", 3 * BS, 4, [4, 5, 6, 7], whole_table=True)]
    )
    (item,) = step.loads
    assert item.asynchronous is False and item.bound_s is not None
    assert item.bound_s <= 0.010
    # the block computed on top of the load is not staged (scheduler.py says why)
    assert step.stage == ()
    assert side.stats["sync_answers"] == 1
    # counted: scheduled in the very pass that looked it up
    assert side.request_finished("r")["xavier_passes_waited"] == 0


def test_cpu_tier_hits_and_a_backed_off_holder_stay_asynchronous(loop, tracker):
    holder = DeviceHolder()
    holder.tier = CPU_TIER
    prompt = list(range(16))
    publish(tracker, holder, prompt)
    rule = policy()
    side = fast_side(loop, tracker, holder, rule)
    assert side.num_new_matched_tokens("cpu", prompt, 0) == (3 * BS, True)
    side.on_allocated("cpu", [[1, 2, 3, 8]], 3 * BS)
    (item,) = side.build_step([]).loads
    assert item.asynchronous is True and item.bound_s is None

    # A synchronous load that failed backs its holder off the fast path.
    holder.tier = DEVICE_TIER
    assert side.num_new_matched_tokens("dev", prompt, 0) == (3 * BS, False)
    side.on_allocated("dev", [[9, 10, 11, 12]], 3 * BS)
    side.build_step([ScheduledRequest("dev", 0, 16, [9, 10, 11, 12], True)])
    side.loads_failed({10})
    assert side.stats["sync_loads_failed"] == 1
    assert side.num_new_matched_tokens("next", prompt, 0) == (3 * BS, True)


def test_the_bounds_fixed_part_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(FAST_PATH_BASE_ENV, raising=False)
    assert fast_path_base_s() == DEFAULT_BASE_S
    monkeypatch.setenv(FAST_PATH_BASE_ENV, "8")
    assert fast_path_base_s() == pytest.approx(0.008)
    for wrong in ("0", "11", "fast"):
        monkeypatch.setenv(FAST_PATH_BASE_ENV, wrong)
        with pytest.raises(ValueError, match=FAST_PATH_BASE_ENV):
            fast_path_base_s()


def test_the_fast_path_is_opt_in(monkeypatch):
    """Off unless the engine's environment turns it on (until it has run on a GPU
    host, where its bound is meant to hold)."""
    monkeypatch.delenv(FAST_PATH_ENV, raising=False)
    assert not fast_path_enabled()
    monkeypatch.setenv(FAST_PATH_ENV, "1")
    assert fast_path_enabled()
    monkeypatch.setenv(FAST_PATH_ENV, "0")
    assert not fast_path_enabled()


@pytest.mark.parametrize(
    "option, env, enabled",
    [
        (None, None, False),  # the default: off
        (None, "1", True),  # unset: the environment decides
        (True, None, True),
        (True, "0", True),  # an explicit option wins over the environment
        (False, "1", False),
    ],
)
def test_the_launch_option_reaches_the_connectors_policy(
    monkeypatch, tmp_path, option, env, enabled
):
    """launch option -> XavierConfig -> the dict in kv_connector_extra_config ->
    the scheduler half's SyncLoadPolicy and the worker half's direct reads."""
    if env is None:
        monkeypatch.delenv(FAST_PATH_ENV, raising=False)
    else:
        monkeypatch.setenv(FAST_PATH_ENV, env)
    spec = LaunchSpec.from_options(
        model_path=str(tmp_path),
        replica=2,
        enable_xavier=True,
        xavier_gpu_cache_bytes="64MiB",
        xavier_fast_path=option,
    )
    settings = XavierReplicaSettings(
        spec.xavier, "m", 1, "t", "tu", "nixl://127.0.0.1:5", "xu"
    )
    arrived = XavierReplicaSettings.from_dict(settings.to_dict())
    assert arrived.config.fast_path is option
    policy = sync_load_policy(arrived, engine_on_cuda=False)
    assert policy.enabled is enabled and policy.lease_free
    assert policy.host == "127.0.0.1"
    assert policy.bytes_per_s == HOST_COPY_BYTES_PER_S
    assert direct_reads_wanted(arrived) is enabled
    # tensor parallel: the bound is per load, so never synchronous
    tp = dataclasses.replace(arrived, tensor_parallel_size=2)
    assert not sync_load_policy(tp, engine_on_cuda=True).enabled


def test_a_cuda_engine_prices_a_loads_bytes_at_a_device_rate(monkeypatch):
    """At the host rate no GPU-sized hit qualified: on an H100 every 512-token hit
    of an 8B model (64 MiB) went asynchronous. At the CUDA rate it is bounded
    within the cap; a 2,048-token one (256 MiB) is not, unless the host says its
    copies are faster."""
    monkeypatch.delenv(FAST_PATH_RATE_ENV, raising=False)
    per_token = (
        32 * 8 * 128 * 2 * 2
    )  # Llama-3.1-8B: layers, KV heads, head dim, K+V, bf16
    addr = "nixl://holder:1"
    host = policy(bytes_per_s=fast_path_bytes_per_s(engine_on_cuda=False))
    cuda = policy(bytes_per_s=fast_path_bytes_per_s(engine_on_cuda=True))
    assert cuda.bytes_per_s == CUDA_COPY_BYTES_PER_S
    assert host.bound_s(addr, (DEVICE_TIER,), 512 * per_token) is None
    bound = cuda.bound_s(addr, (DEVICE_TIER,), 512 * per_token)
    assert bound is not None and bound == pytest.approx(0.002 + 512 * per_token / 25e9)
    assert cuda.bound_s(addr, (DEVICE_TIER,), 2048 * per_token) is None
    monkeypatch.setenv(FAST_PATH_RATE_ENV, "100")
    faster = policy(bytes_per_s=fast_path_bytes_per_s(engine_on_cuda=True))
    assert faster.bound_s(addr, (DEVICE_TIER,), 2048 * per_token) is not None
    for bad in ("0", "-3", "fast", "inf"):
        monkeypatch.setenv(FAST_PATH_RATE_ENV, bad)
        with pytest.raises(ValueError, match=FAST_PATH_RATE_ENV):
            fast_path_bytes_per_s(engine_on_cuda=True)


def test_a_replica_settings_dict_with_a_non_boolean_fast_path_is_refused():
    config = XavierConfig(enabled=True, fast_path=True)
    settings = XavierReplicaSettings(
        config, "m", 1, "t", "tu", "nixl://127.0.0.1:5", "xu"
    ).to_dict()
    with pytest.raises(ValueError, match="xavier_fast_path must be a boolean"):
        XavierReplicaSettings.from_dict({**settings, "fast_path": "yes"})
