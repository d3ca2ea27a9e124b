"""A request's ``cache_salt`` in the connector: its keys are salted as vLLM salts
its own block hashes, so a salted prompt and an unsalted one (or two salts) never
share a block through Xavier: no hit across salts, and what a salted request
stages (prompt and generated blocks) is published under salted keys only."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector import scheduler
from xinference.model.llm.vllm.xavier.connector.request_state import RequestState
from xinference.model.llm.vllm.xavier.connector.scheduler import (
    ScheduledRequest,
    SchedulerSettings,
    SchedulerSide,
)
from xinference.model.llm.vllm.xavier.hashing import BlockHash, hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor
from xinference.model.llm.vllm.xavier.wire import (
    CPU_TIER,
    KVGeometry,
    LeaseGrant,
    PrefixHit,
    ReplicaIdentity,
)

BS = 4
NS = "salt-model|bfloat16|4"
HOLDER, LOADER = 0, 1
IDENTITY = ReplicaIdentity(
    model="salt-model",
    geometry=KVGeometry(num_layers=2, layer_block_nbytes=64, logical_dtype="bfloat16"),
    layout="packed_kv",
)
PROMPT = list(range(100, 113))  # 3 full blocks and one token more


class Holder:
    """Grants the leading keys it holds."""

    def __init__(self) -> None:
        self.keys: set[BlockHash] = set()
        self.reserved: list[list[BlockHash]] = []

    async def reserve(
        self, hit: PrefixHit, keys: list[BlockHash], lease_id: str, requester: Any
    ) -> LeaseGrant:
        self.reserved.append(keys)
        granted: list[BlockHash] = []
        for key in keys:
            if key not in self.keys:
                break
            granted.append(key)
        n = len(granted)
        return LeaseGrant(
            lease_id, hit.rank, tuple(granted), (CPU_TIER,) * n, ("bfloat16",) * n
        )

    async def release(self, hit: PrefixHit, lease_id: str) -> None:
        pass


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-cache-salt")
    yield background
    background.close()


@pytest.fixture
def tracker() -> BlockTrackerActor:
    actor = BlockTrackerActor()
    actor.register_replica(HOLDER, "nixl://holder")
    actor.register_replica(LOADER, "nixl://loader")
    return actor


def loader(loop: BackgroundLoop, tracker: BlockTrackerActor, holder: Holder):
    async def ask_tracker(rank: int, keys: list[BlockHash]) -> PrefixHit | None:
        return tracker.query_prefix(rank, keys)

    side = SchedulerSide(
        SchedulerSettings(
            rank=LOADER,
            namespace=NS,
            block_size=BS,
            load_async=False,
            rpc_timeout_s=2.0,
            backoff_s=60.0,
            reply_wait_s=5.0,
        ),
        loop,
        ask_tracker,
        holder.reserve,
        holder.release,
        None,
    )
    side.set_identity(IDENTITY)
    return side


def published(tracker, holder, salt: str | None) -> list[BlockHash]:
    """The holder holds PROMPT's blocks as a request salted ``salt`` left them."""
    keys = hash_full_blocks(PROMPT, BS, NS, salt)
    tracker.register_blocks(HOLDER, keys)
    holder.keys.update(keys)
    return keys


@pytest.mark.parametrize(
    "held, asked",
    [(None, "tenant-a"), ("tenant-a", None), ("tenant-a", "tenant-b")],
)
def test_no_hit_across_salts(loop, tracker, held, asked):
    holder = Holder()
    published(tracker, holder, held)
    side = loader(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", PROMPT, 0, cache_salt=asked) == (0, False)
    assert holder.reserved == []


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_hit_under_the_same_salt(loop, tracker, salt):
    holder = Holder()
    keys = published(tracker, holder, salt)
    side = loader(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", PROMPT, 0, cache_salt=salt) == (
        3 * BS,
        False,
    )
    assert holder.reserved == [keys]


def test_a_salted_request_stages_its_generated_blocks_under_its_salt(
    loop, tracker, monkeypatch
):
    """A prompt shorter than a block has no key to chain from: the first block
    of its answer is rooted at the salt, not at the unsalted root."""
    # generated blocks staged in the step they fill (not batched), for the keys
    monkeypatch.setattr(scheduler, "GENERATED_BATCH_PASSES", 1)
    side = loader(loop, tracker, Holder())
    prompt = [7, 8, 9]
    tokens = list(prompt)
    side.num_new_matched_tokens("r", prompt, 0, all_token_ids=tokens, cache_salt="s")
    side.on_allocated("r", [[30, 31]], 0)
    staged = list(
        side.build_step([ScheduledRequest("r", 0, 3, [30], whole_table=True)]).stage
    )
    for step, sampled in enumerate([41, 42, 43]):
        tokens.append(sampled)
        step_out = side.build_step(
            [ScheduledRequest("r", 3 + step, 1, [31] if len(tokens) == 5 else [])]
        )
        staged += list(step_out.stage)
    assert [item.key for item in staged] == hash_full_blocks(tokens, BS, NS, "s")[:1]
    assert staged[0].key != hash_full_blocks(tokens, BS, NS)[0]


def test_the_state_keys_are_the_salted_ones():
    state = RequestState.first_asked("r", PROMPT, None, BS, NS, 0, cache_salt="s")
    assert state.keys == hash_full_blocks(PROMPT, BS, NS, "s")
    unsalted = RequestState.first_asked("r", PROMPT, None, BS, NS, 0, cache_salt="")
    assert unsalted.keys == hash_full_blocks(PROMPT, BS, NS)


# ---- the facade reads vLLM's salt, and vLLM salts as Xavier does --------------------


def test_the_facade_hands_vllms_salt_to_the_scheduler_half():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from xinference.model.llm.vllm.xavier.connector.vllm_facade import (
        XavierConnector,
    )

    from .test_vllm_compat import PLAIN, vllm_config

    asked: list[dict[str, Any]] = []

    class Half:
        def num_new_matched_tokens(self, *args: Any, **kwargs: Any) -> Any:
            asked.append(kwargs)
            return 0, False

        def close(self) -> None:
            pass

    connector = XavierConnector(vllm_config(), KVConnectorRole.SCHEDULER, PLAIN)
    connector._scheduler = Half()  # type: ignore[assignment]
    try:
        request = types.SimpleNamespace(
            request_id="r",
            prompt_token_ids=PROMPT,
            all_token_ids=PROMPT,
            skip_reading_prefix_cache=False,
            cache_salt="tenant-a",
        )
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    finally:
        connector.shutdown()
    assert asked[0]["cache_salt"] == "tenant-a"


def test_vllm_salts_the_first_block_only_and_its_request_carries_the_salt():
    """What Xavier mirrors, read from the installed vLLM: ``Request`` takes a
    ``cache_salt``, and the salt is an extra key of block 0 alone (the hash
    chain carries it on)."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import inspect

    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    from vllm.v1.request import Request

    assert "cache_salt" in inspect.signature(Request.__init__).parameters
    # a text-only request as each vLLM release reads it (its multimodal fields
    # have had several names)
    request = types.SimpleNamespace(
        cache_salt="tenant-a",
        lora_request=None,
        mm_features=[],
        mm_positions=[],
        mm_hashes=[],
        prompt_embeds=None,
    )
    first, _ = generate_block_hash_extra_keys(request, 0, BS, 0)
    later, _ = generate_block_hash_extra_keys(request, BS, 2 * BS, 0)
    assert first is not None and any("tenant-a" in str(key) for key in first)
    assert later is None
