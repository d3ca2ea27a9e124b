"""The scheduler half of the connector, without vLLM.

The tracker is the real ``BlockTrackerActor`` logic called in process; holders are
small scripted coroutines (grant, refuse, fail, hang), because what is under test
here is the scheduler's decisions, not the transfer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from xinference.model.llm.vllm.xavier.aio import BackgroundLoop
from xinference.model.llm.vllm.xavier.connector import scheduler
from xinference.model.llm.vllm.xavier.connector.scheduler import (
    ScheduledRequest,
    SchedulerSettings,
    SchedulerSide,
)
from xinference.model.llm.vllm.xavier.connector.step import RequestLoad
from xinference.model.llm.vllm.xavier.hashing import BlockHash, hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker import BlockTrackerActor
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror
from xinference.model.llm.vllm.xavier.wire import (
    CPU_TIER,
    KVGeometry,
    LeaseGrant,
    PrefixHit,
    ReplicaIdentity,
)

BS = 4
NS = "test-model|bfloat16|4"
IDENTITY = ReplicaIdentity(
    model="test-model",
    geometry=KVGeometry(num_layers=2, layer_block_nbytes=64, logical_dtype="bfloat16"),
    layout="packed_kv",
)
HOLDER, LOADER = 0, 1


class Holder:
    """A scripted holder: grants the leading keys it has, or misbehaves."""

    def __init__(self) -> None:
        self.keys: set[BlockHash] = set()
        self.mode = "grant"  # grant | refuse | fail | hang | substitute
        # "substitute": the key it grants at this position instead of the one asked
        self.substitute_at = 1
        self.delay_s = 0.0  # how long it takes to answer
        self.reserved: list[tuple[str, list[BlockHash]]] = []
        self.released: list[str] = []

    async def reserve(
        self, hit: PrefixHit, keys: list[BlockHash], lease_id: str, requester: Any
    ) -> LeaseGrant:
        assert requester == IDENTITY
        self.reserved.append((lease_id, keys))
        if self.mode == "fail":
            raise ConnectionRefusedError("holder is gone")
        if self.mode == "incompatible":
            raise ValueError("model differs: 'other' here, 'test-model' on the peer")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay_s)
        granted: list[BlockHash] = []
        if self.mode == "grant":
            for key in keys:
                if key not in self.keys:
                    break
                granted.append(key)
        elif self.mode == "substitute":  # a wrong key amid the right ones
            granted = list(keys)
            granted[self.substitute_at] = b"\xee" * 16
        n = len(granted)
        return LeaseGrant(
            lease_id, hit.rank, tuple(granted), (CPU_TIER,) * n, ("bfloat16",) * n
        )

    async def release(self, hit: PrefixHit, lease_id: str) -> None:
        self.released.append(lease_id)


@pytest.fixture
def unbatched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated blocks staged in the step they fill, as a batch of one pass: the
    tests of what is staged under which key, apart from when."""
    monkeypatch.setattr(scheduler, "GENERATED_BATCH_PASSES", 1)


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    background = BackgroundLoop("test-scheduler-side")
    yield background
    background.close()


@pytest.fixture
def tracker() -> BlockTrackerActor:
    actor = BlockTrackerActor()
    actor.register_replica(HOLDER, "nixl://holder")
    actor.register_replica(LOADER, "nixl://loader")
    return actor


def make_side(
    loop: BackgroundLoop,
    tracker: BlockTrackerActor,
    holder: Holder,
    load_async: bool = False,
    rpc_timeout_s: float = 2.0,
    query_prefix: Any = None,
    mirror: TrackerMirror | None = None,
    reply_wait_s: float = 5.0,
    remote_loads: bool = True,
) -> SchedulerSide:
    """A loader's scheduler half. ``reply_wait_s`` defaults past every deadline
    here, so that a lookup answers at once as it did before answers could be
    deferred; the tests of deferred answers set it short."""

    async def ask_tracker(rank: int, keys: list[BlockHash]) -> PrefixHit | None:
        return tracker.query_prefix(rank, keys)

    side = SchedulerSide(
        SchedulerSettings(
            rank=LOADER,
            namespace=NS,
            block_size=BS,
            load_async=load_async,
            rpc_timeout_s=rpc_timeout_s,
            backoff_s=60.0,
            reply_wait_s=reply_wait_s,
            remote_loads=remote_loads,
        ),
        loop,
        query_prefix or ask_tracker,
        holder.reserve,
        holder.release,
        mirror,
    )
    side.set_identity(IDENTITY)
    return side


def publish(
    tracker: BlockTrackerActor, holder: Holder, prompt: list[int]
) -> list[BlockHash]:
    keys = hash_full_blocks(prompt, BS, NS)
    tracker.register_blocks(HOLDER, keys)
    holder.keys.update(keys)
    return keys


def test_the_last_prompt_token_never_counts(loop, tracker):
    """A 12-token prompt whose 3 blocks are all held: only 2 can be supplied,
    because vLLM must compute the last prompt token itself."""
    holder = Holder()
    prompt = list(range(12))
    keys = publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (8, False)
    assert holder.reserved[0][1] == keys[:2]
    # With one more token the third block becomes loadable.
    side2 = make_side(loop, tracker, holder)
    assert side2.num_new_matched_tokens("s", prompt + [99], 0) == (12, False)


def test_hit_beyond_local_blocks_reserves_only_the_missing_ones(loop, tracker):
    holder = Holder()
    prompt = list(range(20))
    keys = publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder, load_async=True)
    # vLLM has the first block locally: the peer supplies blocks 1..3 (4 is last-token).
    assert side.num_new_matched_tokens("r", prompt, BS) == (3 * BS, True)
    assert holder.reserved[0][1] == keys[1:4]
    assert side.stats["hits"] == 1


def test_local_prefix_covering_the_lookup_asks_nobody(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 8) == (0, False)
    assert holder.reserved == []


def test_routing_only_never_loads_yet_stages(loop, tracker):
    """Remote loads off (routing only): a prefix the tracker lists on a peer is
    neither looked up nor reserved, and the request's own blocks are still staged,
    so the tracker (and the cache-aware router) learns what this replica holds."""
    holder = Holder()
    prompt = list(range(9))
    keys = publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder, remote_loads=False)
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)
    assert holder.reserved == [] and side.stats["lookups"] == 0
    side.on_allocated("r", [[4, 5, 6]], 0)
    step = side.build_step([ScheduledRequest("r", 0, 9, [4, 5, 6], whole_table=True)])
    assert step.loads == ()
    assert [(s.key, s.block_id) for s in step.stage] == [(keys[0], 4), (keys[1], 5)]


def test_no_identity_yet_is_a_miss(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    side._identity = None  # the worker has not mapped its caches yet
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)
    assert holder.reserved == []


def test_refused_reservation_is_a_miss_and_released(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    holder.mode = "refuse"
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]
    assert side.stats["misses_refused"] == 1


def test_evicted_snapshot_shortens_the_grant(loop, tracker):
    """The tracker still lists 3 blocks but the holder dropped the third one."""
    holder = Holder()
    prompt = list(range(13))
    keys = publish(tracker, holder, prompt)
    holder.keys.discard(keys[2])
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (2 * BS, False)


def test_a_grant_is_used_only_up_to_its_first_key_that_differs(loop, tracker):
    """The holder grants 3 keys, the second not the one asked for: only the
    first is loaded (the third matches, but follows a block that is not the
    prompt's: its KV belongs to another prefix), and the grant carries only it."""
    holder = Holder()
    prompt = list(range(13))
    keys = publish(tracker, holder, prompt)
    holder.mode = "substitute"
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (BS, False)
    assert holder.reserved[0][1] == keys[:3]
    side.on_allocated("r", [[4, 5, 6, 7]], BS)
    step = side.build_step(
        [ScheduledRequest("r", BS, 13 - BS, [4, 5, 6, 7], whole_table=True)]
    )
    (item,) = step.loads
    assert item.load is not None
    assert item.load.grant.keys == (keys[0],)
    assert item.load.dst_block_ids == (4,)
    assert side.stats["hit_blocks"] == 1


def test_failed_holder_is_a_miss_and_backed_off(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    holder.mode = "fail"
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)
    # The next request does not pay for the dead holder again.
    assert side.num_new_matched_tokens("s", prompt, 0) == (0, False)
    assert len(holder.reserved) == 1
    assert side.stats["misses_peer_error"] == 1
    side.flush(2)
    assert holder.released == []  # refused connections granted nothing


def test_incompatible_holder_is_a_miss_and_named(loop, tracker, caplog):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    holder.mode = "incompatible"
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)
    assert side.num_new_matched_tokens("s", prompt, 0) == (0, False)
    assert len(holder.reserved) == 1  # not asked again
    assert side.stats["misses_incompatible"] == 1
    assert "cannot share KV" in caplog.text and "model differs" in caplog.text
    side.flush(2)
    assert holder.released == []  # nothing was granted


# What a wait on a peer may take beyond its deadline. Below BackgroundLoop.run's
# backstop (deadline + 1 s) on purpose: a lost deadline must fail these tests.
MARGIN_S = 0.5


def test_hanging_holder_costs_one_deadline(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    holder.mode = "hang"
    side = make_side(loop, tracker, holder, rpc_timeout_s=0.3)
    started = time.monotonic()
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)
    assert time.monotonic() - started < 0.3 + MARGIN_S
    assert side.stats["misses_peer_error"] == 1
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]  # in case it granted late


def test_a_slow_holder_is_answered_on_a_later_pass(loop, tracker):
    """Past ``reply_wait_s`` vLLM is told to ask again; a second request to the
    same holder while the first is unanswered does not wait at all; once the
    holder answers, the next ask of each request is its hit."""
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    holder.delay_s = 0.5
    side = make_side(loop, tracker, holder, reply_wait_s=0.1)
    started = time.monotonic()
    assert side.num_new_matched_tokens("r", prompt, 0) == (None, False)
    assert 0.1 <= time.monotonic() - started < 0.1 + MARGIN_S / 2
    started = time.monotonic()
    assert side.num_new_matched_tokens("s", prompt, 0) == (None, False)
    assert time.monotonic() - started < 0.1  # the holder is known slow: no wait
    assert side.num_new_matched_tokens("r", prompt, 0) == (None, False)
    assert side.stats["deferred"] == 2
    deadline = time.monotonic() + 0.5 + MARGIN_S
    for request in ("r", "s"):
        while side.num_new_matched_tokens(request, prompt, 0) == (None, False):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert side.num_new_matched_tokens(request, prompt, 0) == (8, False)
    assert len(holder.reserved) == 2 and side.stats["hits"] == 2
    # The holder answered: the next request waits for it again, and gets its hit
    # in the same call.
    holder.delay_s = 0.0
    assert side.num_new_matched_tokens("t", prompt, 0) == (8, False)
    assert side.stats["deferred"] == 2


def test_a_holder_that_never_answers_is_a_miss_at_the_deadline(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    holder.mode = "hang"
    side = make_side(loop, tracker, holder, rpc_timeout_s=0.3, reply_wait_s=0.02)
    started = time.monotonic()
    answers = []
    while (answer := side.num_new_matched_tokens("r", prompt, 0)) == (None, False):
        answers.append(answer)
        assert time.monotonic() - started < 0.3 + MARGIN_S  # the deadline holds
        time.sleep(0.02)
    assert answer == (0, False)
    assert 0.3 <= time.monotonic() - started < 0.3 + MARGIN_S
    assert len(answers) >= 2 and side.stats["misses_peer_error"] == 1
    # backed off: another request is a miss at once, and nothing more is asked
    assert side.num_new_matched_tokens("s", prompt, 0) == (0, False)
    assert len(holder.reserved) == 1
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]  # in case it granted late


def test_unanswered_reservations_end_when_their_holder_is_given_up(loop, tracker):
    """The first reservation's deadline backs off from the holder: a later one,
    still unanswered, is a miss at its next ask, not at its own deadline; both
    leases are released (in case the holder granted late)."""
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    holder.mode = "hang"
    side = make_side(loop, tracker, holder, rpc_timeout_s=0.5, reply_wait_s=0.02)
    started = time.monotonic()
    assert side.num_new_matched_tokens("r", prompt, 0) == (None, False)
    time.sleep(0.25)
    assert side.num_new_matched_tokens("s", prompt, 0) == (None, False)
    while (answer := side.num_new_matched_tokens("r", prompt, 0)) == (None, False):
        assert time.monotonic() - started < 0.5 + MARGIN_S  # r's deadline holds
        time.sleep(0.01)
    assert answer == (0, False)
    assert side.num_new_matched_tokens("s", prompt, 0) == (0, False)
    assert time.monotonic() - started < 0.5 + 0.25  # before s's own deadline
    assert side.stats["misses_peer_error"] == 2
    time.sleep(0.25 + MARGIN_S)  # s's call reaches its deadline in the loop
    side.flush(2)
    assert sorted(holder.released) == sorted(lease for lease, _ in holder.reserved)
    assert len(holder.reserved) == 2


@pytest.mark.parametrize("answered_first", [False, True])
def test_a_reservation_given_up_while_unanswered_is_released_once(
    loop, tracker, answered_first
):
    """The request goes away before vLLM asks again: the lease the holder grants
    is released exactly once, by the loop when the answer comes later, by the
    scheduler when it had come already."""
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    holder.delay_s = 0.2
    side = make_side(loop, tracker, holder, reply_wait_s=0.01)
    assert side.num_new_matched_tokens("r", prompt, 0) == (None, False)
    if answered_first:
        time.sleep(0.2 + MARGIN_S)
    assert side.request_finished("r") is None
    time.sleep(0.2 + MARGIN_S)
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]
    assert side.stats["hits"] == 0


def test_a_reservation_past_its_deadline_given_up_is_released(loop, tracker):
    """The holder never answered, the loop's deadline passed (the holder may still
    grant after it), then the request went away before vLLM asked again: the
    scheduler gives it up, and the lease must be released now, not at its TTL."""
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    holder.mode = "hang"
    side = make_side(loop, tracker, holder, rpc_timeout_s=0.2, reply_wait_s=0.01)
    assert side.num_new_matched_tokens("r", prompt, 0) == (None, False)
    time.sleep(0.2 + MARGIN_S)  # the deadline passed in the loop
    assert holder.released == []  # the loop left the lease to the scheduler
    assert side.request_finished("r") is None
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]


def test_a_longer_local_prefix_replaces_an_unanswered_reservation(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    keys = publish(tracker, holder, prompt)
    holder.delay_s = 0.4
    side = make_side(loop, tracker, holder, reply_wait_s=0.1)
    assert side.num_new_matched_tokens("r", prompt, 0) == (None, False)
    # vLLM found the first block locally meanwhile: the second block only. The
    # holder has not answered the first yet, so the scheduler does not wait.
    started = time.monotonic()
    assert side.num_new_matched_tokens("r", prompt, 4) == (None, False)
    assert time.monotonic() - started < 0.1
    time.sleep(0.4 + MARGIN_S)
    assert side.num_new_matched_tokens("r", prompt, 4) == (4, False)
    assert [k for _, k in holder.reserved] == [keys[:2], keys[1:2]]
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]


def test_hanging_tracker_costs_one_deadline(loop, tracker):
    """A tracker that never answers is a miss at the deadline; the query is
    cancelled, nothing is reserved, and the tracker is not asked again at once."""
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    asked: list[int] = []
    cancelled: list[int] = []

    async def silent_tracker(rank: int, keys: list[BlockHash]) -> PrefixHit | None:
        asked.append(rank)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(rank)
            raise
        raise AssertionError("never set")

    side = make_side(
        loop, tracker, holder, rpc_timeout_s=0.3, query_prefix=silent_tracker
    )
    started = time.monotonic()
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)
    assert 0.3 <= time.monotonic() - started < 0.3 + MARGIN_S
    assert side.stats["misses_peer_error"] == 1
    assert holder.reserved == []
    started = time.monotonic()
    assert side.num_new_matched_tokens("s", prompt, 0) == (0, False)
    assert time.monotonic() - started < MARGIN_S  # backed off, not asked
    assert asked == [LOADER]
    loop.run(asyncio.sleep(0), 1)  # the loop has run the cancellation
    assert cancelled == [LOADER]


def test_asking_again_reuses_the_standing_reservation(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    first = side.num_new_matched_tokens("r", prompt, 0)
    again = side.num_new_matched_tokens("r", prompt, 0)
    assert first == again == (8, False)
    assert len(holder.reserved) == 1
    # A longer local prefix replaces it.
    assert side.num_new_matched_tokens("r", prompt, 4) == (4, False)
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]


def test_allocation_turns_the_reservation_into_a_load(loop, tracker):
    holder = Holder()
    prompt = list(range(16))  # 4 full blocks; the last one is not loadable
    keys = publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, BS) == (2 * BS, False)
    side.on_allocated("r", [[7, 8, 9, 10]], 2 * BS)
    step = side.build_step(
        [ScheduledRequest("r", 3 * BS, 4, [7, 8, 9, 10], whole_table=True)]
    )
    (item,) = step.loads
    assert item.req_id == "r" and item.load is not None
    assert item.load.dst_block_ids == (8, 9)
    assert item.load.grant.keys == tuple(keys[1:3])
    assert item.load.holder_address == "nixl://holder"
    # Nothing is staged: the loaded blocks are the holder's, and block 3, full
    # after this forward, could not be found here behind them.
    assert step.stage == ()
    assert side.stats["staged_blocks"] == 0
    # The lease now belongs to the load: finishing the request does not release it.
    # Counted: scheduled in the pass that looked it up; the tracker (no mirror
    # here) and the holder asked once each, plus what the worker reported.
    side.record_load_round_trips({"r": 3, "other": 5}, {"r": 0.0025, "other": 1.0})
    assert side.request_finished("r") == {
        "xavier_external_tokens": 2 * BS,
        "xavier_holder_rank": HOLDER,
        "xavier_passes_waited": 0,
        "xavier_passes_deferred": 0,
        "xavier_round_trips": 2 + 3,
        "xavier_load_ms": 2.5,  # the load's own time, as the worker measured it
    }
    side.flush(2)
    assert holder.released == []


def test_null_destination_is_reported_as_failed(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    side.num_new_matched_tokens("r", prompt, 0)
    side.on_allocated("r", [[None, 5, 6]], 2 * BS)
    (item,) = side.build_step([]).loads
    assert item.load is None and item.failed_block_ids == (5,)
    side.flush(2)
    assert len(holder.released) == 1


def test_zero_external_tokens_after_reservation_releases_it(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    side.num_new_matched_tokens("r", prompt, 0)
    side.on_allocated("r", [[1, 2, 3]], 0)
    assert side.build_step([]).loads == ()
    side.flush(2)
    assert len(holder.released) == 1


def test_finished_before_allocation_releases_the_lease(loop, tracker):
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    side.num_new_matched_tokens("r", prompt, 0)
    assert side.request_finished("r") is None  # aborted while waiting
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]


def test_chunked_prefill_stages_each_full_block_once(loop, tracker):
    holder = Holder()
    side = make_side(loop, tracker, holder)
    prompt = list(range(100, 111))  # 2 full blocks and a tail of 3
    keys = hash_full_blocks(prompt, BS, NS)
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)
    side.on_allocated("r", [[4, 5, 6]], 0)
    # vLLM sends the whole table first, then only appended blocks.
    step1 = side.build_step([ScheduledRequest("r", 0, 6, [4, 5], whole_table=True)])
    step2 = side.build_step([ScheduledRequest("r", 6, 5, [6])])
    step3 = side.build_step([ScheduledRequest("r", 11, 1, [])])  # decode
    assert [(s.key, s.block_id) for s in step1.stage] == [(keys[0], 4)]
    assert [(s.key, s.block_id) for s in step2.stage] == [(keys[1], 5)]
    assert step3.stage == ()


def test_a_resumed_request_stages_into_its_new_block_table(loop, tracker):
    """Preempted after its first block was staged, the request comes back with a
    whole new table (vLLM lists it in resumed_req_ids): later blocks are staged
    from the new table, not from positions appended to the old one."""
    side = make_side(loop, tracker, Holder())
    prompt = list(range(200, 213))  # 3 full blocks and a tail of 1
    keys = hash_full_blocks(prompt, BS, NS)
    side.num_new_matched_tokens("r", prompt, 0)
    first = side.build_step([ScheduledRequest("r", 0, 4, [3], whole_table=True)])
    assert [(s.key, s.block_id) for s in first.stage] == [(keys[0], 3)]
    # Preempted; resumed with a local hit on block 0 only, in other blocks.
    again = side.build_step(
        [ScheduledRequest("r", BS, 9, [8, 9, 11, 12], whole_table=True)]
    )
    assert [(s.key, s.block_id) for s in again.stage] == [(keys[1], 9), (keys[2], 11)]


def test_appended_blocks_without_a_whole_table_are_never_staged(loop, tracker):
    """Staging by guessed positions could publish a block under another block's key:
    a request whose whole table vLLM never sent publishes nothing."""
    side = make_side(loop, tracker, Holder())
    prompt = list(range(300, 309))
    side.num_new_matched_tokens("r", prompt, 0)
    assert side.build_step([ScheduledRequest("r", 0, 9, [5, 6])]).stage == ()


def test_unknown_requests_are_not_staged(loop, tracker):
    side = make_side(loop, tracker, Holder())
    step = side.build_step([ScheduledRequest("x", 0, 8, [1, 2], whole_table=True)])
    assert step.stage == ()


def test_tracker_failure_is_a_miss(loop, tracker):
    holder = Holder()

    async def broken(rank: int, keys: list[BlockHash]) -> PrefixHit | None:
        raise ConnectionError("tracker unreachable")

    side = make_side(loop, tracker, holder, query_prefix=broken)
    assert side.num_new_matched_tokens("r", list(range(9)), 0) == (0, False)
    assert side.stats["misses_peer_error"] == 1


def test_background_loop_deadline_cancels():
    background = BackgroundLoop("deadline")
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            background.run(asyncio.sleep(10), 0.2)
        assert time.monotonic() - started < 0.2 + MARGIN_S
        assert background.run(asyncio.sleep(0, result=5), 1) == 5
    finally:
        background.close()
    with pytest.raises(RuntimeError, match="closed"):
        background.submit(asyncio.sleep(0))


def test_a_request_gets_one_load_at_most(loop, tracker):
    """vLLM asks again about a request whose load failed (it recomputes from the
    first failed block): a second remote hit would retry the same failing load
    for ever, so the answer is now 0."""
    holder = Holder()
    prompt = list(range(500, 513))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (3 * BS, False)
    side.on_allocated("r", [[1, 2, 3, 4]], 3 * BS)
    assert len(side.build_step([]).loads) == 1
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)


def test_an_abandoned_load_fails_its_blocks_and_is_not_retried(loop, tracker):
    """The facade could not turn a reservation into a load (a fault after vLLM
    counted external tokens): the lease goes back, the worker is told to fail the
    request's blocks, and the request is not offered a remote hit again."""
    holder = Holder()
    prompt = list(range(600, 613))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (3 * BS, False)
    side.abandon_load("r", [7, None, 8])
    (item,) = side.build_step([]).loads
    assert item.load is None and item.failed_block_ids == (7, 8)
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]
    assert side.num_new_matched_tokens("r", prompt, 0) == (0, False)


def test_an_abandoned_load_is_reported_failed_even_if_its_release_fails(loop, tracker):
    """The fallback of a failed allocation: the request's blocks are queued as
    failed before its lease is let go, so a release that raises (here: the loop
    is closed) cannot keep vLLM from recomputing them."""
    holder = Holder()
    prompt = list(range(9))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (8, False)
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        side.abandon_load("r", (4, 5, None))
    assert side.build_step([]).loads == (
        RequestLoad("r", None, (4, 5), asynchronous=False),
    )


def test_failing_pending_loads_releases_their_leases(loop, tracker):
    holder = Holder()
    prompt = list(range(700, 713))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    side.num_new_matched_tokens("r", prompt, 0)
    side.on_allocated("r", [[4, 5, 6, 9]], 3 * BS)
    step = side.fail_pending_loads()
    (item,) = step.loads
    assert item.load is None and item.failed_block_ids == (4, 5, 6)
    assert side.build_step([]).loads == ()
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]


def test_a_load_the_worker_reports_failed_is_not_reported_as_a_hit(loop, tracker):
    """vLLM hands the connector the blocks the worker could not load; a request
    whose load wrote one of them recomputed its prefix, so its output must not
    claim external tokens."""
    holder = Holder()
    prompt = list(range(800, 813))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    side.num_new_matched_tokens("r", prompt, 0)
    side.on_allocated("r", [[4, 5, 6, 9]], 3 * BS)
    side.build_step([])
    side.loads_failed({99})  # another request's block: no change
    assert side.request_finished("r") is not None
    side.num_new_matched_tokens("s", prompt, 0)
    side.on_allocated("s", [[14, 15, 16, 19]], 3 * BS)
    side.build_step([])
    side.loads_failed({15})
    assert side.request_finished("s") is None
    assert side.stats["loads_failed"] == 1


def test_generated_tokens_are_staged_under_the_chain_of_prompt_and_answer(
    loop, tracker, unbatched
):
    """Decode fills blocks of generated tokens: each is staged once, in the step
    whose forward computes its last token, under the key a later prompt holding
    the same tokens (the next turn of the conversation) looks up."""
    side = make_side(loop, tracker, Holder())
    prompt = list(range(500, 506))  # 1 full block and a tail of 2
    tokens = list(prompt)  # vLLM's live view: it grows as tokens are generated
    side.num_new_matched_tokens("r", prompt, 0, all_token_ids=tokens)
    side.on_allocated("r", [[7, 8]], 0)
    prefill = side.build_step([ScheduledRequest("r", 0, 6, [7, 8], whole_table=True)])
    staged = [(s.key, s.block_id) for s in prefill.stage]
    for step, sampled in enumerate([41, 42, 43, 44, 45]):
        tokens.append(sampled)  # sampled by the previous forward
        decode = side.build_step(
            [ScheduledRequest("r", 6 + step, 1, [9] if len(tokens) == 9 else [])]
        )
        staged += [(s.key, s.block_id) for s in decode.stage]
    keys = hash_full_blocks(tokens, BS, NS)
    # 11 tokens known, 10 computed (the last sampled one is computed next step).
    assert staged == [(keys[0], 7), (keys[1], 8)]
    assert len(keys) == 2
    tokens.append(46)
    last = side.build_step([ScheduledRequest("r", 11, 1, [])])
    assert [(s.key, s.block_id) for s in last.stage] == [
        (hash_full_blocks(tokens, BS, NS)[2], 9)
    ]


def test_what_a_request_computed_on_loaded_blocks_is_staged_once_the_load_ended(
    loop, tracker, unbatched
):
    """The blocks computed on top of loaded ones hold KV computed from the loaded
    KV: they are staged only once the worker reported the load ended (a failed
    load's blocks come with that report and move the mark back), in the
    request's next step. The loaded blocks are not staged again: their holder
    has them."""
    holder = Holder()
    prompt = list(range(700, 717))  # 4 full blocks and a tail of 1
    publish(tracker, holder, prompt[:8])  # the holder has the first 2
    tokens = list(prompt)
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0, all_token_ids=tokens) == (
        2 * BS,
        False,
    )
    side.on_allocated("r", [[30, 31, 32, 33, 34]], 2 * BS)
    prefill = side.build_step(
        [ScheduledRequest("r", 2 * BS, 9, [30, 31, 32, 33, 34], whole_table=True)]
    )
    assert prefill.loads and prefill.stage == ()
    tokens.append(51)
    waiting = side.build_step([ScheduledRequest("r", 17, 1, [])])
    assert waiting.stage == ()  # asynchronous scheduling: no report yet
    side.record_load_round_trips({"r": 0})  # the step's output: the load ended
    keys = hash_full_blocks(prompt, BS, NS)
    staged = []
    for step, sampled in enumerate([52, 53, 54]):  # fills block 4
        tokens.append(sampled)
        decode = side.build_step([ScheduledRequest("r", 18 + step, 1, [])])
        staged += [(s.key, s.block_id) for s in decode.stage]
    assert staged == [
        (keys[2], 32),
        (keys[3], 33),
        (hash_full_blocks(tokens, BS, NS)[4], 34),
    ]


def test_a_lookup_asks_for_the_run_from_the_first_block_the_engine_lacks(loop, tracker):
    """Sharing runs both ways: the replica that loaded blocks 0-1 from a peer and
    computed 2-3 holds 2-3 only, and the peer, which has 0-1 itself, loads 2-3
    from it (a key names its tokens and all before them, so no holder of 0-1 is
    needed). A replica with nothing locally gets the peer's blocks 0-1."""
    holder = Holder()
    prompt = list(range(400, 417))  # 4 full blocks and a tail of 1
    keys = hash_full_blocks(prompt, BS, NS)
    tracker.register_blocks(HOLDER, keys[2:4])  # computed after a loaded prefix
    holder.keys.update(keys[2:4])
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 2 * BS) == (2 * BS, False)
    assert holder.reserved[-1][1] == keys[2:4]
    side.request_finished("r")
    assert side.num_new_matched_tokens("cold", prompt, 0) == (0, False)


def test_a_block_waits_until_vllm_hands_over_its_last_token(loop, tracker, unbatched):
    """With asynchronous scheduling vLLM computes a token before the connector
    sees its id: the block is staged at a later step, never under a key guessed
    from fewer tokens."""
    side = make_side(loop, tracker, Holder())
    prompt = list(range(600, 607))  # 1 full block and a tail of 3
    tokens = list(prompt)
    side.num_new_matched_tokens("r", prompt, 0, all_token_ids=tokens)
    side.build_step([ScheduledRequest("r", 0, 7, [1, 2], whole_table=True)])
    # Position 7 is computed now, but its token id is not known yet.
    assert side.build_step([ScheduledRequest("r", 7, 1, [])]).stage == ()
    tokens.append(77)
    later = side.build_step([ScheduledRequest("r", 8, 1, [3])])
    assert [(s.key, s.block_id) for s in later.stage] == [
        (hash_full_blocks(tokens, BS, NS)[1], 2)
    ]


class Decoding:
    """One request decoding under vLLM's eyes: its prompt (1 full block and a
    tail of 2) in the first step, then one token a step, each handed over the
    step after it was sampled, with a new block allocated as it is needed."""

    def __init__(self, side: SchedulerSide, req_id: str, first_block: int) -> None:
        self.side, self.req_id = side, req_id
        self.prompt = list(range(500 + first_block, 506 + first_block))
        self.tokens = list(self.prompt)  # vLLM's live view
        self.next_block = first_block + 2
        side.num_new_matched_tokens(req_id, self.prompt, 0, all_token_ids=self.tokens)
        self.computed = 0

    def prefill(self) -> ScheduledRequest:
        table = [self.next_block - 2, self.next_block - 1]
        self.computed = len(self.prompt)
        return ScheduledRequest(self.req_id, 0, len(self.prompt), table, True)

    def step(self) -> ScheduledRequest:
        self.tokens.append(1000 + len(self.tokens))  # sampled by the last forward
        new = []
        if self.computed % BS == 0:  # its token starts a block
            new, self.next_block = [self.next_block], self.next_block + 1
        item = ScheduledRequest(self.req_id, self.computed, 1, new)
        self.computed += 1
        return item

    def key(self, index: int) -> BlockHash:
        return hash_full_blocks(self.tokens, BS, NS)[index]


def test_generated_blocks_go_in_batches_while_their_request_runs(loop, tracker):
    """Decode fills a block of each running request every few steps; those are
    held back and staged together every GENERATED_BATCH_PASSES steps, or at once
    with a step that stages prompt blocks anyway, under their tokens' keys."""
    side = make_side(loop, tracker, Holder())
    r = Decoding(side, "r", 7)
    first = side.build_step([r.prefill()])
    assert [s.block_id for s in first.stage] == [7]  # prompt blocks at once
    batch = scheduler.GENERATED_BATCH_PASSES
    staged = [side.build_step([r.step()]).stage for _ in range(1, batch + 1)]
    # blocks 1 and 2 filled at passes 2 and 6; held until pass `batch`
    assert all(step == () for step in staged[:-1])
    assert [(s.key, s.block_id) for s in staged[-1]] == [
        (r.key(1), 8),
        (r.key(2), 9),
    ]
    for _ in range(3):  # fills block 3
        assert side.build_step([r.step()]).stage == ()
    # a new request's prompt blocks take r's held block along at once
    b = Decoding(side, "b", 20)
    with_prompt = side.build_step([r.step(), b.prefill()])
    assert [(s.key, s.block_id) for s in with_prompt.stage] == [
        (b.key(0), 20),
        (r.key(3), 10),
    ]


def test_held_blocks_of_a_request_that_ends_or_is_preempted_are_dropped(loop, tracker):
    """Only a request scheduled in the batch's step surely still owns its blocks:
    held blocks of one that finished are never staged, nor those of one
    preempted (its blocks freed) while it waits; resumed in a new block table,
    it stages them from the new one as vLLM recomputes them."""
    side = make_side(loop, tracker, Holder())
    r, q, p = (
        Decoding(side, name, at) for name, at in (("r", 7), ("q", 30), ("p", 50))
    )
    side.build_step([r.prefill(), q.prefill(), p.prefill()])
    steps = [side.build_step([r.step(), q.step(), p.step()]) for _ in range(2)]
    assert all(step.stage == () for step in steps)  # each filled block 1, held
    side.request_finished("r")
    batch = scheduler.GENERATED_BATCH_PASSES
    # q is preempted: only p is scheduled until and through a batch's step
    staged = [side.build_step([p.step()]).stage for _ in range(batch)]
    assert [(s.key, s.block_id) for step in staged for s in step] == [
        (p.key(1), 51),
        (p.key(2), 52),
    ]
    # q resumes in another table, with a local hit on block 0, recomputing
    # positions 4-6 (its 8th token, sampled, comes next)
    resumed = ScheduledRequest("q", BS, 3, [40, 41], whole_table=True)
    q.computed, q.next_block = 2 * BS - 1, 42
    staged = [side.build_step([resumed]).stage]
    staged += [side.build_step([q.step()]).stage for _ in range(batch)]
    got = [(s.key, s.block_id) for step in staged for s in step]
    # block 1 from the new table, never r's (8) nor q's old one (31)
    assert got[0] == (q.key(1), 41) and not {8, 31} & {b for _, b in got}, got


def test_a_prompt_that_is_not_the_start_of_the_tokens_is_refused(loop, tracker):
    side = make_side(loop, tracker, Holder())
    with pytest.raises(ValueError, match="does not start with its prompt"):
        side.num_new_matched_tokens("r", [1, 2, 3], 0, all_token_ids=[1, 2, 4])


def test_blocks_recomputed_after_a_failed_load_are_staged(loop, tracker):
    """A synchronous load fails: the blocks computed in its forward on top of the
    loaded ones are not published, and after vLLM recomputes from the first failed
    block, every block from there on is staged with its right key (this replica
    now holds the prefix up to its end)."""
    holder = Holder()
    prompt = list(range(900, 917))  # 4 full blocks and a tail of 1
    keys = publish(tracker, holder, prompt[:8])  # the holder has 2 blocks
    side = make_side(loop, tracker, holder)
    assert side.num_new_matched_tokens("r", prompt, 0) == (2 * BS, False)
    side.on_allocated("r", [[20, 21, 22, 23, 24]], 2 * BS)
    step = side.build_step(
        [ScheduledRequest("r", 2 * BS, 9, [20, 21, 22, 23, 24], whole_table=True)]
    )
    assert step.stage == ()
    all_keys = hash_full_blocks(prompt, BS, NS)
    # the step's output: the load ended, with block 21 failed
    side.record_load_round_trips({"r": 1})
    side.loads_failed({21})
    assert side.stats["loads_failed"] == 1
    # vLLM truncates the computed tokens to the failed block and recomputes.
    again = side.build_step([ScheduledRequest("r", BS, 13, [])])
    assert [(s.key, s.block_id) for s in again.stage] == [
        (keys[1], 21),
        (all_keys[2], 22),
        (all_keys[3], 23),
    ]
    assert side.request_finished("r") is None  # nothing came from a peer


def test_a_load_that_cannot_start_stages_nothing_in_its_step(loop, tracker):
    holder = Holder()
    prompt = list(range(950, 963))
    publish(tracker, holder, prompt)
    side = make_side(loop, tracker, holder)
    side.num_new_matched_tokens("r", prompt, 0)
    side.on_allocated("r", [[None, 5, 6, 7]], 2 * BS)
    step = side.build_step(
        [ScheduledRequest("r", 2 * BS, 5, [0, 5, 6, 7], whole_table=True)]
    )
    assert step.stage == ()
    side.loads_failed({5})
    again = side.build_step([ScheduledRequest("r", BS, 9, [])])
    assert [s.block_id for s in again.stage] == [5, 6]  # 7 holds the tail


class CountingTracker:
    """Asks the real tracker logic, counting the round trips."""

    def __init__(self, tracker: BlockTrackerActor) -> None:
        self.tracker = tracker
        self.queries = 0

    async def __call__(self, rank: int, keys: list[BlockHash]) -> PrefixHit | None:
        self.queries += 1
        return self.tracker.query_prefix(rank, keys)


def synced_mirror(loop: BackgroundLoop, tracker: BlockTrackerActor) -> TrackerMirror:
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(LOADER, since, wait),
        rpc_timeout_s=1,
    )
    mirror.apply(loop.run(tracker.mirror_changes(LOADER, -1, 0.0), 1))
    return mirror


def test_with_a_ready_mirror_a_miss_costs_no_round_trip(loop, tracker):
    holder = Holder()
    publish(tracker, holder, list(range(100, 120)))  # someone else's prefix
    mirror = synced_mirror(loop, tracker)
    asked = CountingTracker(tracker)
    side = make_side(loop, tracker, holder, query_prefix=asked, mirror=mirror)
    for n in range(20):
        prompt = list(range(1000 * n, 1000 * n + 40))
        assert side.num_new_matched_tokens(f"r{n}", prompt, 0) == (0, False)
    assert asked.queries == 0 and holder.reserved == []
    assert side.stats["mirror_lookups"] == 20


def test_with_a_ready_mirror_a_hit_costs_one_round_trip(loop, tracker):
    holder = Holder()
    keys = publish(tracker, holder, list(range(20)))
    mirror = synced_mirror(loop, tracker)
    asked = CountingTracker(tracker)
    side = make_side(loop, tracker, holder, query_prefix=asked, mirror=mirror)
    assert side.num_new_matched_tokens("r", list(range(20)), 0) == (4 * BS, False)
    assert asked.queries == 0
    assert [wanted for _, wanted in holder.reserved] == [keys[:4]]


def test_a_stale_mirror_costs_a_miss_never_a_wrong_load(loop, tracker):
    """The mirror still lists snapshots the holder dropped: the reservation grants
    nothing and the request computes its blocks."""
    holder = Holder()
    publish(tracker, holder, list(range(20)))
    mirror = synced_mirror(loop, tracker)
    holder.keys.clear()  # evicted; the mirror has not heard yet
    side = make_side(loop, tracker, holder, mirror=mirror)
    assert side.num_new_matched_tokens("r", list(range(20)), 0) == (0, False)
    assert side.stats["misses_refused"] == 1
    side.flush(2)
    assert holder.released == [holder.reserved[0][0]]


def test_a_block_this_replica_already_published_is_not_staged_again(loop, tracker):
    """A local hit recomputes the block that holds its prompt's last token; the
    serve that cached the prompt here published it, so only blocks the tracker
    does not list for this replica are staged."""
    prompt = list(range(300, 312))  # 3 full blocks
    keys = hash_full_blocks(prompt, BS, NS)
    tracker.register_blocks(LOADER, keys[:2])
    mirror = synced_mirror(loop, tracker)
    side = make_side(loop, tracker, Holder(), mirror=mirror)
    side.num_new_matched_tokens("r", prompt, 0)
    step = side.build_step([ScheduledRequest("r", 0, 12, [4, 5, 6], whole_table=True)])
    assert [(s.key, s.block_id) for s in step.stage] == [(keys[2], 6)]
    assert side.stats["already_published"] == 2


def test_until_the_mirror_is_ready_the_tracker_is_asked(loop, tracker):
    holder = Holder()
    publish(tracker, holder, list(range(20)))
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(LOADER, since, wait),
        rpc_timeout_s=1,
    )
    asked = CountingTracker(tracker)
    side = make_side(loop, tracker, holder, query_prefix=asked, mirror=mirror)
    assert side.num_new_matched_tokens("r", list(range(20)), 0) == (4 * BS, False)
    assert asked.queries == 1 and side.stats["mirror_lookups"] == 0
