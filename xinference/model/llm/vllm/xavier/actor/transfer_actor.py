"""The transfer actor: one per replica, the owner of everything that moves KV.

It lives in the replica's actor pool on a ``nixl://`` address and owns the tiered
snapshot store, the device-tier transport and the engine's KV cache tensors, mapped
once from the worker process (``engine.device.import_tensors``). It is the xoscar
face of three parts that need no xoscar: ``staging.py`` (snapshot computed blocks),
``leases.py`` (the holder side) and ``loads.py`` (the loader side). Its callers:

- the worker half of the connector: ``map_engine_caches``, ``stage``,
  ``run_load`` (asynchronous loads), ``load_now`` / ``fence_load`` (bounded
  synchronous ones), ``start_load`` / ``wait_load`` / ``cancel_load``, and
  ``record_connector_fault`` and ``record_connector_totals``;
- the scheduler half: ``reserve`` / ``release`` on the holder, after asking the
  tracker who holds a prefix;
- peer transfer actors: ``transport_call`` (whatever the device-tier transport
  serves to peers; the actor does not know which transport that is),
  ``read_cpu_rows`` (CPU tier) and ``release``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import xoscar as xo

from ..aio import ActorRefs, Tracked
from ..change_log import Location
from ..config import transfer_actor_uid
from ..engine.blocks import BlockMajorCache
from ..engine.device import (
    SharedTensorHandles,
    import_tensors,
    limit_cpu_threads,
    release_memory,
)
from ..engine.layout import detect_layout
from ..engine.scatter_graphs import graphs_requested
from ..hashing import BlockHash
from ..stats import (
    ActorCounters,
    EngineInfo,
    LatencyRecorder,
    TransportStats,
    XavierStats,
)
from ..store.generations import device_locations
from ..store.tiered import TieredKVSnapshotStore
from ..transports import create_device_tier_transport
from ..transports.base import DeviceTierTransport, HolderOp, TransportContext
from ..transports.cpu_tier import CpuRowsReply, count_cpu_rows, gather_cpu_rows
from ..wire import (
    ConnectorTotals,
    LeaseGrant,
    LoadRequest,
    LoadResult,
    ReplicaIdentity,
    StageItem,
)
from .actor_config import TransferActorConfig
from .leases import LeaseBook
from .loads import HolderLink, LoadRunner, release_lease
from .rank_registry import ReplicaRanks
from .staging import (
    SnapshotCopy,
    copy_blocks_into_store,
    copy_ring_into_store,
    device_tier_bytes,
    import_staging_ring,
    stage_snapshots,
)
from .tracker_updates import TrackerUpdates

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class _Mapped:
    """What exists once the engine's caches are mapped."""

    identity: ReplicaIdentity
    cache: BlockMajorCache
    store: TieredKVSnapshotStore
    transport: DeviceTierTransport
    leases: LeaseBook
    loads: LoadRunner
    holder_ops: Mapping[str, HolderOp]  # the transport's, asked once
    # the worker's staging ring (``connector.staging_ring``), when it shares one
    staging_ring: torch.Tensor | None = None


class XavierTransferActor(xo.StatelessActor):
    """Stateless in xoscar's sense: calls run concurrently on the pool's loop."""

    def __init__(self, config: TransferActorConfig) -> None:
        super().__init__()
        self._config = config
        self._mapped: _Mapped | None = None
        self._tracker: Any = None
        self._holder_refs = ActorRefs()
        # stage and transport_call calls and tracker updates in progress, drained
        # by close()
        self._operations: set[asyncio.Task[Any]] = set()
        self._counters = ActorCounters()
        # CPU-tier rows read from peers (received_*) and served to them (sent_*)
        self._cpu_tier_counters = TransportStats()
        self._tracker_updates = TrackerUpdates(
            config.rank, self._counters, self._deadline
        )
        self._ranks = ReplicaRanks(
            config.rank, config.tp_rank, config.tp_size, self._deadline
        )
        # successful loads, from start_load to their result
        self._load_latency = LatencyRecorder()
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None
        # why the last attempt to map the engine's caches failed (None: none did)
        self._mapping_error: str | None = None
        # load id -> result of a load that ended before close, not yet collected
        self._results_after_close: dict[str, LoadResult] = {}

    @classmethod
    def default_uid(cls) -> str:
        return "xavier-transfer"

    async def __post_create__(self) -> None:
        config = self._config
        threads = limit_cpu_threads()
        self._tracker = await self._deadline(
            xo.actor_ref(config.tracker_address, config.tracker_uid)
        )
        self._tracker_updates.tracker = await self._deadline(
            self._ranks.connect(self._tracker, self.address, self._lead)
        )
        logger.info(
            "Xavier transfer actor rank %d of %s at %s (%d CPU threads for torch)",
            config.rank,
            config.model_uid,
            self.address,
            threads,
        )

    async def __pre_destroy__(self) -> None:
        await self.close()

    # ---- engine cache ---------------------------------------------------------

    async def map_engine_caches(
        self,
        handles: SharedTensorHandles,
        num_blocks: int,
        model: str,
        block_size: int,
        layout_hint: str | None = None,
        staging_ring: SharedTensorHandles | None = None,
    ) -> ReplicaIdentity:
        """Map the engine's per-layer KV tensors, exactly once per actor, and build
        the snapshot store and the transport for their geometry, on their device.

        ``num_blocks`` and ``block_size`` are the engine's (vLLM's cache config); the
        layout is detected from the tensors, or named by ``layout_hint`` where the
        shape is ambiguous. ``staging_ring`` is the worker's staging ring, for
        ``stage_ring``. Returns this replica's identity. A failed attempt leaves
        nothing behind, so the caller may retry; a second successful one is refused.
        """
        try:
            identity = await self._map_engine_caches(
                handles, num_blocks, model, block_size, layout_hint, staging_ring
            )
        except Exception as exc:
            if self._mapped is None:
                # kept for stats(): the launcher waiting for the mapping reports
                # this cause at once instead of timing out without one
                self._mapping_error = f"{type(exc).__name__}: {exc}"
            raise
        self._mapping_error = None
        return identity

    async def _map_engine_caches(
        self,
        handles: SharedTensorHandles,
        num_blocks: int,
        model: str,
        block_size: int,
        layout_hint: str | None,
        staging_ring: SharedTensorHandles | None,
    ) -> ReplicaIdentity:
        self._check_open()
        if self._mapped is not None:
            raise RuntimeError(
                f"the engine KV caches of replica {self._config.rank} are already "
                "mapped; map them once per transfer actor"
            )
        config = self._config
        tensors = import_tensors(handles)
        layout = detect_layout(tensors, num_blocks, layout_hint)
        if layout.block_size != block_size:
            raise ValueError(
                f"the engine KV caches hold blocks of {layout.block_size} tokens in "
                f"layout {layout.name!r}, the engine says {block_size}"
            )
        cache = BlockMajorCache(tensors, layout, scatter_graphs=graphs_requested())
        identity = ReplicaIdentity(
            model, cache.geometry, layout.name, tensor_parallel_size=config.tp_size
        )
        ring = (
            None if staging_ring is None else import_staging_ring(staging_ring, cache)
        )
        store = TieredKVSnapshotStore(
            identity.geometry,
            cache.device,
            device_budget_bytes=device_tier_bytes(config.gpu_cache_bytes, ring),
            cpu_capacity_blocks=(
                num_blocks
                if config.cpu_capacity_blocks is None
                else config.cpu_capacity_blocks
            ),
        )
        if store.device.type == "cuda":
            pinned = await asyncio.to_thread(store.pin_cpu_tier)
            logger.info(
                "rank %d: CPU tier of %d blocks %s",
                config.rank,
                store.stats().cpu_capacity_blocks,
                "page-locked" if pinned else "in pageable memory",
            )
        try:
            transport = await create_device_tier_transport(
                config.transport,
                TransportContext(
                    address=self.address,
                    device=cache.device,
                    geometry=identity.geometry,
                    rpc_timeout_s=config.rpc_timeout_s,
                    agent_name=f"{config.model_uid}-{config.rank}",
                    store_rows=store.device_rows,
                    locate_rows=store.locate_device_rows,
                    engine_layers=cache.row_layers,
                    engine_block_axis=layout.block_axis,
                    generation_words=store.generations.words,
                ),
            )
        except BaseException:
            store.unpin_cpu_tier()  # a failed attempt leaves nothing behind
            raise
        self._mapped = _Mapped(
            identity,
            cache,
            store,
            transport,
            LeaseBook(
                config.rank,
                identity,
                store,
                transport,
                lease_ttl_s=config.lease_ttl_s,
                counters=self._counters,
            ),
            LoadRunner(
                config.rank,
                cache,
                transport,
                self._holder,
                rpc_timeout_s=config.rpc_timeout_s,
                counters=self._counters,
                latency=self._load_latency,
                cpu_tier_counters=self._cpu_tier_counters,
            ),
            transport.holder_ops(),
            ring,
        )
        logger.info(
            "rank %d mapped %d KV cache layers on %s (%s, scatter path %s); store %s",
            config.rank,
            len(tensors),
            cache.device,
            layout,
            cache.scatter_path
            + (" replayed as CUDA graphs" if cache.scatter_graphs is not None else ""),
            store.stats(),
        )
        return identity

    # ---- staging ----------------------------------------------------------------

    async def stage(self, items: list[StageItem]) -> int:
        """Snapshot computed engine blocks into the store and publish them; returns
        how many were staged (see ``staging.stage_snapshots``).

        Returns once the engine blocks have been copied, so the caller may let them
        be reused. The tracker learns of the published keys (and of the snapshots
        the store dropped to make room) afterwards, in order, in the background:
        until then peers see a miss, which only costs them a recomputation.
        """
        mapped = self._require_mapped()
        cache, store = mapped.cache, mapped.store
        return await self._stage(
            {item.key: item.block_id for item in items},
            functools.partial(copy_blocks_into_store, cache, store),
        )

    async def stage_ring(self, keys: list[BlockHash], ring_slots: list[int]) -> int:
        """``stage``, from the slots of the worker's staging ring into which the
        worker copied the blocks (``connector.staging_ring``); the worker may reuse
        the slots once this returns."""
        mapped = self._require_mapped()
        ring = mapped.staging_ring
        if ring is None:
            raise RuntimeError(
                f"replica {self._config.rank}'s worker mapped no staging ring"
            )
        if len(keys) != len(ring_slots):
            raise ValueError(f"{len(keys)} keys for {len(ring_slots)} ring slots")
        num_slots = ring.shape[0] // mapped.cache.num_layers
        bad = [slot for slot in ring_slots if not 0 <= slot < num_slots]
        if bad:
            raise ValueError(f"ring slots {bad} out of range 0..{num_slots - 1}")
        return await self._stage(
            dict(zip(keys, ring_slots, strict=True)),
            functools.partial(copy_ring_into_store, ring, mapped.store),
        )

    async def _stage(self, sources: dict[BlockHash, int], copy: SnapshotCopy) -> int:
        self._check_open()
        mapped = self._require_mapped()
        async with self._operation():
            try:
                keys = await stage_snapshots(
                    mapped.store,
                    sources,
                    mapped.cache.layout.dtype,
                    copy,
                    self._counters,
                )
            finally:
                store = mapped.store
                demoted = store.take_demoted()
                self._tell_tracker(
                    keys_added=[],
                    keys_dropped=store.take_dropped(),
                    located=self._locations(mapped, demoted, only_held=False),
                )
            self._tell_tracker(
                keys_added=keys,
                keys_dropped=[],
                located=self._locations(mapped, keys, only_held=True),
            )
            return len(keys)

    def _locations(
        self, mapped: _Mapped, keys: Sequence[BlockHash], only_held: bool
    ) -> list[Location]:
        """Device-tier locations to publish for lease-free readers; none when
        peers cannot READ this holder's generation words."""
        if not keys or not getattr(mapped.transport, "serves_generation_words", False):
            return []
        return device_locations(mapped.store, keys, only_held=only_held)

    def _tell_tracker(
        self,
        keys_added: list[BlockHash],
        keys_dropped: list[BlockHash],
        located: Sequence[Location] = (),
    ) -> None:
        task = self._tracker_updates.tell(keys_added, keys_dropped, located)
        if task is not None:  # close() waits for it
            self._operations.add(task)
            task.add_done_callback(self._operations.discard)

    async def rank_blocks_changed(
        self, tp_rank: int, dropped: bytes, added: bytes
    ) -> None:
        """The lead rank: another rank of this replica staged or dropped these."""
        await self._ranks.rank_changed(tp_rank, dropped, added)

    async def wait_tracker_updates(self) -> None:
        """Return once the tracker has been told (or failed to be told) of every
        snapshot staged or dropped so far: from then on peers can find them."""
        await self._tracker_updates.wait()

    # ---- holder side ------------------------------------------------------------

    async def reserve(
        self, keys: list[BlockHash], lease_id: str, requester: ReplicaIdentity
    ) -> LeaseGrant:
        """Lease the longest leading run of ``keys`` held here for ``requester``
        (``leases.LeaseBook.grant``)."""
        self._check_open()
        return self._require_mapped().leases.grant(keys, lease_id, requester)

    async def release(self, lease_id: str) -> None:
        """Release a lease; idempotent, and a no-op once the actor has closed."""
        if self._mapped is not None:
            self._mapped.leases.release(lease_id)

    async def transport_call(self, op: str, *args: Any) -> Any:
        """Peer-facing: one of our device-tier transport's holder ops."""
        self._check_open()
        handler = self._require_mapped().holder_ops.get(op)
        if handler is None:
            raise ValueError(
                f"replica {self._config.rank}'s {self._config.transport} transport "
                f"serves no {op!r}: do the replicas use different transports?"
            )
        async with self._operation():
            return await handler(*args)

    async def read_cpu_rows(self, lease_id: str, keys: list[BlockHash]) -> CpuRowsReply:
        """Peer-facing: every layer of leased CPU-tier snapshots, in the reply."""
        self._check_open()
        mapped = self._require_mapped()
        reply = gather_cpu_rows(mapped.store, lease_id, keys)
        self._counters.cpu_rows_served += len(keys) * mapped.cache.num_layers
        count_cpu_rows(self._cpu_tier_counters, reply, received=False)
        return reply

    # ---- loader side ------------------------------------------------------------

    async def start_load(self, req: LoadRequest) -> None:
        """Start loading a grant's snapshots into engine blocks; returns at once.

        The load takes over the grant's lease: it is released on the holder when
        the load ends, and also when this call refuses the request. Refusals
        (clear errors, raised here): a closed actor, unmapped caches, a load id in
        use, a logical dtype other than the engine's, an unknown tier, a
        destination block out of range, named twice, or still being written by
        another load.
        """
        try:
            self._check_open()
            mapped = self._require_mapped()
        except BaseException:
            # Refused before a runner existed: give the lease back all the same.
            await release_lease(
                self._config.rank,
                self._holder,
                req,
                self._config.rpc_timeout_s,
                self._counters,
            )
            raise
        await mapped.loads.start(req)

    async def wait_load(self, load_id: str, timeout: float) -> LoadResult:
        """Wait for a load to end and collect its result (TimeoutError: still running)."""
        if self._mapped is None and load_id in self._results_after_close:
            return self._results_after_close.pop(load_id)
        return await self._require_mapped().loads.wait(load_id, timeout)

    async def run_load(self, req: LoadRequest, timeout: float) -> LoadResult:
        """The asynchronous path in one call: start a load (as ``start_load``) and
        answer its result once it ends. One still running after ``timeout`` is
        cancelled (its writes end first) and answered as failed."""
        await self.start_load(req)
        return await self._require_mapped().loads.wait_or_cancel(req.load_id, timeout)

    async def cancel_load(self, load_id: str) -> None:
        """Stop a load at its next chunk and wait until its writes have finished,
        its destination blocks are free and its lease is released."""
        if self._mapped is None and load_id in self._results_after_close:
            return  # it ended before the actor closed
        await self._require_mapped().loads.cancel(load_id)

    async def load_now(self, req: LoadRequest, wait_s: float) -> LoadResult:
        """The synchronous fast path in one call: start a load (as ``start_load``)
        and wait at most ``wait_s`` for its result; past that the load is fenced
        (no write of it lands any more) and reported failed."""
        await self.start_load(req)
        return await self._require_mapped().loads.wait_bounded(req.load_id, wait_s)

    async def fence_load(self, load_id: str) -> None:
        """Make sure no write of a load lands any more, without waiting for its
        holder; its result is dropped (the caller reports its blocks failed)."""
        if self._mapped is not None:
            await self._mapped.loads.fence(load_id)

    async def _holder(
        self, address: str, rank: int, tp_rank: int | None = None
    ) -> HolderLink:
        """Holder ``rank``'s actor of our tensor-parallel rank (rank r reads rank r)."""
        config = self._config
        tp = config.tp_rank if tp_rank is None else tp_rank
        uid = transfer_actor_uid(config.model_uid, rank, tp)
        ref: HolderLink = await self._deadline(self._holder_refs.get(address, uid))
        return ref

    async def _lead(self) -> Any:  # our replica's rank 0 (rank_registry.LeadLink)
        return await self._holder(self.address, self._config.rank, 0)

    # ---- reporting and shutdown -----------------------------------------------

    async def record_connector_fault(self, where: str) -> None:
        """Count a fault this replica's connector contained in method ``where``
        (logged there, with its traceback); the count feeds the metrics."""
        self._counters.connector_faults += 1
        logger.debug("rank %d: connector fault in %s", self._config.rank, where)

    async def record_connector_totals(self, totals: ConnectorTotals) -> None:
        """What this rank's engine process counted so far: the lease-free loads
        it READ itself and the blocks it staged or skipped
        (``connector/totals_report.py``); they feed the metrics."""
        self._counters.record_connector_totals(totals)

    async def stats(self) -> XavierStats:
        """Everything this replica's Xavier side counts (``stats.XavierStats``)."""
        mapped = self._mapped
        return XavierStats(
            actor=replace(self._counters),
            load_latency=self._load_latency.summary(),
            store=None if mapped is None else mapped.store.stats(),
            transport=None if mapped is None else mapped.transport.stats(),
            cpu_tier_transport=(
                None if mapped is None else replace(self._cpu_tier_counters)
            ),
            engine=(
                None
                if mapped is None
                else EngineInfo(
                    layout=mapped.cache.layout.name,
                    layers=mapped.cache.num_layers,
                    device=str(mapped.cache.device),
                    scatter_path=mapped.cache.scatter_path,
                    block_size=mapped.cache.geometry.block_size,
                )
            ),
            in_flight_loads=0 if mapped is None else mapped.loads.in_flight,
            closed=self._closing,
            mapping_error=self._mapping_error,
        )

    async def close(self) -> None:
        """Drain loads and peer requests in progress, then release the transport,
        the store and the mapped engine memory, and log the counters. Concurrent
        calls share one close; later calls return at once."""
        if self._close_task is None:
            self._close_task = asyncio.create_task(self._close())
        await asyncio.shield(self._close_task)

    async def _close(self) -> None:
        self._closing = True  # from now on new requests are refused
        rank = self._config.rank
        mapped = self._mapped
        while True:
            # Each of these waits on peers only with deadlines, so this ends; the
            # loop catches the tracker updates that ending stagings queue.
            pending: list[asyncio.Task[Any]] = list(self._operations)
            if mapped is not None:
                pending += mapped.loads.tasks()
            pending = [task for task in pending if not task.done()]
            if not pending:
                break
            await asyncio.wait(pending)
        if self._tracker is not None and self._ranks.leads:
            try:
                await self._deadline(self._tracker.forget_replica(rank))
            except Exception as exc:  # the tracker may already be gone at shutdown
                self._counters.tracker_failures += 1
                logger.warning("rank %d could not leave the tracker: %r", rank, exc)
        stats = await self.stats()
        self._mapped = None
        if mapped is not None:
            # Results stay collectable; everything else goes with the memory.
            self._results_after_close = {r.load_id: r for r in mapped.loads.finished()}
            await mapped.transport.close()
            mapped.store.unpin_cpu_tier()
            release_memory(mapped.store.device)
        logger.info("Xavier transfer actor rank %d closed: %s", rank, stats)

    # ---- helpers ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError(
                f"the transfer actor of replica {self._config.rank} is closed"
            )

    def _require_mapped(self) -> _Mapped:
        if self._mapped is None:
            if self._closing:
                raise RuntimeError(
                    f"the transfer actor of replica {self._config.rank} is closed"
                )
            raise RuntimeError(
                f"replica {self._config.rank} has not mapped its engine KV caches "
                "yet (map_engine_caches)"
            )
        return self._mapped

    def _operation(self) -> Tracked:
        return Tracked(self._operations)

    async def _deadline(self, call: Awaitable[T]) -> T:
        # xo.wait_for rather than asyncio.wait_for: it times out even when the
        # cancellation of an actor call cannot reach an unresponsive peer.
        return await xo.wait_for(call, self._config.rpc_timeout_s)
