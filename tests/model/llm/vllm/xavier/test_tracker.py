"""The block tracker as a real actor in a real xoscar pool."""

import pytest

from xinference.model.llm.vllm.xavier.change_log import all_changes
from xinference.model.llm.vllm.xavier.hashing import hash_full_blocks
from xinference.model.llm.vllm.xavier.tracker_mirror import TrackerMirror
from xinference.model.llm.vllm.xavier.wire import PrefixHit

KEYS = hash_full_blocks(list(range(16 * 6)), 16, "tracker-test")


async def test_longest_prefix_excludes_the_caller(tracker):
    await tracker.register_blocks(0, KEYS[:4])
    await tracker.register_blocks(1, KEYS[:2])
    assert await tracker.query_prefix(0, KEYS) == PrefixHit(1, "nixl://b", 2)
    assert await tracker.query_prefix(1, KEYS) == PrefixHit(0, "nixl://a", 4)
    assert await tracker.query_prefix(2, KEYS) == PrefixHit(0, "nixl://a", 4)


async def test_prefix_must_be_contiguous_from_the_first_block(tracker):
    """A holder of blocks 2..5 but not 1 offers nothing for this prompt."""
    await tracker.register_blocks(0, KEYS[1:5])
    assert await tracker.query_prefix(1, KEYS) is None
    await tracker.register_blocks(0, [KEYS[0]])
    assert await tracker.query_prefix(1, KEYS) == PrefixHit(0, "nixl://a", 5)


async def test_prefix_is_not_joined_across_holders(tracker):
    await tracker.register_blocks(0, KEYS[:2])
    await tracker.register_blocks(1, KEYS[2:4])
    assert await tracker.query_prefix(2, KEYS) == PrefixHit(0, "nixl://a", 2)


async def test_unregister_in_batches(tracker):
    await tracker.register_blocks(0, KEYS)
    await tracker.unregister_blocks(0, KEYS[3:])
    assert await tracker.query_prefix(1, KEYS) == PrefixHit(0, "nixl://a", 3)
    await tracker.unregister_blocks(0, KEYS)
    assert await tracker.query_prefix(1, KEYS) is None
    assert await tracker.num_blocks(0) == 0


async def test_forget_replica(tracker):
    await tracker.register_blocks(0, KEYS)
    await tracker.forget_replica(0)
    assert await tracker.query_prefix(1, KEYS) is None
    assert 0 not in await tracker.replicas()
    # unregistering on behalf of a forgotten replica is harmless
    await tracker.unregister_blocks(0, KEYS)


async def test_a_forgotten_replica_is_in_no_snapshot(tracker):
    """A mirror that starts (or resets) after a replica went away gets the whole
    index: the gone replica's keys must not be in it, or they would come back
    without an address and hide the other holders of the same prefix."""
    await tracker.register_blocks(1, KEYS)
    await tracker.register_blocks(2, KEYS[:3])
    await tracker.forget_replica(1)
    assert await tracker.num_blocks(1) == 0
    snapshot = await tracker.mirror_changes(0, -1, 0.0)
    assert snapshot.reset
    assert {change.rank for change in all_changes(snapshot) if change.keys} == {2}
    mirror = TrackerMirror(tracker.mirror_changes, rpc_timeout_s=1)
    mirror.apply(snapshot)
    assert mirror.query(0, KEYS) == PrefixHit(2, "nixl://c", 3)
    # and a replica that restarted starts with nothing in the snapshots either
    await tracker.register_replica(2, "nixl://c2")
    snapshot = await tracker.mirror_changes(0, -1, 0.0)
    assert all(not change.keys for change in all_changes(snapshot))


async def test_register_again_replaces_the_old_incarnation(tracker):
    """A restarted replica lost its snapshots: its old keys must not be served."""
    await tracker.register_blocks(0, KEYS)
    await tracker.register_replica(0, "nixl://a2")
    assert await tracker.query_prefix(1, KEYS) is None
    await tracker.register_blocks(0, KEYS[:1])
    assert await tracker.query_prefix(1, KEYS) == PrefixHit(0, "nixl://a2", 1)


async def test_blocks_of_an_unknown_replica_are_rejected(tracker):
    with pytest.raises(KeyError, match="not registered"):
        await tracker.register_blocks(9, KEYS[:1])
