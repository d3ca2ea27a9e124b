"""Synchronous hits granted from published locations (``connector/lease_free.py``):
no reservation on the hit's path, the generations travel with the load, nothing
to release; without locations (or when the hit is not synchronous) the scheduler
reserves as before."""

from __future__ import annotations

import dataclasses

from xinference.model.llm.vllm.xavier.change_log import pack_keys, pack_locations
from xinference.model.llm.vllm.xavier.connector.scheduler import ScheduledRequest
from xinference.model.llm.vllm.xavier.connector.stale_loads import StaleLoad
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror
from xinference.model.llm.vllm.xavier.wire import DEVICE_TIER

from . import test_scheduler as base
from .test_fast_path import DeviceHolder
from .test_fast_path import policy as sync_policy
from .test_scheduler import BS, HOLDER, LOADER, NS, make_side

loop = base.loop
tracker = base.tracker
HOLDER_ADDRESS = "nixl://holder"


def policy(**overrides):
    return sync_policy(**{"lease_free": True, **overrides})


def mirrored_side(loop, tracker, holder, rule):
    mirror = TrackerMirror(
        lambda since, wait: tracker.mirror_changes(LOADER, since, wait),
        rpc_timeout_s=1.0,
    )
    side = make_side(loop, tracker, holder, load_async=True, mirror=mirror)
    side._settings = dataclasses.replace(side._settings, sync_loads=rule)

    def sync() -> None:
        mirror.apply(loop.run(tracker.mirror_changes(LOADER, mirror.version, 0.0), 1))

    sync()  # live before the holder publishes: a snapshot carries no locations
    return side, sync


def publish_located(tracker, holder, prompt, located: bool):
    keys = hash_full_blocks(prompt, BS, NS)
    locations = [(k, 2 * i, 10 + 2 * i) for i, k in enumerate(keys)]
    tracker.update_blocks(
        HOLDER, b"", pack_keys(keys), pack_locations(locations) if located else b""
    )
    holder.keys.update(keys)
    return keys


def test_a_located_synchronous_hit_needs_no_reservation(loop, tracker):
    holder = DeviceHolder()
    prompt = list(range(16))  # 3 loadable blocks
    side, sync = mirrored_side(loop, tracker, holder, policy())
    keys = publish_located(tracker, holder, prompt, located=True)
    sync()
    assert side.num_new_matched_tokens("r", prompt, 0) == (3 * BS, False)
    assert holder.reserved == []  # no round trip on the hit's path
    side.on_allocated("r", [[4, 5, 6, 7]], 3 * BS)
    step = side.build_step(
        [ScheduledRequest("r", 3 * BS, 4, [4, 5, 6, 7], whole_table=True)]
    )
    (item,) = step.loads
    assert item.asynchronous is False and item.bound_s is not None
    grant = item.load.grant
    assert grant.lease_free and grant.keys == tuple(keys[:3])
    assert grant.generations == (10, 12, 14)
    assert grant.transport_hint.per_key == (0, 2, 4)
    assert side.stats["lease_free_answers"] == 1
    params = side.request_finished("r")
    assert params["xavier_round_trips"] == 0 and params["xavier_passes_waited"] == 0
    side.flush(1.0)
    assert holder.released == []  # nothing was pinned


def test_a_lease_free_hit_needs_no_holder_of_the_blocks_the_engine_has(loop, tracker):
    """The holder published blocks 2-3 only (it loaded 0-1 from a peer); the
    loader has 0-1 itself: its lookup from block 2 finds them, lease-free."""
    holder = DeviceHolder()
    prompt = list(range(16))
    side, sync = mirrored_side(loop, tracker, holder, policy())
    keys = hash_full_blocks(prompt, BS, NS)
    located = [(k, 2 * i, 10 + 2 * i) for i, k in enumerate(keys[2:3])]
    tracker.update_blocks(HOLDER, b"", pack_keys(keys[2:3]), pack_locations(located))
    holder.keys.update(keys[2:3])
    sync()
    assert side.num_new_matched_tokens("r", prompt, 2 * BS) == (BS, False)
    assert holder.reserved == [] and side.stats["lease_free_answers"] == 1


def test_unlocated_or_asynchronous_hits_reserve_as_before(loop, tracker):
    holder = DeviceHolder()
    side, sync = mirrored_side(loop, tracker, holder, policy())
    publish_located(tracker, holder, list(range(16)), located=False)
    sync()
    assert side.num_new_matched_tokens("a", list(range(16)), 0) == (3 * BS, False)
    assert len(holder.reserved) == 1 and side.stats["lease_free_answers"] == 0

    # located, but the holder was never met: its first load is asynchronous
    fresh = DeviceHolder()
    side, sync = mirrored_side(loop, tracker, fresh, policy(enabled=True))
    side._settings.sync_loads._met.clear()
    prompt = list(range(100, 116))
    publish_located(tracker, fresh, prompt, located=True)
    sync()
    assert side.num_new_matched_tokens("b", prompt, 0) == (3 * BS, True)
    assert len(fresh.reserved) == 1 and side.stats["lease_free_answers"] == 0


def test_a_dropped_lease_free_answer_releases_nothing(loop, tracker):
    holder = DeviceHolder()
    side, sync = mirrored_side(loop, tracker, holder, policy())
    publish_located(tracker, holder, list(range(16)), located=True)
    sync()
    assert side.num_new_matched_tokens("r", list(range(16)), 0) == (3 * BS, False)
    side.on_allocated("r", [[4, 5, 6, 7]], 0)  # vLLM took its local hit instead
    side.request_finished("r")
    side.flush(1.0)
    assert holder.reserved == [] and holder.released == []


def test_no_lease_free_grant_where_the_worker_cannot_read_it(loop, tracker):
    """With another transport than NIXL the worker has no agent of its own: a
    located hit reserves (a lease-free grant would only fail and recompute)."""
    holder = DeviceHolder()
    side, sync = mirrored_side(loop, tracker, holder, policy(lease_free=False))
    publish_located(tracker, holder, list(range(16)), located=True)
    sync()
    assert side.num_new_matched_tokens("r", list(range(16)), 0) == (3 * BS, False)
    assert len(holder.reserved) == 1 and side.stats["lease_free_answers"] == 0


def lease_free_load(side, sync, tracker, holder, req_id, prompt, blocks):
    """A located synchronous hit on ``prompt``, allocated into ``blocks`` and
    planned: (its keys, its step item)."""
    keys = publish_located(tracker, holder, prompt, located=True)
    sync()
    n = len(blocks)
    assert side.num_new_matched_tokens(req_id, prompt, 0) == (n * BS, False)
    side.on_allocated(req_id, [list(blocks) + [99]], n * BS)
    (item,) = side.build_step(
        [ScheduledRequest(req_id, n * BS, 4, list(blocks) + [99], whole_table=True)]
    ).loads
    assert item.load.grant.lease_free
    return keys, item


def test_a_stale_block_fails_from_itself_on_without_backing_off_its_holder(
    loop, tracker
):
    """The worker found block 1 of 3 stale (its slot was reused since its
    location was published): blocks 1 and 2 are recomputed, block 0 stays
    loaded; the holder is not backed off (the index was stale, not the holder),
    and the mirror forgets the stale location, so the next hit on it reserves
    instead of failing again."""
    holder = DeviceHolder()
    rule = policy()
    side, sync = mirrored_side(loop, tracker, holder, rule)
    prompt = list(range(16))
    keys, item = lease_free_load(side, sync, tracker, holder, "r", prompt, [4, 5, 6])
    grant = item.load.grant
    report = StaleLoad.of(grant, [1])
    assert report.stale == ((keys[1], 2, 12),)
    assert report.failed_blocks(item.load.dst_block_ids) == (5, 6)
    side.loads_stale({"r": report})  # as update_connector_output passes them
    side.loads_failed({5, 6})
    assert side.stats["loads_failed"] == 1 and side.stats["stale_loads"] == 1
    assert side.stats["sync_loads_failed"] == 0
    assert rule.bound_s(HOLDER_ADDRESS, (DEVICE_TIER,), 1) is not None
    assert side._mirror.locate(HOLDER, keys[:1]) == [(0, 10)]
    assert side._mirror.locate(HOLDER, keys[1:2]) is None
    assert side.request_finished("r")["xavier_external_tokens"] == 1 * BS
    # the next hit on the same prefix: block 1 has no location any more
    assert side.num_new_matched_tokens("next", prompt, 0) == (3 * BS, False)
    assert len(holder.reserved) == 1 and side.stats["lease_free_answers"] == 1


def test_a_lease_free_load_past_its_bound_backs_its_holder_off(loop, tracker):
    """A timeout or a transport error is the holder's fault: its next hits go
    the asynchronous way for a while, and its locations stay (they were not
    found stale)."""
    holder = DeviceHolder()
    rule = policy()
    side, sync = mirrored_side(loop, tracker, holder, rule)
    prompt = list(range(16))
    keys, item = lease_free_load(side, sync, tracker, holder, "r", prompt, [4, 5, 6])
    side.loads_stale({})
    side.loads_failed({4, 5, 6})  # every block: no result within the bound
    assert side.stats["sync_loads_failed"] == 1 and side.stats["stale_loads"] == 0
    assert rule.bound_s(HOLDER_ADDRESS, (DEVICE_TIER,), 1) is None
    assert side._mirror.locate(HOLDER, keys[:3]) is not None
    assert side.request_finished("r") is None  # nothing came from the peer
    assert side.num_new_matched_tokens("next", prompt, 0) == (3 * BS, True)
