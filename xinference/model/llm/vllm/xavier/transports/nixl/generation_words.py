"""READ a holder's generation words back, after a lease-free read of its rows.

The holder publishes its device tier's generation words beside the rows
(``NixlEndpointInfo.words``, host memory even where the rows are on a GPU,
``published.py``); a loader that read rows without a lease READs the words of the
same slots into its endpoint's host words scratch and compares them with the
generations it expected (``store/generations.py`` says why this order makes the
read safe). The scratch is host memory, so the words are read with no device
synchronization. A READ that misses its deadline fails the load and retires the
scratch (a fresh one is registered), so its late write cannot land in a later
read-back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .endpoint import NixlAgentEndpoint
from .plan import ReadPlan
from .reads import DEST_WORDS
from .wire import NixlEndpointInfo, NixlRegion, NixlTransferError

WORD_BYTES = 8


def words_plan(
    scratch: NixlRegion, words: NixlRegion, slots: Sequence[int]
) -> ReadPlan:
    """Word ``slots[i]`` of the holder into word ``i`` of the scratch row."""
    n = len(slots)
    if n * WORD_BYTES > scratch.nbytes:
        raise ValueError(
            f"{n} generation words do not fit the {scratch.nbytes}-byte scratch row"
        )
    limit = words.nbytes // WORD_BYTES
    if any(not 0 <= slot < limit for slot in slots):
        raise ValueError(f"slots {list(slots)[:8]} outside the holder's {limit} words")
    remote = np.asarray(slots, dtype=np.uint64) * np.uint64(WORD_BYTES)
    local = np.arange(n, dtype=np.uint64) * np.uint64(WORD_BYTES)
    length = np.full(n, WORD_BYTES, dtype=np.uint64)
    return ReadPlan(
        local=np.stack(
            [
                local + np.uint64(scratch.address),
                length,
                np.full(n, scratch.device_id, np.uint64),
            ],
            axis=1,
        ),
        remote=np.stack(
            [
                remote + np.uint64(words.address),
                length,
                np.full(n, words.device_id, np.uint64),
            ],
            axis=1,
        ),
        nbytes=n * WORD_BYTES,
    )


async def read_words(
    endpoint: NixlAgentEndpoint,
    peer: NixlEndpointInfo,
    slots: Sequence[int],
    timeout_s: float,
) -> list[int]:
    """The holder's generation words of ``slots``, as they are now, one READ per
    scratch's worth of words. The caller keeps every other read-back into the
    endpoint's words scratch away meanwhile."""
    if peer.words is None:
        raise NixlTransferError(f"peer {peer.agent_name} publishes no generation words")
    scratch = endpoint.words_scratch
    region = NixlRegion.of(scratch)
    per_read = region.nbytes // WORD_BYTES
    words: list[int] = []
    for start in range(0, len(slots), per_read):
        part = slots[start : start + per_read]
        await endpoint.read(
            peer.agent_name,
            words_plan(region, peer.words, part),
            local_mem_type=region.mem_type,
            remote_mem_type=peer.words.mem_type,
            timeout_s=timeout_s,
            destination=DEST_WORDS,
        )
        landed = scratch[: len(part) * WORD_BYTES]
        words.extend(landed.view(torch.int64).tolist())
    return words
