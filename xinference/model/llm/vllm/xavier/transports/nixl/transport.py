"""``NixlDirectTransport``: device-tier loads READ straight from the holder's memory.

Why not ``xo.copy_to``: every copy through xoscar's NIXL channel costs two control
round trips (prepare, finish), a device synchronisation on both ends and, whenever
the buffer objects change, a re-registration. Used directly, one registration covers
every sub-range of an allocation, so a transfer moves exactly the payload's bytes.

How a load works:

- Every transfer actor owns one ``NixlAgentEndpoint`` (``endpoint.py``): one agent,
  with the device tier rows, a receive slab and (optionally) the engine's KV cache
  registered once.
- A holder's grant carries its endpoint's epoch and each key's device-tier row
  (the ``TransportHint``); the loader loads the holder's ``NixlEndpointInfo`` once
  per peer and epoch (holder op ``endpoint_info``) and pulls the rows with one READ
  per chunk. The holder's CPU does nothing: no packing, no handshake, no completion
  message; the loader sees completion by polling the transfer state.
- Placement ``slab`` reads each chunk into the receive slab, one descriptor per run
  of consecutive holder rows, and hands it to ``scatter``. Placement ``engine``
  reads straight into the destination engine blocks, one descriptor per contiguous
  piece of a block, and copies nothing afterwards; but a READ that misses its
  deadline may still land later on transports that need the peer's progress
  (``tcp``), and then into engine blocks that vLLM may have handed to a
  recomputation (the timeout says so: ``destination_at_risk``). With ``slab`` a
  late READ lands in a retired slab. Wire bytes equal useful bytes in both.
- Placement ``auto`` (what serving uses) chooses per load: ``engine`` where it is
  both cheap and safe, else ``slab``. Cheap: the engine cache is laid out so that a
  block of every layer is one contiguous range in the store's row order
  (``EngineBlockMap.whole_blocks``, vLLM's cross-layer allocation), so a snapshot
  is one descriptor and a load needs no slab, no scatter and no fence; with
  per-layer allocations a block is a piece per layer (a descriptor each, ~9 us
  apiece over cuda_ipc), and the slab is faster. Safe: the READ from this peer
  cannot outlive its deadline (``engine_reads_are_bounded``).

Deadlines: every READ has one (``transfer_timeout_s``); a lost peer fails the load
with ``NixlTransferError`` (UCX reports the disconnect) and a stalled one with
``NixlTransferTimeout``.

Device-generic: CPU tensors are NIXL DRAM, CUDA tensors VRAM; nothing else differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import torch
import xoscar as xo

from ...engine.device import DeviceWorkMark
from ...hashing import BlockHash
from ...stats import TransportStats
from ...wire import KVGeometry, TransportHint
from ..base import HolderCall, HolderOp, LocateRows, TransportContext
from ..xoscar.gpu_transfer import ScatterFn, full_slab_bytes
from .endpoint import NixlAgentEndpoint
from .engine_placement import EnginePlacement, registers_engine
from .placement import PLACEMENT_AUTO, EngineReadPolicy, engine_reads_are_bounded
from .plan import (
    EngineBlockMap,
    ReadPlan,
    plan_engine_read,
    plan_slab_read,
    plan_slab_rows,
)
from .reads import DEST_ENGINE, DEST_SLAB
from .wire import NixlEndpointInfo, NixlSource, NixlTransferError, NixlTransferTimeout

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NixlDirectTransport:
    """``DeviceTierTransport`` through this actor's own NIXL agent (see the module
    docstring). Its holder ops, which a loader reaches through ``HolderCall``:

    - ``endpoint_info() -> NixlEndpointInfo`` (once per peer and generation);
    - ``source(lease_id, keys) -> NixlSource`` (only when the grant carried no
      hint; a holder's grants carry the rows and the epoch).
    """

    def __init__(
        self,
        endpoint: NixlAgentEndpoint,
        geometry: KVGeometry,
        *,
        rpc_timeout_s: float,
        transfer_timeout_s: float | None = None,
        placement: str = PLACEMENT_AUTO,
        locate_rows: LocateRows | None = None,
        engine_read_policy: EngineReadPolicy = engine_reads_are_bounded,
    ) -> None:
        """``engine_read_policy`` decides, under ``auto`` placement, which peers'
        READs may land straight in engine blocks (tests stand in for VRAM with
        it)."""
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be positive, got {rpc_timeout_s}")
        engine_placement = EnginePlacement(placement, engine_read_policy)
        if endpoint.row_bytes != geometry.layer_block_nbytes:
            raise ValueError(
                f"the endpoint's rows are {endpoint.row_bytes} bytes, the geometry's "
                f"{geometry.layer_block_nbytes}"
            )
        self._endpoint = endpoint
        self._geometry = geometry
        self._rpc_timeout_s = rpc_timeout_s
        self._transfer_timeout_s = transfer_timeout_s or rpc_timeout_s
        self._engine_placement = engine_placement
        self._locate_rows = locate_rows  # holder side: where leased keys sit
        self.rows_per_read = endpoint.slab.numel() // geometry.layer_block_nbytes
        self._counters = TransportStats()
        self._registrations_at_start = endpoint.registrations
        # holder rank -> the holder's endpoint info in use
        self._peers: dict[int, NixlEndpointInfo] = {}
        self._peer_locks: dict[int, asyncio.Lock] = {}
        # One load at a time uses the receive slab, from READ to the end of scatter.
        self._slab_lock = asyncio.Lock()
        # The device work ``scatter`` queued out of the slab is waited for before
        # the next READ overwrites it (``guards_scatter_source``).
        self._slab_readers = DeviceWorkMark(endpoint.slab.device)
        self._viewed_slab: torch.Tensor | None = None
        self._slab_view = endpoint.slab[:0]
        self._active: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None

    @classmethod
    async def create(
        cls,
        name: str,
        geometry: KVGeometry,
        store_rows: torch.Tensor,
        *,
        rpc_timeout_s: float,
        transfer_timeout_s: float | None = None,
        placement: str = PLACEMENT_AUTO,
        engine_layers: Sequence[torch.Tensor] | None = None,
        engine_block_axis: int | None = None,
        slab_bytes: int | None = None,
        locate_rows: LocateRows | None = None,
        engine_read_policy: EngineReadPolicy = engine_reads_are_bounded,
        generation_words: torch.Tensor | None = None,
        reads_peer_words: bool = False,
    ) -> NixlDirectTransport:
        """An endpoint for this actor's memory and a transport over it.

        ``engine_layers`` are registered for ``engine`` placement, and for ``auto``
        where each block of every layer is one contiguous range
        (``whole_block_engine``; per-layer caches keep to the slab);
        ``locate_rows`` serves the ``source`` holder op."""
        use_engine = registers_engine(
            placement, engine_layers, engine_block_axis, geometry.layer_block_nbytes
        )
        endpoint = await NixlAgentEndpoint.create(
            name,
            row_bytes=geometry.layer_block_nbytes,
            store_rows=store_rows,
            slab_bytes=slab_bytes or full_slab_bytes(geometry),
            engine_layers=engine_layers if use_engine else None,
            engine_block_axis=engine_block_axis if use_engine else None,
            words=generation_words,
            reads_peer_words=reads_peer_words,
        )
        return cls(
            endpoint,
            geometry,
            rpc_timeout_s=rpc_timeout_s,
            transfer_timeout_s=transfer_timeout_s,
            placement=placement,
            locate_rows=locate_rows,
            engine_read_policy=engine_read_policy,
        )

    # The receive slab that ``scatter`` reads is written again only after the
    # device work ``scatter`` queued has completed (``_slab_readers``): callers
    # need not complete that work before ``scatter`` returns.
    guards_scatter_source = True

    @property
    def endpoint(self) -> NixlAgentEndpoint:
        return self._endpoint

    @property
    def serves_generation_words(self) -> bool:
        """Whether peers can READ this holder's generation words (published
        beside its device tier, whatever its memory, ``published.py``): only
        then are lease-free reads of it safe."""
        try:
            return self._endpoint.info.words is not None
        except RuntimeError:  # closed: nothing is served any more
            return False

    @property
    def placement(self) -> str:
        return self._engine_placement.placement

    # ---- loader side ----------------------------------------------------------------

    async def load(
        self,
        holder: HolderCall,
        holder_rank: int,
        lease_id: str,
        keys: Sequence[BlockHash],
        scatter: ScatterFn,
        *,
        hint: TransportHint | None = None,
        dst_block_ids: Sequence[int] | None = None,
    ) -> None:
        """Bring every layer of ``keys`` from the holder's device tier.

        ``hint`` (from the grant: the holder's epoch and each key's first row)
        spares the ``source`` round trip to the holder.

        With ``dst_block_ids`` (one engine block per key) and ``engine`` placement,
        or ``auto`` placement where ``places_in_engine`` says so, the READ lands in
        the engine blocks and ``scatter`` is not called: the READ's completion is
        the end of the load. Otherwise each chunk is read into the receive slab and
        handed to ``scatter``. Returns or raises once no READ is writing into this
        side's memory any more; device work that ``scatter`` queued may still run
        (the caller completes it before the engine reads the blocks; the next READ
        into the slab waits for it).
        """
        self._check_open()
        keys = tuple(keys)
        if not keys:
            return
        task = asyncio.current_task()
        if task is not None:
            self._active.add(task)
        try:
            if hint is not None:
                agent_name, generation = hint.shared
                source = NixlSource(agent_name, generation, tuple(hint.per_key))
            else:
                source = await self._rpc(holder("source", lease_id, list(keys)))
            peer = await self._peer(holder, holder_rank, source)
            self._check_source(peer, source, keys)
            engine_map = self._endpoint.engine_map
            if (
                dst_block_ids is not None
                and engine_map is not None
                and self.places_in_engine(peer.agent_name)
            ):
                await self._load_into_engine(
                    holder_rank, peer, source, dst_block_ids, engine_map
                )
            else:
                await self._load_through_slab(holder_rank, peer, source, scatter)
            self._counters.loads += 1
        finally:
            if task is not None:
                self._active.discard(task)

    def places_in_engine(self, peer_agent: str) -> bool:
        """Whether a load from ``peer_agent`` (met already) with destination blocks
        READs straight into engine blocks (see the module docstring)."""
        return self._engine_placement.allows(
            self._endpoint.engine_map,
            peer_agent,
            self._endpoint.peer_paths.get(peer_agent),
        )

    async def _load_through_slab(
        self,
        holder_rank: int,
        peer: NixlEndpointInfo,
        source: NixlSource,
        scatter: ScatterFn,
    ) -> None:
        num_layers, row_bytes = (
            self._geometry.num_layers,
            self._geometry.layer_block_nbytes,
        )
        total = len(source.first_rows) * num_layers
        assert peer.store is not None
        for first_row in range(0, total, self.rows_per_read):
            num_rows = min(self.rows_per_read, total - first_row)
            async with self._slab_lock:
                slab_rows = self._slab_rows()  # a timed-out READ may replace the slab
                # The last scatter may still be reading the slab on the device: the
                # READ must not overwrite it before that work is done.
                self._slab_readers.wait()
                slab_region = self._endpoint.slab_region
                row_lists = self._endpoint.row_lists
                lists = (
                    None
                    if row_lists is None
                    else row_lists.for_reads_from(peer.agent_name)
                )
                if lists is not None:
                    plan = plan_slab_rows(
                        source.first_rows,
                        num_layers,
                        row_bytes,
                        first_row,
                        num_rows,
                        *lists,
                    )
                else:
                    plan = plan_slab_read(
                        source.first_rows,
                        num_layers,
                        row_bytes,
                        peer.store,
                        slab_region,
                        first_row,
                        num_rows,
                    )
                await self._read(
                    holder_rank, peer, plan, slab_region.mem_type, DEST_SLAB
                )
                try:
                    scatter(first_row, slab_rows[:num_rows])
                finally:
                    # scatter may only have queued device work that reads the slab;
                    # it is waited for before the next READ into the slab, not here
                    # (the caller fences before the engine uses its blocks).
                    self._slab_readers.mark()
            self._count(plan, num_rows * row_bytes)

    def _slab_rows(self) -> torch.Tensor:
        """The receive slab as ``(rows, row bytes)``, made once per slab (two
        tensor operations fewer on every chunk)."""
        slab = self._endpoint.slab
        if self._viewed_slab is not slab:
            row_bytes = self._geometry.layer_block_nbytes
            self._slab_view = slab[: self.rows_per_read * row_bytes].view(-1, row_bytes)
            self._viewed_slab = slab
        return self._slab_view

    async def _load_into_engine(
        self,
        holder_rank: int,
        peer: NixlEndpointInfo,
        source: NixlSource,
        dst_block_ids: Sequence[int],
        engine_map: EngineBlockMap,
    ) -> None:
        assert peer.store is not None
        # checks the destination blocks too (count, range, no duplicates)
        plan = plan_engine_read(
            source.first_rows,
            dst_block_ids,
            self._geometry.num_layers,
            self._geometry.layer_block_nbytes,
            peer.store,
            engine_map,
        )
        try:
            await self._read(holder_rank, peer, plan, engine_map.mem_type, DEST_ENGINE)
        except NixlTransferTimeout:
            self._engine_placement.missed_deadline(peer.agent_name, holder_rank)
            raise
        self._count(plan, len(dst_block_ids) * self._geometry.block_nbytes)
        self._counters.engine_placed_loads += 1

    async def _read(
        self,
        holder_rank: int,
        peer: NixlEndpointInfo,
        plan: ReadPlan,
        local_mem_type: str,
        destination: str,
    ) -> None:
        assert peer.store is not None
        # try/except, not ``_counted_failures``: a generator context manager costs
        # microseconds on every load, and this is a load's path.
        try:
            await self._endpoint.read(
                peer.agent_name,
                plan,
                local_mem_type=local_mem_type,
                remote_mem_type=peer.store.mem_type,
                timeout_s=self._transfer_timeout_s,
                destination=destination,
            )
        except NixlTransferTimeout as exc:
            raise self._counted(exc, f"load from rank {holder_rank}") from exc
        except NixlTransferError as exc:
            # The peer may be gone or have changed: fetch its metadata afresh.
            if self._peers.get(holder_rank) is peer:
                del self._peers[holder_rank]
                await self._endpoint.forget_peer(peer.agent_name)
            raise self._counted(exc, f"load from rank {holder_rank}") from exc

    @contextlib.contextmanager
    def _counted_failures(self, context: str) -> Iterator[None]:
        """Count a failed or timed-out READ and re-raise it with ``context``."""
        try:
            yield
        except NixlTransferError as exc:
            raise self._counted(exc, context) from exc

    def _counted(self, exc: NixlTransferError, context: str) -> NixlTransferError:
        """Count a failed or timed-out READ; the same error, with ``context``."""
        if isinstance(exc, NixlTransferTimeout):
            self._counters.transfer_timeouts += 1
            return NixlTransferTimeout(f"{context}: {exc}", exc.destination_at_risk)
        self._counters.transfer_failures += 1
        return NixlTransferError(f"{context}: {exc}")

    def _count(self, plan: ReadPlan, useful_bytes: int) -> None:
        counters = self._counters
        counters.received_copies += 1
        counters.received_wire_bytes += plan.nbytes
        counters.received_useful_bytes += useful_bytes
        counters.descriptors += plan.descriptors

    def known_peer(self, holder_rank: int) -> NixlEndpointInfo | None:
        """The endpoint of ``holder_rank`` loaded here, if any."""
        return self._peers.get(holder_rank)

    async def meet(self, holder: HolderCall, holder_rank: int) -> NixlEndpointInfo:
        """Load ``holder_rank``'s current endpoint (and check the path to it)
        ahead of any load: lease-free readers name no epoch."""
        info: NixlEndpointInfo = await self._rpc(holder("endpoint_info"))
        return await self._peer(holder, holder_rank, NixlSource(*info.epoch, ()))

    async def _peer(
        self, holder: HolderCall, holder_rank: int, source: NixlSource
    ) -> NixlEndpointInfo:
        """The holder's endpoint info for ``source``'s epoch, loaded into our agent."""
        known = self._peers.get(holder_rank)
        if known is not None and known.epoch == source.epoch:
            return known  # the common case, without the lock (no await before it)
        lock = self._peer_locks.setdefault(holder_rank, asyncio.Lock())
        async with lock:
            known = self._peers.get(holder_rank)
            if known is not None and known.epoch == source.epoch:
                return known
            info: NixlEndpointInfo = await self._rpc(holder("endpoint_info"))
            if info.epoch != source.epoch:
                raise NixlTransferError(
                    f"rank {holder_rank} re-registered its device tier during this "
                    f"load (epoch {info.epoch}, the lease names {source.epoch})"
                )
            if info.row_bytes != self._geometry.layer_block_nbytes:
                raise ValueError(
                    f"rank {holder_rank} stores {info.row_bytes}-byte rows, this "
                    f"replica {self._geometry.layer_block_nbytes}-byte rows"
                )
            if info.store is None:
                raise NixlTransferError(f"rank {holder_rank} has no device tier")
            if known is not None and known.agent_name != info.agent_name:
                await self._endpoint.forget_peer(known.agent_name)
            with self._counted_failures(f"rank {holder_rank}"):
                await self._endpoint.add_peer(
                    info, check_timeout_s=self._transfer_timeout_s
                )
            self._peers[holder_rank] = info
            self._counters.peer_metadata_loads += 1
            return info

    def _check_source(
        self, peer: NixlEndpointInfo, source: NixlSource, keys: Sequence[BlockHash]
    ) -> None:
        if len(source.first_rows) != len(keys):
            raise ValueError(
                f"the holder located {len(source.first_rows)} of {len(keys)} keys"
            )
        num_layers = self._geometry.num_layers
        limit = peer.num_store_rows
        rows = source.first_rows
        # min/max first: on a load's path, at C speed
        if rows and (min(rows) < 0 or max(rows) + num_layers > limit):
            bad = [r for r in rows if r < 0 or r + num_layers > limit]
            raise ValueError(
                f"snapshot rows {bad[:8]} lie outside the holder's {limit} device "
                "tier rows"
            )

    # ---- holder side ----------------------------------------------------------------

    def hint(self, first_rows: Sequence[int | None]) -> TransportHint | None:
        """Our epoch and each key's device-tier row: the loader READs without
        asking us anything more (unless it has not met this epoch yet)."""
        return TransportHint(self._endpoint.info.epoch, tuple(first_rows))

    def holder_ops(self) -> Mapping[str, HolderOp]:
        return {"endpoint_info": self._endpoint_info, "source": self._source}

    async def _endpoint_info(self) -> NixlEndpointInfo:
        self._check_open()
        return self._endpoint.info

    async def _source(self, lease_id: str, keys: list[BlockHash]) -> NixlSource:
        self._check_open()
        if self._locate_rows is None:
            raise RuntimeError("this NIXL transport was made without a store to serve")
        return self._endpoint.source(self._locate_rows(lease_id, keys))

    # ---- reporting and shutdown -----------------------------------------------------

    def stats(self) -> TransportStats:
        counters = self._counters
        counters.registrations = self._endpoint.registrations
        counters.registration_changes = (
            self._endpoint.registrations - self._registrations_at_start
        )
        return replace(counters)

    async def close(self) -> None:
        """Wait for loads in progress, then close the endpoint (idempotent)."""
        if self._close_task is None:
            self._close_task = asyncio.create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closed = True
        current = asyncio.current_task()
        pending = [t for t in self._active if t is not current]
        if pending:
            # Each READ has a deadline, so these end.
            await asyncio.wait(pending)
        await self._endpoint.close(orphan_timeout_s=self._transfer_timeout_s)
        logger.info("NIXL transport closed: %s", self.stats())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the NIXL transport is closed")

    async def _rpc(self, call: Awaitable[T]) -> T:
        # xo.wait_for: it times out even when cancelling an actor call cannot reach
        # an unresponsive peer.
        return await xo.wait_for(call, self._rpc_timeout_s)


async def create(context: TransportContext) -> NixlDirectTransport:
    """The serving transport: ``auto`` placement over the store's rows and, where
    they are laid out for it, the engine's blocks.

    A load goes straight into engine blocks only when that is cheap (each block of
    every layer one contiguous range: vLLM's cross-layer cache) and safe (the READ
    cannot outlive its deadline: VRAM to VRAM over cuda_ipc,
    ``engine_reads_are_bounded``); otherwise through the slab, where a READ that
    outlives its deadline (a stalled peer over TCP) lands in a retired slab, never
    in engine blocks that vLLM has meanwhile handed to a recomputation.

    Only VRAM READs are ever bounded, so an engine cache in host memory (vLLM on
    CPU) is not registered at all: it would only cost a registration.
    """
    on_device = context.device.type == "cuda"
    transport = await NixlDirectTransport.create(
        context.agent_name,
        context.geometry,
        context.store_rows,
        rpc_timeout_s=context.rpc_timeout_s,
        placement=PLACEMENT_AUTO,
        engine_layers=context.engine_layers if on_device else None,
        engine_block_axis=context.engine_block_axis,
        locate_rows=context.locate_rows,
        generation_words=context.generation_words,
    )
    logger.info(
        "NIXL transport %s: %s",
        transport.endpoint.agent_name,
        (
            "engine KV blocks are whole ranges; loads from peers whose READs are "
            "bounded (VRAM to VRAM over cuda_ipc) land in them directly, others "
            "go through the receive slab"
            if transport.endpoint.engine_map is not None
            else "loads go through the receive slab (the engine KV cache is in "
            "host memory, its blocks are not whole contiguous ranges, or it could "
            "not be registered)"
        ),
    )
    return transport
