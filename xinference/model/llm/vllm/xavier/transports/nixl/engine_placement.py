"""Which NIXL loads READ straight into engine blocks: the transport's placement,
``auto``'s policy per peer, and the peers it stopped trusting.

``placement.py`` states the rules (what ``slab``, ``engine`` and ``auto`` mean,
when a peer's READs are bounded, when an engine cache is laid out in whole
blocks); this module applies them for one transport over its lifetime. Under
``auto`` a peer whose READs were deemed bounded, and one of which missed its
deadline even so, is refused from then on: that READ may still write engine
blocks vLLM handed to a recomputation, so the next loads from that peer take the
slab, where a late READ can only land in a retired slab. The decision is kept
apart from ``transport.py`` so the transport reads as the mechanism (plan, READ,
scatter) and this safety rule can be read, and tested, on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .peers import PeerPath
from .placement import (
    PLACEMENT_AUTO,
    PLACEMENT_ENGINE,
    PLACEMENT_SLAB,
    PLACEMENTS,
    EngineReadPolicy,
    whole_block_engine,
)
from .plan import EngineBlockMap

logger = logging.getLogger(__name__)


def registers_engine(
    placement: str,
    engine_layers: Sequence[torch.Tensor] | None,
    engine_block_axis: int | None,
    row_bytes: int,
) -> bool:
    """Whether an endpoint should register ``engine_layers``: for ``engine``
    placement, and for ``auto`` where each block of every layer is one
    contiguous range (per-layer caches keep to the slab)."""
    return engine_layers is not None and (
        placement == PLACEMENT_ENGINE
        or (
            placement == PLACEMENT_AUTO
            and whole_block_engine(engine_layers, engine_block_axis, row_bytes)
        )
    )


class EnginePlacement:
    """One transport's choice, per load, between the engine blocks and the slab."""

    def __init__(self, placement: str, policy: EngineReadPolicy) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement {placement!r}; choose from {PLACEMENTS}"
            )
        self.placement = placement
        self._policy = policy
        # peers (agent names) whose READ into engine blocks missed its deadline
        self._refused: set[str] = set()

    def allows(
        self,
        engine_map: EngineBlockMap | None,
        peer_agent: str,
        peer_path: PeerPath | None,
    ) -> bool:
        """Whether a load from ``peer_agent`` (over ``peer_path``, as its peer
        check found it) READs straight into the engine blocks of ``engine_map``."""
        if engine_map is None or self.placement == PLACEMENT_SLAB:
            return False
        if self.placement == PLACEMENT_ENGINE:
            return True
        return (
            engine_map.whole_blocks
            and peer_agent not in self._refused
            and self._policy(peer_path)
        )

    def missed_deadline(self, peer_agent: str, holder_rank: int) -> None:
        """A READ from ``peer_agent`` into engine blocks missed its deadline."""
        if self.placement != PLACEMENT_AUTO:
            return  # only ``auto`` chooses per peer
        # The policy said this peer's READs could not outlive their deadline, and
        # one did: it may still write those blocks. Never again for this peer
        # (agent); its loads take the slab from now on.
        self._refused.add(peer_agent)
        logger.error(
            "a NIXL READ from rank %d into engine blocks missed its deadline "
            "although its path was deemed bounded; loads from %s go through "
            "the receive slab from now on",
            holder_rank,
            peer_agent,
        )
