"""Synchronous hits granted from published locations (``connector/lease_free.py``):
no reservation on the hit's path, the generations travel with the load, nothing
to release; without locations (or when the hit is not synchronous) the scheduler
reserves as before."""

from __future__ import annotations

import dataclasses

from xinference.model.llm.vllm.xavier.change_log import pack_keys, pack_locations
from xinference.model.llm.vllm.xavier.connector.scheduler import ScheduledRequest
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror

from . import test_scheduler as base
from .test_fast_path import DeviceHolder
from .test_fast_path import policy as sync_policy
from .test_scheduler import BS, HOLDER, LOADER, NS, make_side

loop = base.loop
tracker = base.tracker


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
