"""The staging ring's size: as the environment asks for it, or sized by itself."""

from __future__ import annotations

import pytest

from xinference.model.llm.vllm.xavier.connector.staging_ring import (
    MIN_RING_BYTES,
    RING_BYTES_ENV,
    RING_STEPS,
    ring_bytes_from_env,
    staging_ring_slots,
)

MiB = 1024**2
BLOCK_8B = 4 * MiB  # a block of 32 tokens of an 8B model (32 layers, 8 KV heads)


def test_the_ring_sizes_itself_unless_the_environment_sets_a_size(monkeypatch):
    monkeypatch.delenv(RING_BYTES_ENV, raising=False)
    assert ring_bytes_from_env() is None
    monkeypatch.setenv(RING_BYTES_ENV, " ")
    assert ring_bytes_from_env() is None


@pytest.mark.parametrize(
    "raw, nbytes",
    [("512MiB", 512 * 1024**2), ("1GiB", 1024**3), ("4194304", 4 << 20), ("0", 0)],
)
def test_a_ring_size_from_the_environment_is_parsed_as_a_size(monkeypatch, raw, nbytes):
    monkeypatch.setenv(RING_BYTES_ENV, raw)
    assert ring_bytes_from_env() == nbytes


@pytest.mark.parametrize("raw", ["lots", "-1", "64 parsecs", "1.5GiB"])
def test_a_malformed_ring_size_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(RING_BYTES_ENV, raw)
    with pytest.raises(ValueError, match=RING_BYTES_ENV):
        ring_bytes_from_env()


def ring(requested=None, *, block=BLOCK_8B, step_tokens=2048, budget=16 << 30):
    """The ring's bytes: its slots, whole blocks each."""
    slots = staging_ring_slots(
        requested=requested,
        block_nbytes=block,
        step_tokens=step_tokens,
        block_size=32,
        device_budget_bytes=budget,
    )
    return slots * block


def test_a_ring_sized_by_itself_holds_several_steps_new_blocks():
    # A step's blocks stay in the ring while their copies complete and the actor
    # copies them out; holding one step skipped every other step's blocks.
    assert ring(step_tokens=2048) == RING_STEPS * 64 * BLOCK_8B
    assert ring(step_tokens=2048 + 1) == RING_STEPS * 65 * BLOCK_8B  # partial block


def test_a_ring_sized_by_itself_keeps_a_floor_for_small_steps_and_models():
    assert ring(step_tokens=32) == MIN_RING_BYTES
    block = 393_216  # Qwen2.5-0.5B at 16 tokens a block
    assert ring(block=block, step_tokens=16) == MIN_RING_BYTES // block * block


def test_the_ring_takes_at_most_half_a_device_budget():
    # 8,192-token steps of an 8B model: 4 GiB a step's worth times RING_STEPS
    assert ring(step_tokens=8192, budget=4096 * MiB) == 2048 * MiB
    assert ring(step_tokens=2048, budget=4096 * MiB) == 1024 * MiB  # fits
    # a small budget keeps half of itself for the tier, the floor included
    assert ring(block=64 * 1024, budget=16 * MiB) == 8 * MiB
    # an explicit size is capped as well, and rounded down to whole blocks
    assert ring(3072 * MiB, budget=4096 * MiB) == 2048 * MiB
    assert ring(5 * MiB) == BLOCK_8B
    assert ring(0) == 0


def test_without_a_budget_the_ring_keeps_the_floor_unless_asked_for_more():
    # nothing bounds Xavier's memory on the engine's device then: four steps of
    # an 8B model would be an 8 GiB surprise beside vLLM's share
    assert ring(step_tokens=16384, budget=0) == MIN_RING_BYTES
    assert ring(2048 * MiB, budget=0) == 2048 * MiB
