"""Routing policies, with plain numbers."""

import pytest

from xinference.core.router import (
    CacheAwareRouter,
    RoundRobinRouter,
    RouteFacts,
    make_router,
)


def test_round_robin_cycles_over_replicas_whatever_the_facts():
    router = RoundRobinRouter()
    picks = [
        router.choose(RouteFacts(in_flight=(5, 0, 0), holder=2, prefix_blocks=9))
        for _ in range(7)
    ]
    assert picks == [0, 1, 2, 0, 1, 2, 0]
    assert not router.needs_prefix


def test_cache_aware_prefers_the_prefix_holder_within_the_margin():
    router = CacheAwareRouter(busy_margin=2)
    assert router.needs_prefix
    # holder 1 has two more requests than the least busy: still within the margin
    assert router.choose(RouteFacts(in_flight=(0, 2), holder=1, prefix_blocks=4)) == 1


def test_cache_aware_skips_a_holder_busier_than_the_margin():
    router = CacheAwareRouter(busy_margin=2)
    facts = RouteFacts(in_flight=(0, 3, 1), holder=1, prefix_blocks=4)
    assert router.choose(facts) == 0  # the least busy replica pulls the prefix


def test_cache_aware_margin_zero_requires_the_holder_to_be_least_busy():
    router = CacheAwareRouter(busy_margin=0)
    assert router.choose(RouteFacts(in_flight=(1, 1), holder=1, prefix_blocks=1)) == 1
    assert router.choose(RouteFacts(in_flight=(0, 1), holder=1, prefix_blocks=1)) == 0


def test_cache_aware_without_a_holder_rotates_over_the_least_busy():
    router = CacheAwareRouter()
    idle = RouteFacts(in_flight=(0, 0, 0))
    assert [router.choose(idle) for _ in range(4)] == [0, 1, 2, 0]
    # only the least busy replicas are candidates
    assert router.choose(RouteFacts(in_flight=(3, 0, 3))) == 1


def test_cache_aware_ignores_a_holder_with_an_empty_prefix():
    router = CacheAwareRouter()
    assert router.choose(RouteFacts(in_flight=(0, 1), holder=1, prefix_blocks=0)) == 0


def test_route_facts_are_checked():
    with pytest.raises(ValueError, match="at least one replica"):
        RouteFacts(in_flight=())
    with pytest.raises(ValueError, match="outside ranks"):
        RouteFacts(in_flight=(0, 0), holder=2, prefix_blocks=1)
    with pytest.raises(ValueError, match="busy_margin"):
        CacheAwareRouter(busy_margin=-1)


def test_make_router_by_name():
    assert isinstance(make_router("round-robin"), RoundRobinRouter)
    router = make_router("cache-aware", busy_margin=5)
    assert isinstance(router, CacheAwareRouter) and router.busy_margin == 5
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random")


def test_round_robin_skips_unavailable_replicas_and_keeps_its_turn():
    router = RoundRobinRouter()
    facts = RouteFacts(in_flight=(0, 0, 0), available=(True, False, True))
    assert [router.choose(facts) for _ in range(4)] == [0, 2, 0, 2]
    everyone = RouteFacts(in_flight=(0, 0, 0))
    # after 2 comes 0, then 1: every replica in turn again
    assert [router.choose(everyone) for _ in range(3)] == [0, 1, 2]


def test_cache_aware_never_picks_an_unavailable_holder_or_replica():
    router = CacheAwareRouter(busy_margin=5)
    facts = RouteFacts(
        in_flight=(3, 0, 1), holder=1, prefix_blocks=4, available=(True, False, True)
    )
    # the holder is idle but unavailable; of the others replica 2 is least busy
    assert router.choose(facts) == 2
    assert router.choose(facts) == 2


def test_route_facts_need_an_available_replica():
    with pytest.raises(ValueError, match="at least one available"):
        RouteFacts(in_flight=(0, 0), available=(False, False))
    with pytest.raises(ValueError, match="differ in length"):
        RouteFacts(in_flight=(0, 0), available=(True,))
