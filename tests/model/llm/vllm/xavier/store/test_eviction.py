"""LRUOrder: recency order with counted pins, tested with plain values."""

from __future__ import annotations

import pytest

from xinference.model.llm.vllm.xavier.store.eviction import LRUOrder


def _order(*keys: str) -> LRUOrder[str]:
    order: LRUOrder[str] = LRUOrder()
    for key in keys:
        order.touch(key)
    return order


def test_iterates_least_recent_first_and_touch_moves_to_most_recent():
    order = _order("a", "b", "c")
    assert list(order) == ["a", "b", "c"]
    order.touch("a")
    assert list(order) == ["b", "c", "a"]
    order.touch("d")
    assert list(order) == ["b", "c", "a", "d"]
    assert len(order) == 4
    assert "c" in order and "z" not in order


def test_oldest_evictable_is_the_least_recent_and_changes_nothing():
    order = _order("a", "b", "c")
    assert order.oldest_evictable() == "a"
    assert order.oldest_evictable() == "a"
    assert list(order) == ["a", "b", "c"]


def test_oldest_evictable_on_empty_order_is_none():
    assert LRUOrder().oldest_evictable() is None


def test_pinned_keys_are_skipped_but_keep_their_place():
    order = _order("a", "b", "c")
    order.pin("a")
    assert order.oldest_evictable() == "b"
    assert list(order) == ["a", "b", "c"]
    order.touch("a")  # a pinned key can still be used
    assert list(order) == ["b", "c", "a"]
    assert order.is_pinned("a") and not order.is_pinned("b")


def test_all_pinned_gives_none():
    order = _order("a", "b")
    order.pin("a")
    order.pin("b")
    assert order.oldest_evictable() is None


def test_pins_are_counted():
    """Two leases pin one key; the key stays pinned until both are released."""
    order = _order("a", "b")
    order.pin("a")
    order.pin("a")
    order.unpin("a")
    assert order.is_pinned("a")
    assert order.oldest_evictable() == "b"
    order.unpin("a")
    assert not order.is_pinned("a")
    assert order.oldest_evictable() == "a"


def test_predicate_filters_candidates():
    order: LRUOrder[int] = LRUOrder()
    for key in (1, 2, 3, 4):
        order.touch(key)
    assert order.oldest_evictable(lambda k: k % 2 == 0) == 2
    order.pin(2)
    assert order.oldest_evictable(lambda k: k % 2 == 0) == 4
    assert order.oldest_evictable(lambda k: k > 10) is None


def test_remove_forgets_the_key():
    order = _order("a", "b")
    order.remove("a")
    assert list(order) == ["b"]
    assert order.oldest_evictable() == "b"


def test_remove_refuses_pinned_and_unknown_keys():
    order = _order("a")
    order.pin("a")
    with pytest.raises(ValueError, match="pinned"):
        order.remove("a")
    assert list(order) == ["a"]
    with pytest.raises(KeyError, match="not in the recency order"):
        order.remove("zz")


def test_pin_unknown_and_unpin_unpinned_raise():
    order = _order("a")
    with pytest.raises(KeyError, match="cannot pin"):
        order.pin("zz")
    with pytest.raises(KeyError, match="not pinned"):
        order.unpin("a")


def test_iteration_is_a_snapshot_so_callers_may_mutate_while_walking():
    order = _order("a", "b", "c")
    for key in order:
        order.remove(key)
    assert len(order) == 0
