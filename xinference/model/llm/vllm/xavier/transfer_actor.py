"""The transfer actor: one per replica, the owner of everything that moves KV.

It lives in the replica's actor pool on a ``nixl://`` address and owns the tiered
snapshot store, the device-tier transport and the engine's KV cache tensors, mapped
once from the worker process (``device.import_tensors``). Its callers:

- the worker side of the connector: ``map_engine_caches``, ``stage`` (snapshot
  computed blocks), ``start_load`` / ``wait_load`` / ``finished_loads`` /
  ``cancel_load`` (bring a peer's snapshots into engine blocks);
- the scheduler side: ``reserve`` / ``release`` on the holder, through the tracker's
  answer;
- peer transfer actors: ``push_rows`` (device tier) and ``read_cpu_rows`` (CPU tier).

Loads run as background tasks. A load owns its destination blocks and the holder's
lease from ``start_load`` until every write into this replica's memory has
finished; only then are the blocks free for another load and the lease released,
whether the load succeeded, failed or was cancelled. Cancellation is therefore
cooperative: it is noticed between chunks, never by abandoning a write in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch
import xoscar as xo

from .aio import finish_even_if_cancelled
from .config import DEFAULT_TRANSPORT, TRANSPORTS, transfer_actor_uid
from .cpu_transfer import CpuRowsReply, gather_cpu_rows, load_cpu_rows
from .device import SharedTensorHandles, fence, import_tensors, release_memory
from .gpu_transfer import check_logical_dtype, chunk_row_index
from .hashing import BlockHash
from .latency import LatencyRecorder
from .layout import BlockMajorCache, detect_layout, row_format, wide_view
from .messages import (
    CPU_TIER,
    DEVICE_TIER,
    KVGeometry,
    LeaseGrant,
    LoadRequest,
    LoadResult,
    PushRequest,
    ReplicaIdentity,
    StageItem,
)
from .nixl_transport import (
    NixlDirectTransport,
    NixlEndpointInfo,
    NixlSource,
    locate_device_rows,
)
from .tiered_snapshot import StageSlot, TieredKVSnapshotStore
from .transport import DeviceTierTransport, RowScatter, create_device_tier_transport

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TransferActorConfig:
    """Everything one replica's transfer actor needs, validated once here.

    What depends on the engine (geometry, layout, device) is learnt when its caches
    are mapped. ``gpu_cache_bytes`` is the device tier's budget (None or 0: no device
    tier, new snapshots go to the CPU tier); ``cpu_capacity_blocks`` bounds the CPU
    tier (None: the engine's KV block count). ``rpc_timeout_s`` is the deadline of
    every wait on a peer or the tracker.
    """

    model_uid: str
    rank: int
    tracker_address: str
    tracker_uid: str
    gpu_cache_bytes: int | None = None
    cpu_capacity_blocks: int | None = None
    transport: str = DEFAULT_TRANSPORT
    rpc_timeout_s: float = 30.0
    # A lease older than this is released by the holder itself: the loader that
    # took it died or lost track of it, and its snapshots must not stay pinned.
    lease_ttl_s: float = 300.0

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be non-negative, got {self.rank}")
        if self.gpu_cache_bytes is not None and self.gpu_cache_bytes < 0:
            raise ValueError(
                f"gpu_cache_bytes must be non-negative, got {self.gpu_cache_bytes}"
            )
        if self.cpu_capacity_blocks is not None and self.cpu_capacity_blocks < 0:
            raise ValueError(
                f"cpu_capacity_blocks must be non-negative, got {self.cpu_capacity_blocks}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"unknown transport {self.transport!r}; choose one of {TRANSPORTS}"
            )
        if not self.rpc_timeout_s > 0:
            raise ValueError(
                f"rpc_timeout_s must be positive, got {self.rpc_timeout_s}"
            )
        if not self.lease_ttl_s > self.rpc_timeout_s:
            raise ValueError(
                f"lease_ttl_s ({self.lease_ttl_s}) must exceed rpc_timeout_s "
                f"({self.rpc_timeout_s}): a lease must outlive one load's waits"
            )


class LoadCancelled(Exception):
    """Raised inside a load when ``cancel_load`` asked it to stop."""


@dataclass(slots=True)
class _Load:
    """A load in progress (mutable, owned by the actor)."""

    request: LoadRequest
    task: asyncio.Task[None] | None = None
    cancel_requested: bool = False
    started: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class _ActorCounters:
    loads_started: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    loads_cancelled: int = 0
    device_tier_blocks_loaded: int = 0
    cpu_tier_blocks_loaded: int = 0
    cpu_rows_served: int = 0
    snapshots_staged: int = 0
    stage_failures: int = 0
    lease_release_failures: int = 0
    leases_expired: int = 0
    tracker_failures: int = 0
    connector_faults: int = 0  # contained inside this replica's vLLM connector


class XavierTransferActor(xo.StatelessActor):
    """One replica's KV transfer endpoint. See the module docstring."""

    def __init__(self, config: TransferActorConfig) -> None:
        super().__init__()
        self._config = config
        # Known once the engine caches are mapped, as are the store and transport.
        self._identity: ReplicaIdentity | None = None
        self._store: TieredKVSnapshotStore | None = None
        self._transport: DeviceTierTransport | None = None
        self._tracker: Any = None
        self._cache: BlockMajorCache | None = None
        # load id -> load in progress
        self._loads: dict[str, _Load] = {}
        # load id -> result not yet collected (by wait_load or finished_loads)
        self._results: dict[str, LoadResult] = {}
        # engine block id -> id of the load that is writing it
        self._busy_blocks: dict[int, str] = {}
        # lease id -> loop time it was granted (holder side, non-empty grants only)
        self._lease_granted_at: dict[str, float] = {}
        # (address, uid) -> actor ref of a holder
        self._holder_refs: dict[tuple[str, str], Any] = {}
        # stage and push_rows calls in progress, drained by close()
        self._operations: set[asyncio.Task[Any]] = set()
        self._counters = _ActorCounters()
        # successful loads, from start_load to their result
        self._load_latency = LatencyRecorder()
        self._closing = False
        self._close_task: asyncio.Task[None] | None = None

    @classmethod
    def default_uid(cls) -> str:
        return "xavier-transfer"

    async def __post_create__(self) -> None:
        config = self._config
        self._tracker = await self._deadline(
            xo.actor_ref(config.tracker_address, config.tracker_uid)
        )
        await self._deadline(self._tracker.register_replica(config.rank, self.address))
        logger.info(
            "Xavier transfer actor rank %d of %s at %s",
            config.rank,
            config.model_uid,
            self.address,
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
    ) -> ReplicaIdentity:
        """Map the engine's per-layer KV tensors, exactly once per actor, and build
        the snapshot store and the transport for their geometry, on their device.

        ``num_blocks`` and ``block_size`` are the engine's (vLLM's cache config); the
        layout is detected from the tensors, or named by ``layout_hint`` where the
        shape is ambiguous. Returns this replica's identity. A failed attempt leaves
        nothing behind, so the caller may retry; a second successful one is refused.
        """
        self._check_open()
        if self._cache is not None:
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
        cache = BlockMajorCache(tensors, layout)
        identity = ReplicaIdentity(model, cache.geometry, layout.name)
        device = cache.device
        cpu_capacity = (
            num_blocks
            if config.cpu_capacity_blocks is None
            else config.cpu_capacity_blocks
        )
        store = TieredKVSnapshotStore(
            identity.geometry,
            device,
            device_budget_bytes=config.gpu_cache_bytes or 0,
            cpu_capacity_blocks=cpu_capacity,
        )
        transport = await create_device_tier_transport(
            config.transport,
            self.address,
            device,
            identity.geometry,
            config.rpc_timeout_s,
            agent_name=f"{config.model_uid}-{config.rank}",
            store_rows=store.device_rows,
            engine_layers=tensors,
            engine_block_axis=layout.block_axis,
        )
        self._cache, self._identity = cache, identity
        self._store, self._transport = store, transport
        logger.info(
            "rank %d mapped %d KV cache layers on %s (%s, scatter path %s); store %s",
            config.rank,
            len(tensors),
            device,
            layout,
            cache.scatter_path,
            store.stats(),
        )
        return identity

    @property
    def _geometry(self) -> KVGeometry:
        if self._identity is None:
            raise RuntimeError(self._not_mapped())
        return self._identity.geometry

    # ---- staging ----------------------------------------------------------------

    async def stage(self, items: list[StageItem]) -> int:
        """Snapshot computed engine blocks into the store; returns how many.

        Keys already present, or skipped by a full store, are not staged. The copy is
        fenced before anything is published, and nothing is published unless every
        staged snapshot was copied: on failure every staged key is rolled back and
        the error re-raised. Published keys are registered with the tracker (if
        that fails, the error is raised and the snapshots stay local, which peers
        see as misses); snapshots the store dropped to make room are unregistered.

        The caller must have completed the engine's writes to these blocks first
        (on CUDA: synchronised the stream that computed them).
        """
        self._check_open()
        cache = self._require_cache()
        store = self._require_store()
        async with self._operation():
            staged: list[tuple[StageSlot, int]] = []
            try:
                for item in items:
                    slot = store.begin_stage(item.key, cache.layout.dtype)
                    if slot is not None:
                        staged.append((slot, item.block_id))
                if staged:
                    await finish_even_if_cancelled(
                        asyncio.to_thread(_copy_blocks_into_store, cache, store, staged)
                    )
                    layers = range(self._geometry.num_layers)
                    for slot, _ in staged:
                        store.mark_layers_written(slot.key, layers)
                    for slot, _ in staged:
                        store.publish(slot.key)
            except BaseException:
                self._counters.stage_failures += 1
                for slot, _ in staged:
                    if not store.contains(slot.key):
                        store.abort_stage(slot.key)
                raise
            finally:
                await self._unregister_dropped(store.take_dropped())
            if staged:
                self._counters.snapshots_staged += len(staged)
                await self._deadline(
                    self._tracker.register_blocks(
                        self._config.rank, [slot.key for slot, _ in staged]
                    )
                )
            return len(staged)

    async def _unregister_dropped(self, dropped: list[BlockHash]) -> None:
        if not dropped:
            return
        try:
            await self._deadline(
                self._tracker.unregister_blocks(self._config.rank, dropped)
            )
        except Exception as exc:  # logged and counted; see below
            # Not fatal: a stale tracker entry makes a peer's reservation here come
            # back short, which it treats as a miss.
            self._counters.tracker_failures += 1
            logger.warning(
                "rank %d could not unregister %d dropped snapshots: %r",
                self._config.rank,
                len(dropped),
                exc,
            )

    # ---- holder side ------------------------------------------------------------

    async def reserve(
        self, keys: list[BlockHash], lease_id: str, requester: ReplicaIdentity
    ) -> LeaseGrant:
        """Lease the longest leading run of ``keys`` held here for ``requester``.

        An incompatible requester is an error (its KV would be wrong here); an
        empty grant is a miss.
        """
        self._check_open()
        self._require_cache()
        identity = self._identity
        assert identity is not None
        reason = identity.incompatibility(requester)
        if reason is None and row_format(identity.layout) != row_format(
            requester.layout
        ):
            reason = (
                f"KV layouts {identity.layout!r} here and {requester.layout!r} on the "
                "peer order a block's bytes differently"
            )
        if reason is not None:
            raise ValueError(
                f"replica {self._config.rank} cannot share KV with this requester: "
                f"{reason}"
            )
        store = self._require_store()
        self._expire_leases(store)
        entries = store.lease(lease_id, keys)
        if entries:
            self._lease_granted_at[lease_id] = asyncio.get_running_loop().time()
        nixl = self._nixl_transport()
        return LeaseGrant(
            lease_id=lease_id,
            holder_rank=self._config.rank,
            keys=tuple(keys[: len(entries)]),
            tiers=tuple(tier for tier, _, _ in entries),
            logical_dtypes=tuple(dtype for _, _, dtype in entries),
            # a loader reads device tier rows straight from here (see nixl_source)
            first_rows=tuple(row for _, row, _ in entries) if nixl else (),
            holder_epoch=nixl.endpoint.info.epoch if nixl else None,
        )

    async def nixl_endpoint_info(self) -> NixlEndpointInfo:
        """Peer-facing (nixl transport): our agent's metadata for our device tier."""
        self._check_open()
        return self._require_nixl().endpoint.info

    async def nixl_source(self, lease_id: str, keys: list[BlockHash]) -> NixlSource:
        """Peer-facing (nixl transport): where leased device tier keys sit."""
        self._check_open()
        rows = locate_device_rows(self._require_store(), lease_id, keys)
        return self._require_nixl().endpoint.source(rows)

    def _nixl_transport(self) -> NixlDirectTransport | None:
        transport = self._transport
        return transport if isinstance(transport, NixlDirectTransport) else None

    def _require_nixl(self) -> NixlDirectTransport:
        transport = self._nixl_transport()
        if transport is None:
            raise RuntimeError(
                f"replica {self._config.rank} does not use the nixl transport"
            )
        return transport

    async def release(self, lease_id: str) -> None:
        """Release a lease; idempotent, and a no-op once the actor has closed."""
        self._lease_granted_at.pop(lease_id, None)
        if self._store is not None:
            self._store.release(lease_id)

    def _expire_leases(self, store: TieredKVSnapshotStore) -> None:
        """Release leases older than ``lease_ttl_s``. A load still reading under an
        expired lease then fails cleanly (unknown key under that lease), and its
        request recomputes; pinning snapshots forever would be worse."""
        deadline = asyncio.get_running_loop().time() - self._config.lease_ttl_s
        expired = [lid for lid, t in self._lease_granted_at.items() if t < deadline]
        for lease_id in expired:
            del self._lease_granted_at[lease_id]
            store.release(lease_id)
            self._counters.leases_expired += 1
            logger.warning(
                "rank %d released lease %s after %.0f s: its loader never did",
                self._config.rank,
                lease_id,
                self._config.lease_ttl_s,
            )

    async def push_rows(self, req: PushRequest) -> None:
        """Peer-facing: write rows of leased device-tier snapshots into ``req.dest``."""
        self._check_open()
        store = self._require_store()
        transport = self._require_transport()
        async with self._operation():
            num_layers = self._geometry.num_layers
            if req.num_rows <= 0:
                return
            first_key = req.first_row // num_layers
            last_key = (req.first_row + req.num_rows - 1) // num_layers
            if first_key < 0 or last_key >= len(req.keys):
                raise ValueError(
                    f"rows {req.first_row}..{req.first_row + req.num_rows - 1} are "
                    f"outside the {len(req.keys)} keys of the request"
                )
            first_rows = []
            for key in req.keys[first_key : last_key + 1]:
                tier, first_row = store.locate(req.lease_id, key)
                if tier != DEVICE_TIER:
                    raise ValueError(
                        f"snapshot {key.hex()} under lease {req.lease_id!r} is in the "
                        f"{tier} tier; read it with read_cpu_rows"
                    )
                first_rows.append(first_row)
            row_index = chunk_row_index(
                first_rows,
                num_layers,
                req.first_row - first_key * num_layers,
                req.num_rows,
            )
            await transport.serve(req, store.device_rows, row_index)

    async def read_cpu_rows(self, lease_id: str, keys: list[BlockHash]) -> CpuRowsReply:
        """Peer-facing: every layer of leased CPU-tier snapshots, in the reply."""
        self._check_open()
        reply = gather_cpu_rows(self._require_store(), lease_id, keys)
        self._counters.cpu_rows_served += len(keys) * self._geometry.num_layers
        return reply

    # ---- loader side ------------------------------------------------------------

    async def start_load(self, req: LoadRequest) -> None:
        """Start loading a grant's snapshots into engine blocks; returns at once.

        The load takes over the grant's lease: it is released on the holder when
        the load ends, and also when this call refuses the request. Refusals
        (clear errors, raised here): a closed actor, unmapped caches, a load id in use, a logical
        dtype other than the engine's, an unknown tier, a destination block out of
        range, named twice, or still being written by another load.
        """
        try:
            self._check_open()
            self._validate_load(req)
        except BaseException:
            await self._release_on_holder(req)
            raise
        load = _Load(req)
        self._loads[req.load_id] = load
        for block_id in req.dst_block_ids:
            self._busy_blocks[block_id] = req.load_id
        self._counters.loads_started += 1
        load.task = asyncio.create_task(self._run_load(load))

    async def wait_load(self, load_id: str, timeout: float) -> LoadResult:
        """Wait for a load to end and collect its result (TimeoutError: still running)."""
        load = self._loads.get(load_id)
        if load is not None and load.task is not None:
            await asyncio.wait_for(asyncio.shield(load.task), timeout)
        try:
            return self._results.pop(load_id)
        except KeyError:
            raise KeyError(
                f"no load {load_id!r} to wait for (or already collected)"
            ) from None

    async def finished_loads(self) -> list[LoadResult]:
        """Results of the loads that ended since the last call (each reported once)."""
        results = list(self._results.values())
        self._results.clear()
        return results

    async def cancel_load(self, load_id: str) -> None:
        """Stop a load at its next chunk and wait until its writes have finished,
        its destination blocks are free and its lease is released.

        The result stays to be collected; it keeps the load's original error, or
        says it was cancelled. A load that already ended is left as it is.
        """
        load = self._loads.get(load_id)
        if load is None:
            if load_id in self._results:
                return
            raise KeyError(f"no load {load_id!r} to cancel")
        load.cancel_requested = True
        assert load.task is not None
        await asyncio.shield(load.task)

    def _validate_load(self, req: LoadRequest) -> None:
        cache = self._require_cache()
        if req.load_id in self._loads or req.load_id in self._results:
            raise ValueError(f"load id {req.load_id!r} is already in use")
        for key, tier, dtype in zip(
            req.grant.keys, req.grant.tiers, req.grant.logical_dtypes, strict=True
        ):
            if tier not in (DEVICE_TIER, CPU_TIER):
                raise ValueError(f"unknown tier {tier!r} for snapshot {key.hex()}")
            check_logical_dtype(cache.layout.dtype, dtype)
        seen: set[int] = set()
        for block_id in req.dst_block_ids:
            if not 0 <= block_id < cache.layout.num_blocks:
                raise ValueError(
                    f"destination block {block_id} is out of range for "
                    f"{cache.layout.num_blocks} KV cache blocks"
                )
            if block_id in seen:
                raise ValueError(
                    f"conflicting destinations: block {block_id} appears twice in "
                    f"load {req.load_id!r}"
                )
            seen.add(block_id)
            other = self._busy_blocks.get(block_id)
            if other is not None:
                raise ValueError(
                    f"conflicting destinations: block {block_id} is still being "
                    f"written by load {other!r}"
                )

    async def _run_load(self, load: _Load) -> None:
        req = load.request
        error: BaseException | None = None
        try:
            await finish_even_if_cancelled(self._transfer(load))
        except BaseException as exc:  # reported in the result, never swallowed
            error = exc
        try:
            # The scatters may only have queued device work; the engine (another
            # process) must not read these blocks, nor another load write them,
            # before it has completed.
            await finish_even_if_cancelled(
                asyncio.to_thread(fence, self._require_cache().device)
            )
        except BaseException as exc:  # a sticky device error: the blocks are suspect
            error = error or exc
        # Every write into our memory has finished here: the transports return only
        # once the holder can no longer write, and the scatters were fenced.
        await self._release_on_holder(req)
        for block_id in req.dst_block_ids:
            if self._busy_blocks.get(block_id) == req.load_id:
                del self._busy_blocks[block_id]
        del self._loads[req.load_id]
        num_blocks = len(req.grant.keys)
        if error is None:
            self._counters.loads_ok += 1
            self._load_latency.record(time.perf_counter() - load.started)
            result = LoadResult(req.load_id, ok=True, num_blocks=num_blocks)
        else:
            if isinstance(error, LoadCancelled):
                self._counters.loads_cancelled += 1
            else:
                self._counters.loads_failed += 1
                logger.warning(
                    "rank %d: load %s of %d blocks from rank %d failed: %r",
                    self._config.rank,
                    req.load_id,
                    num_blocks,
                    req.grant.holder_rank,
                    error,
                )
            result = LoadResult(
                req.load_id,
                ok=False,
                num_blocks=num_blocks,
                error=f"{type(error).__name__}: {error}",
            )
        self._results[req.load_id] = result
        if isinstance(error, asyncio.CancelledError):
            raise error  # the actor pool is shutting down; cleanup is done

    async def _transfer(self, load: _Load) -> None:
        req = load.request
        grant = req.grant
        if load.cancel_requested:
            raise LoadCancelled(f"load {req.load_id!r} was cancelled")
        holder = await self._holder_ref(req.holder_address, grant.holder_rank)
        by_tier: dict[str, tuple[list[BlockHash], list[int]]] = {
            DEVICE_TIER: ([], []),
            CPU_TIER: ([], []),
        }  # tier -> (keys, destination blocks)
        device_rows: list[int] = []  # holder rows of the device tier keys, if known
        for i, (key, tier, block_id) in enumerate(
            zip(grant.keys, grant.tiers, req.dst_block_ids, strict=True)
        ):
            by_tier[tier][0].append(key)
            by_tier[tier][1].append(block_id)
            if tier == DEVICE_TIER and grant.first_rows:
                device_rows.append(grant.first_rows[i])
        source = None
        if grant.holder_epoch is not None and grant.first_rows:
            source = NixlSource(*grant.holder_epoch, first_rows=tuple(device_rows))

        parts: list[Awaitable[Any]] = []
        device_keys, device_blocks = by_tier[DEVICE_TIER]
        if device_keys:
            parts.append(
                self._require_transport().load(
                    holder,
                    grant.holder_rank,
                    grant.lease_id,
                    device_keys,
                    self._row_scatter(load, device_blocks),
                    dst_block_ids=device_blocks,
                    source=source,
                )
            )
        cpu_keys, cpu_blocks = by_tier[CPU_TIER]
        if cpu_keys:
            parts.append(
                load_cpu_rows(
                    holder,
                    grant.lease_id,
                    cpu_keys,
                    self._geometry,
                    self._row_scatter(load, cpu_blocks),
                    self._config.rpc_timeout_s,
                )
            )
        # Both tiers at once; each part runs to its end before we look at errors, so
        # nothing is still writing when the first error propagates.
        outcomes = await asyncio.gather(*parts, return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
        self._counters.device_tier_blocks_loaded += len(device_keys)
        self._counters.cpu_tier_blocks_loaded += len(cpu_keys)

    def _row_scatter(self, load: _Load, dst_blocks: Sequence[int]) -> RowScatter:
        """Scatter of global rows over ``dst_blocks``' keys into the engine cache."""
        cache = self._require_cache()
        destinations = torch.tensor(list(dst_blocks), dtype=torch.long)

        def scatter(first_row: int, rows: torch.Tensor) -> None:
            if load.cancel_requested:
                raise LoadCancelled(f"load {load.request.load_id!r} was cancelled")
            cache.scatter_rows(first_row, rows, destinations)
            # ``rows`` may be a transfer slab that the next chunk overwrites as soon
            # as we return: on a device, the copies out of it must be complete. A
            # short wait (small copies just queued), so it stays on the loop.
            fence(cache.device)

        return scatter

    async def _release_on_holder(self, req: LoadRequest) -> None:
        """Release the load's lease on its holder; a failure is logged, not raised,
        so that it never hides the load's own outcome."""
        try:
            holder = await self._holder_ref(req.holder_address, req.grant.holder_rank)
            await self._deadline(holder.release(req.grant.lease_id))
        except Exception as exc:  # the holder may be gone; its lease went with it
            self._counters.lease_release_failures += 1
            logger.warning(
                "rank %d could not release lease %s on rank %d: %r",
                self._config.rank,
                req.grant.lease_id,
                req.grant.holder_rank,
                exc,
            )

    async def _holder_ref(self, address: str, rank: int) -> Any:
        uid = transfer_actor_uid(self._config.model_uid, rank)
        ref = self._holder_refs.get((address, uid))
        if ref is None:
            ref = await self._deadline(xo.actor_ref(address, uid))
            self._holder_refs[(address, uid)] = ref
        return ref

    # ---- reporting and shutdown -----------------------------------------------

    async def record_connector_fault(self, where: str) -> None:
        """Count a fault this replica's connector contained in method ``where``
        (logged there, with its traceback); the count feeds the metrics."""
        self._counters.connector_faults += 1

    async def stats(self) -> dict[str, Any]:
        """{"store": store counters, "transport": transport counters,
        "actor": load/stage counters, "load_latency": ``LatencyRecorder.summary()``
        of successful loads, "engine": the mapped cache's layout, layer count,
        device and scatter path, "in_flight_loads": n, "closed": bool}."""
        return {
            "store": self._store.stats() if self._store is not None else {},
            "transport": (
                self._transport.counters() if self._transport is not None else {}
            ),
            "actor": asdict(self._counters),
            "load_latency": self._load_latency.summary(),
            "engine": (
                {}
                if self._cache is None
                else {
                    "layout": self._cache.layout.name,
                    "layers": self._cache.num_layers,
                    "device": str(self._cache.device),
                    "scatter_path": self._cache.scatter_path,
                }
            ),
            "in_flight_loads": len(self._loads),
            "closed": self._closing,
        }

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
        pending = [load.task for load in self._loads.values() if load.task is not None]
        pending += list(self._operations)
        if pending:
            # Each of these waits on peers only with deadlines, so this ends.
            await asyncio.wait(pending)
        if self._tracker is not None:
            try:
                await self._deadline(self._tracker.forget_replica(rank))
            except Exception as exc:  # the tracker may already be gone at shutdown
                self._counters.tracker_failures += 1
                logger.warning("rank %d could not leave the tracker: %r", rank, exc)
        stats = await self.stats()
        if self._transport is not None:
            await self._transport.close()
        device = self._store.device if self._store is not None else None
        self._transport = None
        self._store = None
        self._cache = None
        self._holder_refs.clear()
        if device is not None:
            release_memory(device)
        logger.info("Xavier transfer actor rank %d closed: %s", rank, stats)

    # ---- helpers ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError(
                f"the transfer actor of replica {self._config.rank} is closed"
            )

    def _not_mapped(self) -> str:
        if self._closing:
            return f"the transfer actor of replica {self._config.rank} is closed"
        return (
            f"replica {self._config.rank} has not mapped its engine KV caches yet "
            "(map_engine_caches)"
        )

    def _require_cache(self) -> BlockMajorCache:
        if self._cache is None:
            raise RuntimeError(self._not_mapped())
        return self._cache

    def _require_store(self) -> TieredKVSnapshotStore:
        if self._store is None:
            raise RuntimeError(self._not_mapped())
        return self._store

    def _require_transport(self) -> DeviceTierTransport:
        if self._transport is None:
            raise RuntimeError(self._not_mapped())
        return self._transport

    def _operation(self) -> _Tracked:
        return _Tracked(self._operations)

    async def _deadline(self, call: Awaitable[T]) -> T:
        # xo.wait_for rather than asyncio.wait_for: it times out even when the
        # cancellation of an actor call cannot reach an unresponsive peer.
        return await xo.wait_for(call, self._config.rpc_timeout_s)


class _Tracked:
    """``async with``: the current task is in ``tasks`` for the block's duration."""

    def __init__(self, tasks: set[asyncio.Task[Any]]) -> None:
        self._tasks = tasks
        self._task: asyncio.Task[Any] | None = None

    async def __aenter__(self) -> None:
        self._task = asyncio.current_task()
        if self._task is not None:
            self._tasks.add(self._task)

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._tasks.discard(self._task)


def _copy_blocks_into_store(
    cache: BlockMajorCache,
    store: TieredKVSnapshotStore,
    staged: Sequence[tuple[StageSlot, int]],
) -> None:
    """Copy every layer of the staged engine blocks into their store slots, then
    fence both devices. Runs in a worker thread: the slots are reserved and
    invisible, so nothing else touches them meanwhile."""
    num_layers = cache.num_layers
    for tier in (DEVICE_TIER, CPU_TIER):
        picked = [(slot, block) for slot, block in staged if slot.tier == tier]
        if not picked:
            continue
        rows = wide_view(store.rows(tier))
        blocks = torch.tensor([block for _, block in picked], dtype=torch.long)
        first_rows = torch.tensor(
            [slot.first_row for slot, _ in picked], dtype=torch.long, device=rows.device
        )
        for layer in range(num_layers):
            gathered = wide_view(
                cache.gather(layer, blocks).to(rows.device), rows.dtype
            )
            rows.index_copy_(0, first_rows + layer, gathered)
    # A snapshot must never be published before its copy has completed.
    fence(cache.device)
    fence(store.device)
