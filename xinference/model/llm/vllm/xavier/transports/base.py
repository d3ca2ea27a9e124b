"""The seam between the transfer actor and whatever moves device-tier rows.

The actor never names a transport. It builds one from a ``TransportContext``
(``transports.create_device_tier_transport``), and then:

- as a loader, calls ``load`` with a ``HolderCall`` that reaches the holder's
  transport through the holder's actor, and the grant's ``TransportHint``;
- as a holder, asks ``hint`` for what a grant of some device-tier rows carries, and
  serves ``holder_ops``, the calls its transport answers for peers (the actor's one
  peer-facing ``transport_call(op, *args)`` dispatches to them);
- reports ``stats()`` (the same ``TransportStats`` fields for every transport).

Rows follow ``docs/internals.md``: for a list of keys, global row ``r`` is layer
``r % L`` of ``keys[r // L]``; ``scatter(first_row, rows)`` receives consecutive
global rows as a ``(n, R)`` ``uint8`` tensor that is valid only during the call.
``scatter`` may only queue device work that reads ``rows``: a transport whose
``guards_scatter_source`` is true waits for that work itself before it writes the
buffer behind ``rows`` again; with any other, ``scatter`` must complete its device
work before it returns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..hashing import BlockHash
from ..stats import TransportStats
from ..wire import KVGeometry, TransportHint

# (first global row, rows (n, R) uint8) -> None; may raise to stop the load.
RowScatter = Callable[[int, torch.Tensor], None]
# holder_call(op, *args): one of the holder transport's ``holder_ops``, reached
# through the holder's transfer actor, with a deadline.
HolderCall = Callable[..., Awaitable[Any]]
# (lease_id, keys) -> the device-tier row of each key's layer 0, leased here
LocateRows = Callable[[str, Sequence[BlockHash]], list[int]]
HolderOp = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class TransportContext:
    """What a transport is built from, inside one transfer actor.

    ``store_rows`` is the device tier (``(rows, R)`` uint8, possibly 0 rows);
    ``locate_rows`` finds leased device-tier keys in it; ``engine_layers`` (with
    ``engine_block_axis``) are the engine's KV tensors as mapped in the actor.
    """

    address: str  # the actor pool's address
    device: torch.device
    geometry: KVGeometry
    rpc_timeout_s: float
    agent_name: str  # a name for this replica's transport endpoints
    store_rows: torch.Tensor
    locate_rows: LocateRows
    engine_layers: Sequence[torch.Tensor] | None = None
    engine_block_axis: int | None = None
    # the device tier's generation words (``store/generations.py``), published
    # by transports that lease-free readers can READ
    generation_words: torch.Tensor | None = None


class DeviceTierTransport(Protocol):
    """Moves rows of device-tier snapshots between transfer actors."""

    # True: the buffer handed to ``scatter`` is written again only after the
    # device work that ``scatter`` queued on the current stream has completed, so
    # ``scatter`` need not wait for it (see the module docstring).
    guards_scatter_source: bool

    async def load(
        self,
        holder: HolderCall,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[BlockHash],
        scatter: RowScatter,
        *,
        hint: TransportHint | None = None,
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        """Loader side: bring every layer of ``keys`` (leased on the holder under
        ``lease_id``) and hand them to ``scatter`` in chunks. Returns or raises only
        once the holder can no longer write into this side's memory.

        ``hint`` is what the holder's ``hint`` put in the grant, narrowed to
        ``keys``; ``dst_block_ids`` (one engine block per key) lets a transport
        place rows in engine blocks itself instead of calling ``scatter``."""
        ...

    def hint(self, first_rows: Sequence[int | None]) -> TransportHint | None:
        """Holder side: what a grant carries for keys whose device-tier rows are
        ``first_rows`` (None: the key is not in the device tier)."""
        ...

    def holder_ops(self) -> Mapping[str, HolderOp]:
        """Holder side: the calls peers' transports make through ``HolderCall``."""
        ...

    def stats(self) -> TransportStats:
        """Cumulative counts (a copy)."""
        ...

    async def close(self) -> None:
        """Wait for transfers in progress, then release buffers (idempotent)."""
        ...
