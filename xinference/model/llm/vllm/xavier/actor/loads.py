"""The loader side of a transfer actor: bring a peer's leased snapshots into engine
blocks, in the background.

A load owns its destination blocks and the holder's lease from ``start`` until every
write into this replica's memory has finished; only then are the blocks free for
another load, its result recorded and the lease released (unawaited: the result does
not wait for the holder), whether the load succeeded, failed or was cancelled.
Cancellation is therefore cooperative: it is noticed between chunks, never by
abandoning a write in flight. A synchronous load past its bound is fenced instead
(``fence``): no write of it lands any more, and its caller reports it failed at once.

Device-tier snapshots move through the device-tier transport, CPU-tier snapshots
through ``transports.cpu_tier``, both at once; each chunk is scattered into the
engine blocks as it arrives (``row_scatter``: the destination ids go to the device
once per load, and a chunk's copies are waited for only where the transport reuses
the chunk's buffer without waiting for them itself), unless the transport placed
the rows in the engine blocks itself. The copies a load queued are complete before
its result is reported: one wait per load (``settle``), since the engine, another
process, reads the blocks next. ``LoadRunner`` needs no xoscar: it reaches a holder
through ``HolderLink`` (a transfer actor's ref is one).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..aio import finish_even_if_cancelled, with_deadline
from ..engine.blocks import BlockDestinations, BlockMajorCache
from ..engine.device import DeviceWorkMark, settle
from ..hashing import BlockHash
from ..stats import ActorCounters, LatencyRecorder, TransportStats
from ..transports.base import DeviceTierTransport, RowScatter
from ..transports.cpu_tier import CpuRowsReply, load_cpu_rows
from ..transports.xoscar.gpu_transfer import check_logical_dtype
from ..wire import CPU_TIER, DEVICE_TIER, LoadRequest, LoadResult

logger = logging.getLogger(__name__)


class HolderLink(Protocol):
    """What a loader calls on a holder's transfer actor."""

    async def transport_call(self, op: str, *args: Any) -> Any: ...

    async def read_cpu_rows(
        self, lease_id: str, keys: list[BlockHash]
    ) -> CpuRowsReply: ...

    async def release(self, lease_id: str) -> None: ...


# (holder address, holder rank) -> the link to that holder
HolderLinks = Callable[[str, int], Awaitable[HolderLink]]


class _CountingHolder:
    """A holder link that counts the calls a load makes on it: each is a round
    trip on that load's critical path (``LoadResult.round_trips``)."""

    def __init__(self, holder: HolderLink, load: _Load) -> None:
        self._holder = holder
        self._load = load

    async def transport_call(self, op: str, *args: Any) -> Any:
        self._load.round_trips += 1
        return await self._holder.transport_call(op, *args)

    async def read_cpu_rows(self, lease_id: str, keys: list[BlockHash]) -> CpuRowsReply:
        self._load.round_trips += 1
        return await self._holder.read_cpu_rows(lease_id, keys)

    async def release(self, lease_id: str) -> None:
        self._load.round_trips += 1
        await self._holder.release(lease_id)


class LoadCancelled(Exception):
    """Raised inside a load when ``cancel`` asked it to stop."""


def row_scatter(
    cache: BlockMajorCache,
    dst_blocks: Sequence[int],
    written: DeviceWorkMark,
    *,
    complete_each_chunk: bool,
    check: Callable[[], None] | None = None,
) -> RowScatter:
    """Scatter of global rows over ``dst_blocks``' keys into the engine cache.

    The destinations are checked and put on the device once, at the first call
    (a transport that places the rows itself never calls it). Each call queues
    the chunk's copies and marks ``written`` after them; with
    ``complete_each_chunk`` (a source whose transport does not guard the buffer
    it hands over, ``DeviceTierTransport.guards_scatter_source``) it also waits
    for them before returning. ``check`` runs first on every chunk and may raise
    to stop the load.
    """
    staged: list[BlockDestinations] = []

    def scatter(first_row: int, rows: torch.Tensor) -> None:
        if check is not None:
            check()
        if not staged:
            staged.append(cache.destinations(dst_blocks))
        cache.scatter_rows(first_row, rows, staged[0])
        written.mark()
        if complete_each_chunk:
            # ``rows`` may be a buffer the next chunk overwrites as soon as we
            # return. A short wait (small copies just queued): it stays on the loop.
            written.wait()

    return scatter


@dataclass(slots=True)
class _Load:
    """A load in progress (mutable, owned by the runner)."""

    request: LoadRequest
    # the copies its scatters queued on the engine cache's device
    written: DeviceWorkMark
    task: asyncio.Task[None] | None = None
    cancel_requested: bool = False
    started: float = field(default_factory=time.perf_counter)
    # calls on the holder before the result was recorded (critical-path round trips)
    round_trips: int = 0
    # its caller stopped waiting and reported its blocks failed (``fence``): no
    # write may land any more, and its result is nobody's
    fenced: bool = False
    # held by each scatter, from its cancel check to the end of its write (a
    # transport may scatter from a worker thread): ``fence`` takes it once
    write_lock: threading.Lock = field(default_factory=threading.Lock)


class LoadRunner:
    """Loads of one replica: started, awaited, cancelled, reported once each."""

    def __init__(
        self,
        rank: int,
        cache: BlockMajorCache,
        transport: DeviceTierTransport,
        holders: HolderLinks,
        *,
        rpc_timeout_s: float,
        counters: ActorCounters,
        latency: LatencyRecorder,
        cpu_tier_counters: TransportStats | None = None,
    ) -> None:
        self._rank = rank
        self._cache = cache
        self._transport = transport
        self._holders = holders
        self._rpc_timeout_s = rpc_timeout_s
        self._counters = counters
        self._latency = latency
        # bytes read from holders' CPU tiers (the device tier's: the transport's)
        self._cpu_tier_counters = cpu_tier_counters or TransportStats()
        # load id -> load in progress
        self._loads: dict[str, _Load] = {}
        # load id -> result not yet collected (by wait or finished)
        self._results: dict[str, LoadResult] = {}
        # engine block id -> id of the load that is writing it
        self._busy_blocks: dict[int, str] = {}
        # lease releases sent after their load's result was recorded
        self._releases: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._loads)

    def tasks(self) -> list[asyncio.Task[None]]:
        """The tasks of the loads in progress and of the lease releases still
        being sent (to drain them at shutdown)."""
        tasks = [load.task for load in self._loads.values() if load.task is not None]
        return tasks + list(self._releases)

    async def start(self, req: LoadRequest) -> None:
        """Start a load; returns at once. A refused request (clear errors, raised
        here) gives its lease back to the holder first."""
        try:
            self._validate(req)
        except BaseException:
            await self._release_on_holder(req)
            raise
        load = _Load(req, DeviceWorkMark(self._cache.device))
        self._loads[req.load_id] = load
        for block_id in req.dst_block_ids:
            self._busy_blocks[block_id] = req.load_id
        self._counters.loads_started += 1
        load.task = asyncio.create_task(self._run(load))

    async def wait(self, load_id: str, timeout: float) -> LoadResult:
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

    async def wait_or_cancel(self, load_id: str, timeout: float) -> LoadResult:
        """Wait for a load to end and collect its result; one still running after
        ``timeout`` is cancelled (its writes end first) and its result, failed,
        collected (the asynchronous path's one call, ``run_load``)."""
        try:
            return await self.wait(load_id, timeout)
        except TimeoutError:
            await self.cancel(load_id)
            return await self.wait(load_id, 0)

    async def wait_bounded(self, load_id: str, wait_s: float) -> LoadResult:
        """Wait at most ``wait_s`` for a load to end and collect its result; past
        that, fence the load (``fence``) and answer that it failed, so the caller
        can report its blocks to vLLM at once (the synchronous path's bound)."""
        load = self._loads.get(load_id)
        if load is not None and load.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(load.task), wait_s)
            except TimeoutError:
                await self.fence(load_id)
                self._counters.loads_past_bound += 1
                return LoadResult(
                    load_id,
                    ok=False,
                    num_blocks=len(load.request.grant.keys),
                    error=f"no result within its bound of {wait_s * 1e3:.1f} ms",
                    round_trips=load.round_trips,
                )
        return self._results.pop(load_id)

    async def fence(self, load_id: str) -> None:
        """From the return of this call on, no write of the load lands in its
        engine blocks, without waiting for its holder; its result is dropped
        (the caller reports the blocks as failed, vLLM recomputes them).

        Every scatter runs on this loop and checks the cancel flag first, so once
        the flag is set and the copies already queued are complete, nothing more
        is written. A READ a transport placed straight in the engine blocks is
        waited for: the transports place one there only where the READ ends
        without the holder's help (``engine_reads_are_bounded``). The load keeps
        its blocks busy (another load into them is refused) and its lease until
        it ends on its own.
        """
        load = self._loads.get(load_id)
        if load is None:
            self._results.pop(load_id, None)  # it ended: nobody collects it
            return
        load.cancel_requested = True
        load.fenced = True
        if self._may_read_into_engine(load):
            assert load.task is not None
            await asyncio.shield(load.task)
            return
        # A scatter in progress (only possible from another thread: this loop is
        # here) ends first; every later one sees the cancel flag and writes nothing.
        if not load.write_lock.acquire(blocking=False):
            await asyncio.to_thread(load.write_lock.acquire)
        load.write_lock.release()
        await settle(load.written)

    def _may_read_into_engine(self, load: _Load) -> bool:
        places = getattr(self._transport, "places_in_engine", None)
        grant = load.request.grant
        if places is None or DEVICE_TIER not in grant.tiers:
            return False
        hint = grant.transport_hint
        if hint is None or not isinstance(hint.shared, tuple) or not hint.shared:
            return True  # cannot tell which peer: assume it may
        return bool(places(hint.shared[0]))

    def finished(self) -> list[LoadResult]:
        """Results of the loads that ended since the last call (each reported once)."""
        results = list(self._results.values())
        self._results.clear()
        return results

    async def cancel(self, load_id: str) -> None:
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

    def _validate(self, req: LoadRequest) -> None:
        layout = self._cache.layout
        if req.load_id in self._loads or req.load_id in self._results:
            raise ValueError(f"load id {req.load_id!r} is already in use")
        if req.grant.lease_free:
            # nothing pins its snapshots, and this path reads no generations
            raise ValueError(f"load {req.load_id!r} is lease-free: not loaded here")
        for key, tier, dtype in zip(
            req.grant.keys, req.grant.tiers, req.grant.logical_dtypes, strict=True
        ):
            if tier not in (DEVICE_TIER, CPU_TIER):
                raise ValueError(f"unknown tier {tier!r} for snapshot {key.hex()}")
            check_logical_dtype(layout.dtype, dtype)
        seen: set[int] = set()
        for block_id in req.dst_block_ids:
            if not 0 <= block_id < layout.num_blocks:
                raise ValueError(
                    f"destination block {block_id} is out of range for "
                    f"{layout.num_blocks} KV cache blocks"
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

    async def _run(self, load: _Load) -> None:
        req = load.request
        error: BaseException | None = None
        try:
            await finish_even_if_cancelled(self._transfer(load))
        except BaseException as exc:  # reported in the result, never swallowed
            error = exc
        try:
            # The scatters may only have queued device work; the engine (another
            # process) must not read these blocks, nor another load write them,
            # before it has completed. (A load the transport placed in the engine
            # blocks itself queued nothing: its READ's completion was the end.)
            await finish_even_if_cancelled(settle(load.written))
        except BaseException as exc:  # a sticky device error: the blocks are suspect
            error = error or exc
        # Every write into our memory has finished here: the transports return only
        # once the holder can no longer write, and the scatters were waited for.
        for block_id in req.dst_block_ids:
            if self._busy_blocks.get(block_id) == req.load_id:
                del self._busy_blocks[block_id]
        del self._loads[req.load_id]
        if isinstance(error, asyncio.CancelledError):
            # the pool is shutting down: no later task would run
            await self._release_on_holder(req)
        result = self._result(load, error)
        if not load.fenced:
            self._results[req.load_id] = result
        if not isinstance(error, asyncio.CancelledError):
            # The result does not wait for the release: nothing of ours depends
            # on it, and the holder's snapshot stays pinned a little longer only.
            release = asyncio.create_task(self._release_on_holder(req))
            self._releases.add(release)
            release.add_done_callback(self._releases.discard)
        if isinstance(error, asyncio.CancelledError):
            raise error  # the actor pool is shutting down; cleanup is done

    def _result(self, load: _Load, error: BaseException | None) -> LoadResult:
        req = load.request
        num_blocks = len(req.grant.keys)
        if error is None:
            self._counters.loads_ok += 1
            self._latency.record(time.perf_counter() - load.started)
            return LoadResult(
                req.load_id,
                ok=True,
                num_blocks=num_blocks,
                round_trips=load.round_trips,
            )
        if isinstance(error, LoadCancelled):
            self._counters.loads_cancelled += 1
        else:
            self._counters.loads_failed += 1
            logger.warning(
                "rank %d: load %s of %d blocks from rank %d failed: %r",
                self._rank,
                req.load_id,
                num_blocks,
                req.grant.holder_rank,
                error,
            )
        return LoadResult(
            req.load_id,
            ok=False,
            num_blocks=num_blocks,
            error=f"{type(error).__name__}: {error}",
            round_trips=load.round_trips,
        )

    async def _transfer(self, load: _Load) -> None:
        req = load.request
        grant = req.grant
        if load.cancel_requested:
            raise LoadCancelled(f"load {req.load_id!r} was cancelled")
        holder = _CountingHolder(
            await self._holders(req.holder_address, grant.holder_rank), load
        )
        # tier -> (positions in the grant, keys, destination blocks)
        by_tier: dict[str, tuple[list[int], list[BlockHash], list[int]]] = {
            DEVICE_TIER: ([], [], []),
            CPU_TIER: ([], [], []),
        }
        for position, (key, tier, block_id) in enumerate(
            zip(grant.keys, grant.tiers, req.dst_block_ids, strict=True)
        ):
            positions, keys, blocks = by_tier[tier]
            positions.append(position)
            keys.append(key)
            blocks.append(block_id)

        parts: list[Awaitable[Any]] = []
        positions, device_keys, device_blocks = by_tier[DEVICE_TIER]
        if device_keys:
            hint = grant.transport_hint
            parts.append(
                self._transport.load(
                    self._holder_call(holder),
                    grant.holder_rank,
                    grant.lease_id,
                    device_keys,
                    self._row_scatter(
                        load,
                        device_blocks,
                        complete_each_chunk=not self._transport.guards_scatter_source,
                    ),
                    hint=None if hint is None else hint.narrowed(positions),
                    dst_block_ids=device_blocks,
                )
            )
        _, cpu_keys, cpu_blocks = by_tier[CPU_TIER]
        if cpu_keys:
            parts.append(
                load_cpu_rows(
                    holder,
                    grant.lease_id,
                    cpu_keys,
                    self._cache.geometry,
                    # each batch arrives in a buffer of its own, never reused
                    # (and on a GPU, scatter_rows copies it to the device before
                    # it returns): nothing to wait for per chunk
                    self._row_scatter(load, cpu_blocks, complete_each_chunk=False),
                    self._rpc_timeout_s,
                    counters=self._cpu_tier_counters,
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

    def _holder_call(self, holder: _CountingHolder) -> Callable[..., Awaitable[Any]]:
        async def call(op: str, *args: Any) -> Any:
            return await with_deadline(
                holder.transport_call(op, *args), self._rpc_timeout_s
            )

        return call

    def _row_scatter(
        self, load: _Load, dst_blocks: Sequence[int], *, complete_each_chunk: bool
    ) -> RowScatter:
        def check() -> None:
            if load.cancel_requested:
                raise LoadCancelled(f"load {load.request.load_id!r} was cancelled")

        scatter = row_scatter(
            self._cache,
            dst_blocks,
            load.written,
            complete_each_chunk=complete_each_chunk,
            check=check,
        )

        def scatter_unless_fenced(first_row: int, rows: torch.Tensor) -> None:
            with load.write_lock:
                scatter(first_row, rows)

        return scatter_unless_fenced

    async def _release_on_holder(self, req: LoadRequest) -> None:
        await release_lease(
            self._rank, self._holders, req, self._rpc_timeout_s, self._counters
        )


async def release_lease(
    rank: int,
    holders: HolderLinks,
    req: LoadRequest,
    rpc_timeout_s: float,
    counters: ActorCounters,
) -> None:
    """Release a load's lease on its holder; a failure is counted and logged, not
    raised, so that it never hides the load's own outcome."""
    try:
        holder = await holders(req.holder_address, req.grant.holder_rank)
        await with_deadline(holder.release(req.grant.lease_id), rpc_timeout_s)
    except Exception as exc:  # the holder may be gone; its lease went with it
        counters.lease_release_failures += 1
        logger.warning(
            "rank %d could not release lease %s on rank %d: %r",
            rank,
            req.grant.lease_id,
            req.grant.holder_rank,
            exc,
        )
