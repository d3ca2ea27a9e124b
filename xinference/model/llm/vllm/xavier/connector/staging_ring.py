"""The staging ring: where the worker half copies blocks to stage, on the engine's stream.

Staging must read a request's engine blocks before anything can write them again,
and vLLM gives no connector hook that runs before every such write in every model
runner (a block freed by a finished or preempted request may be zeroed or be the
target of a copy-on-write before the next ``start_load_kv``). So the worker copies
the blocks out itself, in ``wait_for_save``, with copies queued on the engine's own
stream: whatever the engine writes next is ordered after them. The copies land in
this ring, a buffer the worker owns and shares with its transfer actor (CUDA IPC,
or shared memory on CPU) at mapping time; the actor snapshots ring slots into its
store in the background and the slots come back when it replies. The engine thread
pays only for queueing the copies.

Ring slot ``s`` holds rows ``s*L .. s*L + L - 1``, row ``s*L + l`` being layer ``l``
of one block: the store's own row layout, so the actor copies slots with one
copy per tier (``engine.layout.copy_snapshot_rows``).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import parse_size
from ..engine import device
from ..engine.blocks import BlockMajorCache
from ..hashing import BlockHash

# The ring's size without a device budget, and the least it holds when it sizes
# itself within one: several hundred blocks of a 0.5B model, 16 of an 8B one
# (4 MiB each at block size 32).
MIN_RING_BYTES = 64 * 1024**2
# Sized by itself, the ring holds this many engine steps' new blocks: a step's
# blocks wait in it for their copies to complete (checked at the next step), for
# the actor's copy into the store, and for the answer to be seen at a later step.
# Holding one step, as it did while the engine waited for free slots, skipped
# every other step's blocks once it no longer waited (an 8B model on an H100,
# 2,048-token steps: 60% of the blocks of unique 8k prompts).
RING_STEPS = 4
# With a device budget the ring is part of it (the transfer actor's device tier
# gets the rest), and takes at most this share, so that small budgets keep a tier.
MAX_RING_SHARE_OF_BUDGET = 2  # at most budget // 2
RING_BYTES_ENV = "XAVIER_STAGING_RING_BYTES"


def ring_bytes_from_env() -> int | None:
    """The ring's size asked for by the environment's ``XAVIER_STAGING_RING_BYTES``
    (bytes, or a size such as ``512MiB``; 0 for no ring), or None when it is not
    set and the ring sizes itself (``staging_ring_slots``)."""
    raw = os.environ.get(RING_BYTES_ENV, "").strip()
    if not raw:
        return None
    try:
        return parse_size(raw)
    except ValueError as exc:
        raise ValueError(f"{RING_BYTES_ENV}: {exc}") from None


def staging_ring_slots(
    *,
    requested: int | None,
    block_nbytes: int,
    step_tokens: int,
    block_size: int,
    device_budget_bytes: int,
) -> int:
    """How many blocks the ring holds (its bytes rounded down to whole blocks).

    With a device budget (``device_budget_bytes`` > 0) the ring comes out of it
    and takes at most a ``MAX_RING_SHARE_OF_BUDGET``-th of it, an explicit
    request included; unless ``requested``, it holds ``RING_STEPS`` engine
    steps' new blocks (``step_tokens``, vLLM's ``max_num_batched_tokens``, at
    ``block_size`` tokens a block) and at least ``MIN_RING_BYTES``. Blocks that
    find no free slot are not staged (the engine never waits for the actor:
    ``write_behind.py``). Without a budget nothing bounds Xavier's memory on
    the engine's device, so the ring stays at ``MIN_RING_BYTES`` unless
    requested.
    """
    if block_nbytes <= 0:
        raise ValueError(f"a block has a positive size, got {block_nbytes}")
    if requested is not None:
        wanted = requested
    elif device_budget_bytes > 0:
        step_blocks = -(-step_tokens // block_size)
        wanted = max(MIN_RING_BYTES, RING_STEPS * step_blocks * block_nbytes)
    else:
        wanted = MIN_RING_BYTES
    if device_budget_bytes > 0:
        wanted = min(wanted, device_budget_bytes // MAX_RING_SHARE_OF_BUDGET)
    return wanted // block_nbytes


class StagingRing:
    """``num_slots`` block-sized slots on the engine's device, and which are free.

    Used from the engine's thread only: slots are taken when blocks are copied in
    and given back once the actor has copied them out (or retired, if it may still
    be reading them).
    """

    def __init__(self, cache: BlockMajorCache, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"a staging ring needs at least one slot, got {num_slots}")
        self._cache = cache
        self.num_layers = cache.num_layers
        self.rows = torch.empty(
            (num_slots * self.num_layers, cache.layout.layer_block_nbytes),
            dtype=torch.uint8,
            device=cache.device,
        )
        self.num_slots = num_slots
        # Lowest first, so the rows in use stay dense.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.retired = 0  # slots never given back (an actor that may still read them)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def copy_in(self, block_ids: Sequence[int]) -> list[int]:
        """Copy engine blocks ``block_ids`` into free slots, one slot each, with
        copies queued on the current stream; returns the slots, in order.

        The caller must have checked ``free_slots``.
        """
        if len(block_ids) > len(self._free):
            raise ValueError(
                f"{len(block_ids)} blocks to stage, {len(self._free)} free ring slots"
            )
        slots = [self._free.pop() for _ in block_ids]
        if not slots:
            return slots
        self._cache.copy_listed_blocks_to_rows(
            block_ids, self.rows, [slot * self.num_layers for slot in slots]
        )
        return slots

    def give_back(self, slots: Sequence[int]) -> None:
        self._free.extend(sorted(slots, reverse=True))

    def retire(self, slots: Sequence[int]) -> None:
        """Never reuse ``slots``: someone may still read them."""
        self.retired += len(slots)


@dataclass(slots=True)
class RingStaging:
    """Blocks copied into ring slots, until the actor has copied them out.

    Handed to the actor (``future`` set) only once the copies into the ring have
    completed on the device, which the engine's thread checks without blocking at
    each step: no thread waits on the device for it, and the background loop only
    makes the call (its Python competes with the engine's thread for the GIL)."""

    slots: list[int]
    keys: list[BlockHash]
    copied: device.DeviceWorkMark
    future: concurrent.futures.Future[None] | None = None
