"""The device tier's share of a replica's device budget, beside the staging ring."""

from __future__ import annotations

import torch

from xinference.model.llm.vllm.xavier.actor.staging import device_tier_bytes


def test_the_device_tier_gets_what_the_staging_ring_leaves_of_the_budget():
    ring = torch.empty((4 * 3, 1024), dtype=torch.uint8)  # 4 slots of 3 layers
    assert device_tier_bytes(1 << 20, ring) == (1 << 20) - 12 * 1024
    assert device_tier_bytes(1 << 20, None) == 1 << 20
    # a ring asked for beyond the budget leaves no tier, never a negative one
    assert device_tier_bytes(8 * 1024, ring) == 0


def test_without_a_budget_there_is_no_device_tier_whatever_the_ring():
    ring = torch.empty((8, 1024), dtype=torch.uint8)
    assert device_tier_bytes(None, ring) == 0
    assert device_tier_bytes(0, ring) == 0
