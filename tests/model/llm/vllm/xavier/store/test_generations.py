"""Generation words of the device tier (``store/generations.py``): a lease-free
reader that finds its slot reused, during or before its read, gets a mismatch (the
block is failed and recomputed), never another snapshot's rows as its key's."""

from __future__ import annotations

import pytest
import torch

from xinference.model.llm.vllm.xavier.store.generations import (
    SlotGenerations,
    is_stable,
    mismatches,
    verified_read,
)
from xinference.model.llm.vllm.xavier.store.tiered import TieredKVSnapshotStore
from xinference.model.llm.vllm.xavier.wire import KVGeometry

GEOMETRY = KVGeometry(num_layers=2, layer_block_nbytes=8, logical_dtype="bfloat16")
L = GEOMETRY.num_layers


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def make_store(device_blocks: int, cpu_blocks: int = 4) -> TieredKVSnapshotStore:
    return TieredKVSnapshotStore(
        GEOMETRY, "cpu", device_blocks * GEOMETRY.block_nbytes, cpu_blocks
    )


def put(store: TieredKVSnapshotStore, i: int) -> None:
    (slot,) = store.begin_stage_batch([key(i)], "bfloat16")
    rows = store.rows(slot.tier)
    rows[slot.first_row : slot.first_row + L] = i
    store.mark_layers_written(key(i), range(L))
    store.publish(key(i))


class LeaseFreeReader:
    """A loader's view of one holder store: where it was told a key is (row and
    generation, as published), and a read of those rows without a lease."""

    def __init__(self, store: TieredKVSnapshotStore, i: int) -> None:
        location = store.device_location(key(i))
        assert location is not None
        self.store = store
        self.first_row, self.generation = location
        self.slot = self.first_row // L
        self.rows = torch.empty((L, GEOMETRY.layer_block_nbytes), dtype=torch.uint8)

    def read(self, during_read=lambda: None) -> list[int]:
        def read_rows() -> None:
            during_read()  # the holder acts while the READ is in flight
            self.rows.copy_(self.store.device_rows[self.first_row : self.first_row + L])

        def read_words() -> list[int]:
            return self.store.generations.read([self.slot])

        return verified_read(read_rows, read_words, [self.generation])


def test_published_generations_are_even_and_grow_per_reuse():
    words = SlotGenerations(2)
    seen = []
    for _ in range(3):
        words.begin_rewrite(0)
        assert words.current(0) % 2 == 1  # odd while being rewritten
        seen.append(words.publish(0))
    assert all(is_stable(g) for g in seen)
    assert seen == sorted(set(seen))
    # an abandoned rewrite (odd) and a new one still end above everything before
    words.begin_rewrite(0)
    words.begin_rewrite(0)
    assert words.current(0) % 2 == 1
    assert words.publish(0) > seen[-1]
    assert not is_stable(0)
    with pytest.raises(AssertionError, match="without begin_rewrite"):
        words.publish(1)


def test_a_restarted_store_never_repeats_a_generation_of_the_one_before():
    before = SlotGenerations(1)
    before.begin_rewrite(0)
    published = before.publish(0)
    after = SlotGenerations(1)  # the holder restarted: a new store, same slot
    after.begin_rewrite(0)
    assert after.publish(0) > published


def test_an_undisturbed_lease_free_read_is_accepted():
    store = make_store(device_blocks=2)
    put(store, 1)
    reader = LeaseFreeReader(store, 1)
    assert reader.read() == []
    assert bool((reader.rows == 1).all())


def test_a_slot_reused_between_publish_and_read_fails_the_block():
    """The key is demoted (its device slot handed to a new snapshot) after the
    loader learned its location: the rows read are the new key's, and the word
    says so."""
    store = make_store(device_blocks=1)
    put(store, 1)
    reader = LeaseFreeReader(store, 1)
    put(store, 2)  # demotes key 1; key 2 takes its device slot
    assert store.device_location(key(2))[0] == reader.first_row
    assert reader.read() == [0]
    assert bool((reader.rows == 2).all())  # what a read without the check loads


def test_a_slot_rewritten_while_the_read_runs_fails_the_block():
    store = make_store(device_blocks=1)
    put(store, 1)
    reader = LeaseFreeReader(store, 1)

    def reuse_mid_read() -> None:
        # a new snapshot is staged into the slot: the word turns odd before any
        # of its rows is written, and stays odd until it is published
        (slot,) = store.begin_stage_batch([key(3)], "bfloat16")
        store.rows(slot.tier)[slot.first_row] = 3

    assert reader.read(during_read=reuse_mid_read) == [0]
    assert store.generations.current(reader.slot) % 2 == 1


def test_the_word_is_read_after_the_rows():
    """A reuse that starts during the READ and is published before it ends: only
    a word read after the rows shows it."""
    store = make_store(device_blocks=1)
    put(store, 1)
    reader = LeaseFreeReader(store, 1)
    assert reader.read(during_read=lambda: put(store, 4)) == [0]
    assert bool((reader.rows == 4).all())


def test_an_undone_demotion_republishes_under_a_new_generation(monkeypatch):
    store = make_store(device_blocks=1)
    put(store, 1)
    before = store.device_location(key(1))
    from xinference.model.llm.vllm.xavier.store import demotions

    def failing_copy(*args, **kwargs):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(demotions, "copy_snapshot_rows", failing_copy)
    with pytest.raises(RuntimeError, match="copy failed"):
        store.begin_stage_batch([key(2)], "bfloat16")
    after = store.device_location(key(1))
    assert after is not None and after[0] == before[0]
    assert is_stable(after[1]) and after[1] > before[1]
    assert store.generations.current(after[0] // L) == after[1]


def test_cpu_tier_and_staging_snapshots_have_no_device_location():
    store = make_store(device_blocks=0, cpu_blocks=2)
    put(store, 1)
    assert store.device_location(key(1)) is None
    store = make_store(device_blocks=1)
    store.begin_stage_batch([key(5)], "bfloat16")
    assert store.device_location(key(5)) is None


def test_mismatches_checks_every_position_and_refuses_unpublished_words():
    assert mismatches([2, 4, 6], [2, 5, 6]) == [1]
    assert mismatches([3], [3]) == [0]  # odd: never a published generation
    assert mismatches([0], [0]) == [0]
    with pytest.raises(ValueError, match="read back"):
        mismatches([2, 4], [2])
