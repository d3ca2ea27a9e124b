"""Where a NIXL load lands: the placements, and the rules ``auto`` placement (what
serving uses) decides by.

- ``slab``: each chunk is READ into the receive slab and scattered into the engine
  blocks. A READ that misses its deadline can only land in a retired slab.
- ``engine``: the READ lands straight in the destination engine blocks, one
  descriptor per contiguous piece; nothing is scattered.
- ``auto``: ``engine`` where it is cheap (``whole_block_engine``) and safe
  (``engine_reads_are_bounded``), else ``slab``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .peers import PeerPath
from .plan import EngineBlockMap

PLACEMENT_SLAB = "slab"
PLACEMENT_ENGINE = "engine"
PLACEMENT_AUTO = "auto"
PLACEMENTS = (PLACEMENT_SLAB, PLACEMENT_ENGINE, PLACEMENT_AUTO)

# (the path a peer check found to a holder, or None) -> whether a READ from it can
# go straight into engine blocks under ``auto`` placement
EngineReadPolicy = Callable[[PeerPath | None], bool]


def engine_reads_are_bounded(path: PeerPath | None) -> bool:
    """Whether a READ over ``path`` ends (done or failed) without the peer's help,
    so that one which missed its deadline cannot land in engine blocks later.

    Only VRAM to VRAM on one host, with UCX's software emulation off in this agent
    and cuda_ipc offered by both sides. With emulation off a VRAM READ can only
    take a zero-copy protocol, and the peer check READ succeeded over one; on one
    host that is cuda_ipc, where this side copies from the peer's memory mapped
    into its own context: the copy is queued on this side's device and completes
    or fails there, whatever the peer does. (A network zero-copy READ, RDMA,
    needs no peer progress either, but is not what was measured; it stays on the
    slab.) DRAM reads are refused: UCX may pick tcp for them (or shared-memory
    transports that progress through the peer), where a READ that missed its
    deadline can land seconds later. A READ that misses its deadline even so
    raises ``NixlTransferTimeout`` with ``destination_at_risk``.
    """
    return (
        path is not None
        and path.local_mem_type == "VRAM"
        and path.remote_mem_type == "VRAM"
        and path.same_host
        and path.zero_copy_only
        and "cuda_ipc" in path.transports
    )


def whole_block_engine(
    engine_layers: Sequence[torch.Tensor] | None,
    engine_block_axis: int | None,
    row_bytes: int,
) -> bool:
    """Whether ``engine_layers`` hold each block of every layer as one contiguous
    range in the store's row order (``EngineBlockMap.whole_blocks``)."""
    if not engine_layers or engine_block_axis is None:
        return False
    try:
        engine_map = EngineBlockMap.from_layers(
            engine_layers, engine_block_axis, row_bytes
        )
    except ValueError:
        return False
    return engine_map.whole_blocks
