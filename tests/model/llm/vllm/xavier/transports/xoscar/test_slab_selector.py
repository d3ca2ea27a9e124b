import pytest

from xinference.model.llm.vllm.xavier.transports.xoscar.slab_selector import (
    FullSlabSelector,
    SlabSelector,
    SmallestFitSelector,
)

KiB = 1024
MiB = 1024 * KiB
FULL = 12 * MiB
SMALL = 256 * KiB


def test_alternating_small_and_large_stays_on_the_full_slab():
    """A small batch between two large ones never completes a streak.

    Each switch between views re-registers memory on both ends of the channel, which
    costs more than the padding the small view saves; the alternation must stay on
    one buffer.
    """
    selector = SlabSelector(FULL)
    choices = [selector.select(0, n) for n in [SMALL, FULL, 4 * KiB, 3 * MiB] * 10]
    assert choices == [FULL] * 40


def test_sustained_small_batches_switch_after_two():
    selector = SlabSelector(FULL)
    choices = [selector.select(0, 100 * KiB) for _ in range(6)]
    assert choices == [FULL, SMALL, SMALL, SMALL, SMALL, SMALL]


def test_a_large_batch_resets_the_streak():
    selector = SlabSelector(FULL)
    sizes = [KiB, KiB, FULL, KiB, KiB, KiB]
    assert [selector.select(0, n) for n in sizes] == [
        FULL,
        SMALL,
        FULL,
        FULL,
        SMALL,
        SMALL,
    ]


def test_ranks_are_independent():
    selector = SlabSelector(FULL)
    assert selector.select(1, KiB) == FULL
    # rank 2's large batch must not reset rank 1's streak, nor count for it
    assert selector.select(2, FULL) == FULL
    assert selector.select(2, KiB) == FULL
    assert selector.select(1, KiB) == SMALL
    assert selector.select(2, KiB) == SMALL
    assert selector.select(3, KiB) == FULL


def test_forget_restarts_a_rank():
    selector = SlabSelector(FULL)
    selector.select(5, KiB)
    selector.select(5, KiB)
    selector.forget(5)
    assert selector.select(5, KiB) == FULL
    selector.forget(99)  # unknown rank: nothing to drop


@pytest.mark.parametrize(
    "nbytes, small",
    [
        (0, True),
        (1, True),
        (SMALL - 1, True),
        (SMALL, True),  # exactly the view's size is small
        (SMALL + 1, False),
        (FULL, False),
    ],
)
def test_threshold_below_at_and_above_256_kib(nbytes, small):
    selector = SlabSelector(FULL)
    selector.select(0, nbytes)
    assert selector.select(0, nbytes) == (SMALL if small else FULL)


@pytest.mark.parametrize("full", [64 * KiB, SMALL])
def test_view_is_never_larger_than_the_slab(full):
    selector = SlabSelector(full)
    assert selector.view_bytes == full
    assert [selector.select(0, full) for _ in range(3)] == [full] * 3


def test_custom_sizes_and_streak():
    selector = SlabSelector(1000, small_bytes=100, streak=3)
    assert [selector.select(0, 100) for _ in range(4)] == [1000, 1000, 100, 100]
    assert SlabSelector(1000, small_bytes=100, streak=1).select(0, 1) == 100


@pytest.mark.parametrize("nbytes", [-1, FULL + 1])
def test_batch_outside_the_slab_is_rejected(nbytes):
    for selector in (SlabSelector(FULL), SmallestFitSelector(FULL)):
        with pytest.raises(ValueError, match="bytes"):
            selector.select(0, nbytes)


def test_bad_rank_and_non_integer_batch_are_rejected():
    selector = SlabSelector(FULL)
    with pytest.raises(ValueError, match="source_rank"):
        selector.select(-1, KiB)
    with pytest.raises(TypeError, match="nbytes"):
        selector.select(0, 1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"full_bytes": 0}, ValueError),
        ({"full_bytes": -5}, ValueError),
        ({"full_bytes": FULL, "small_bytes": 0}, ValueError),
        ({"full_bytes": FULL, "streak": 0}, ValueError),
        ({"full_bytes": 1.0}, TypeError),
        ({"full_bytes": True}, TypeError),
        ({"full_bytes": FULL, "streak": "2"}, TypeError),
    ],
)
def test_constructor_arguments_are_validated(kwargs, error):
    with pytest.raises(error):
        SlabSelector(**kwargs)


def test_reference_policies():
    old = SmallestFitSelector(FULL)
    assert [old.select(0, n) for n in [KiB, FULL, KiB]] == [SMALL, FULL, SMALL]
    full = FullSlabSelector(FULL)
    assert [full.select(0, n) for n in [KiB, KiB, KiB]] == [FULL, FULL, FULL]
