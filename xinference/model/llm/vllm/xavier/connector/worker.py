"""The worker half of the Xavier connector: the engine's KV cache meets the transfer actor.

It runs in vLLM's worker process, next to the KV cache, and is called synchronously
by the model runner once per step. It

- maps the engine's KV cache tensors into this replica's transfer actor, once
  (``_ensure_gpu_cache_mapping``; CPU: shared memory in place, CUDA: IPC);
- starts the loads the scheduler half decided; a synchronous load is waited for
  before the forward (the CPU runner zeroes new blocks just before, so writes must
  land after that and before attention); an asynchronous one is posted to the
  background loop without waiting, and its completion pushed back
  (``load_completions.py``);
- after the forward, copies the blocks that became full (prompt or generated) into
  its staging ring, with copies queued on the engine's stream so nothing the engine
  writes next can overtake them, and hands the ring slots to the actor, which
  snapshots and publishes them in the background; it never waits for the actor,
  and skips (and counts) blocks that find no free slot (``write_behind.py``);
- reports finished loads (aborted requests included, once their in-flight writes
  are over) and the blocks whose load failed, so vLLM recomputes them (the
  bookkeeping: ``load_outcomes.py``).

Every call into the actor carries a deadline. A failure to load is reported as data
(failed block ids); a failure to stage only costs a future hit and is logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..aio import BackgroundLoop, with_deadline
from ..config import format_size
from ..engine import device
from ..engine.blocks import BlockMajorCache
from ..engine.layout import detect_layout
from ..wire import ConnectorTotals, LoadResult, ReplicaIdentity
from .direct_reads import DirectReads, DirectReadsFactory, run_lease_free
from .load_completions import EndedLoads, InFlightLoad, PostedLoads, cancel_quietly
from .load_outcomes import LoadOutcomes
from .staging_ring import StagingRing, staging_ring_slots
from .stale_loads import StaleLoad
from .step import RequestLoad, StepMetadata
from .write_behind import StagingCounts, WriteBehind

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What the worker half needs, validated by the facade."""

    model: str  # model identity compared between replicas
    num_blocks: int  # engine KV blocks per layer
    block_size: int
    load_async: bool
    rpc_timeout_s: float  # one actor call
    load_timeout_s: float  # one whole load, from start to finished
    map_timeout_s: float = 120.0  # mapping builds the store: slower than an RPC
    map_retry_s: float = 1.0  # pause between mapping attempts before the actor exists
    layout_hint: str | None = None
    # Bytes of the staging ring asked for (rounded down to whole blocks); 0: no
    # ring, and nothing is staged (the engine never waits for a copy); None:
    # sized by staging_ring_slots.
    staging_ring_bytes: int | None = None
    step_tokens: int = 0  # vLLM's max_num_batched_tokens, for a ring sized by itself
    # the transfer actor's device budget, of which the ring takes part (0: none)
    device_budget_bytes: int = 0


# Beyond a synchronous load's bound (the actor's wait for the data), how long the
# engine waits for the actor's reply before it fences the load itself.
REPLY_ALLOWANCE_S = 0.005


# Returns this replica's transfer actor (an xoscar actor ref, or a test object with
# the same coroutine methods).
ActorFactory = Callable[[], Awaitable[Any]]


class WorkerSide:
    """Per-worker state of the Xavier connector."""

    def __init__(
        self,
        settings: WorkerSettings,
        loop: BackgroundLoop,
        actor_factory: ActorFactory,
        direct_reads: DirectReadsFactory | None = None,
    ) -> None:
        self._settings = settings
        # lease-free synchronous loads, READ from this process (direct_reads.py)
        self._direct_reads_factory = direct_reads
        self._direct: DirectReads | None = None
        self._loop = loop
        self._actor_factory = actor_factory
        self._actor: Any = None
        # layer tensors in model layer order (row `layer` of a snapshot)
        self._kv_caches: list[torch.Tensor] = []
        self._handles: device.SharedTensorHandles | None = None
        self._identity: ReplicaIdentity | None = None
        self._identity_reported = False
        self._map_lock: asyncio.Lock | None = None  # created on the loop
        self._map_attempt: concurrent.futures.Future[None] | None = None
        self._last_map_attempt = float("-inf")
        self._map_failures = 0
        self._closed = False
        # loads in flight, and what became of those that ended, until reported
        self._loads = LoadOutcomes()
        self._posted = PostedLoads(
            loop, settings.rpc_timeout_s, settings.load_timeout_s
        )
        self._ring_handles: device.SharedTensorHandles | None = None
        # the ring and what is in it, until the actor has taken it (set with the
        # ring by register_kv_caches)
        self._write_behind = WriteBehind(None, loop, settings.rpc_timeout_s)

    # ---- mapping ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Take the engine's per-layer caches (in layer order) and share them.

        The export runs here, synchronously, because on CPU it moves the cache into
        shared memory in place: that must not race with a forward writing the cache.
        The mapping itself needs the transfer actor, which the launcher may create
        only after every replica's engine is up, so it is tried in the background
        now and again at later steps until it succeeds.
        """
        if not kv_caches:
            raise ValueError("the engine registered no KV cache tensors")
        self._kv_caches = list(kv_caches)
        self._handles = device.export_tensors(self._kv_caches)
        self._make_staging_ring()
        if self._direct_reads_factory is not None:
            self._direct = self._direct_reads_factory(self._kv_caches)
        self._try_mapping()

    def _make_staging_ring(self) -> None:
        """Allocate and share the staging ring; without one (a zero budget, or an
        engine cache this half cannot address) nothing is staged."""
        settings = self._settings
        try:
            layout = detect_layout(
                self._kv_caches, settings.num_blocks, settings.layout_hint
            )
            cache = BlockMajorCache(self._kv_caches, layout)
            num_slots = staging_ring_slots(
                requested=settings.staging_ring_bytes,
                block_nbytes=cache.geometry.block_nbytes,
                step_tokens=settings.step_tokens,
                block_size=settings.block_size,
                device_budget_bytes=settings.device_budget_bytes,
            )
            if num_slots == 0:
                return
            ring = StagingRing(cache, num_slots)
            self._ring_handles = device.export_tensors([ring.rows])
        except Exception as exc:
            logger.warning(
                "Xavier: no staging ring (%r); this replica will publish nothing",
                exc,
            )
            return
        self._write_behind = WriteBehind(ring, self._loop, self._settings.rpc_timeout_s)
        logger.info(
            "Xavier: staging ring of %d blocks (%s)",
            num_slots,
            format_size(ring.rows.numel()),
        )

    def _try_mapping(self) -> None:
        """Start one background mapping attempt unless mapped, running or too soon."""
        if self._identity is not None or self._closed or not self._kv_caches:
            return
        attempt = self._map_attempt
        if attempt is not None and not attempt.done():
            return
        if time.monotonic() - self._last_map_attempt < self._settings.map_retry_s:
            return
        self._last_map_attempt = time.monotonic()
        self._map_attempt = self._loop.submit(
            with_deadline(self._map_in_background(), self._settings.map_timeout_s)
        )

    async def _map_in_background(self) -> None:
        try:
            await self._ensure_gpu_cache_mapping()
        except Exception as exc:  # retried at a later step; see _try_mapping
            self._map_failures += 1
            if self._map_failures in (1, 10) or self._map_failures % 100 == 0:
                # type and str, not repr: an error raised in the actor arrives
                # as xoscar's wrapper, whose repr drops the message
                logger.warning(
                    "Xavier: transfer actor not ready yet (attempt %d, retrying "
                    "every %.1f s): %s: %s",
                    self._map_failures,
                    self._settings.map_retry_s,
                    type(exc).__name__,
                    exc,
                )

    def wait_mapped(self, timeout: float) -> ReplicaIdentity:
        """Block until the caches are mapped (tests and tools)."""
        deadline = time.monotonic() + timeout
        while self._identity is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the engine KV caches were not mapped in time")
            self._try_mapping()
            time.sleep(0.05)
        return self._identity

    async def _ensure_gpu_cache_mapping(self) -> ReplicaIdentity:
        """Map the engine's KV caches into the transfer actor exactly once.

        Concurrent callers are serialised by one ``asyncio.Lock`` and share the first
        caller's result; a failed attempt leaves nothing behind, so the next caller
        tries again; after ``close`` it raises.
        """
        if self._map_lock is None:
            self._map_lock = asyncio.Lock()
        async with self._map_lock:
            if self._closed:
                raise RuntimeError("the Xavier connector is closed; cannot map caches")
            if self._identity is not None:
                return self._identity
            if not self._kv_caches:
                raise RuntimeError("no KV caches registered yet")
            if self._handles is None:
                # Only reached when tests map without register_kv_caches.
                self._handles = await asyncio.to_thread(
                    device.export_tensors, self._kv_caches
                )
            actor = self._actor or await self._actor_factory()
            identity = await actor.map_engine_caches(
                self._handles,
                self._settings.num_blocks,
                self._settings.model,
                self._settings.block_size,
                self._settings.layout_hint,
                staging_ring=self._ring_handles,
            )
            self._actor = actor
            self._identity = identity
            logger.info("Xavier: engine KV cache mapped, %s", identity)
            return identity

    @property
    def identity(self) -> ReplicaIdentity | None:
        return self._identity

    def take_identity_report(self) -> ReplicaIdentity | None:
        """The identity, once, for the scheduler half (through vLLM's worker meta)."""
        if self._identity is None or self._identity_reported:
            return None
        self._identity_reported = True
        return self._identity

    # ---- loads ------------------------------------------------------------------

    def start_load_kv(self, step: StepMetadata) -> None:
        """Start this step's loads; a synchronous load is finished on return."""
        self._try_mapping()
        if self._identity is None or self._actor is None:
            self.fail_step_loads(step)  # nothing started: every load fails
            return
        default = step.load_async
        loads = [item for item in step.loads if item.load is not None]
        for item in step.loads:
            if item.load is None:  # the scheduler could not plan it
                self._loads.fail(
                    item.req_id, item.failed_block_ids, item.is_async(default)
                )
        if not loads:
            return
        for item in loads:
            assert item.load is not None
            self._loads.in_flight[item.load.load_id] = InFlightLoad(
                item.req_id,
                item.load.dst_block_ids,
                not item.is_async(default),
                round_trips=0 if item.load.grant.lease_free else 1,
            )
        # lease-free loads: READ here, no actor call (direct_reads.py)
        outcomes, loads = run_lease_free(self._direct, loads)
        for load_id, error in outcomes.items():
            self._loads.ended(load_id, error)
        for item in loads:
            if item.is_async(default) and item.load is not None:
                # posted, not waited for: its completion is pushed (get_finished)
                self._posted.post(self._actor, item.load)
        synchronous = [i for i in loads if not i.is_async(default)]
        bounded = [i for i in synchronous if i.bound_s is not None]
        if bounded:
            self._load_within_bounds(bounded)
        waited = [i.load for i in synchronous if i.bound_s is None and i.load]
        if waited:
            # Wait before the forward: attention must read the loaded blocks.
            # The actor's own wait gives up at load_timeout_s; this outer deadline
            # only covers an actor that stopped answering.
            self._run_actor(
                self._start_and_wait_all(waited),
                self._settings.load_timeout_s + self._settings.rpc_timeout_s,
            )
            late = [r.load_id for r in waited if r.load_id in self._loads.in_flight]
            if late:
                # Past the deadline: stop them (their writes finish first) and let
                # vLLM recompute the blocks.
                self._run_actor(
                    self._cancel_all(late), self._settings.rpc_timeout_s * 2
                )
                for load_id in late:
                    self._loads.ended(load_id, "no result before the load deadline")

    def _load_within_bounds(self, items: Sequence[RequestLoad]) -> None:
        """The fast path: each load in one call to the actor, which gives up at
        the load's bound and fences its writes off before it answers; this step's
        forward follows. A reply later than the bound (the actor is slow, not the
        holder) is answered by fencing the load here, the one case that can wait
        longer: until the actor confirms no write can land any more."""
        bound_s = max(item.bound_s or 0.0 for item in items)

        async def load_one(item: RequestLoad) -> None:
            assert item.load is not None and item.bound_s is not None
            try:
                result: LoadResult = await self._actor.load_now(item.load, item.bound_s)
            except Exception as exc:
                # It may have started before the call failed: fenced below.
                logger.warning(
                    "Xavier: bounded load %s failed: %r", item.load.load_id, exc
                )
                return
            self._loads.ended(item.load.load_id, result)

        async def load_all() -> None:
            await asyncio.gather(*(load_one(item) for item in items))

        self._run_actor(load_all(), bound_s + REPLY_ALLOWANCE_S)
        late = [
            item.load.load_id
            for item in items
            if item.load is not None and item.load.load_id in self._loads.in_flight
        ]
        if late:
            self._run_actor(self._fence_all(late), self._settings.rpc_timeout_s)
            for load_id in late:
                self._loads.ended(load_id, "no result within the synchronous bound")

    async def _fence_all(self, load_ids: Sequence[str]) -> None:
        async def fence(load_id: str) -> None:
            self._loads.in_flight[load_id].round_trips += 1
            await self._actor.fence_load(load_id)

        await asyncio.gather(*(fence(i) for i in load_ids))

    async def _start_and_wait_all(self, requests: Sequence[Any]) -> None:
        results = await asyncio.gather(
            *(self._actor.start_load(r) for r in requests), return_exceptions=True
        )
        for request, result in zip(requests, results, strict=True):
            if isinstance(result, BaseException):
                self._loads.ended(request.load_id, f"start failed: {result!r}")

        async def wait_one(load_id: str) -> None:
            if load_id not in self._loads.in_flight:
                return  # failed to start, already recorded
            load = self._loads.in_flight[load_id]
            load.round_trips += 1
            try:
                result: LoadResult = await self._actor.wait_load(
                    load_id, self._settings.load_timeout_s
                )
            except Exception as exc:
                # A load we stop waiting for may still be writing: cancel waits
                # for its in-flight writes before the blocks can be reused.
                await self._cancel_quietly(load_id)
                self._loads.ended(load_id, f"wait failed: {exc!r}")
                return
            self._loads.ended(load_id, result)

        await asyncio.gather(*(wait_one(r.load_id) for r in requests))

    async def _cancel_all(self, load_ids: Sequence[str]) -> None:
        await asyncio.gather(*(self._cancel_quietly(i) for i in load_ids))

    async def _cancel_quietly(self, load_id: str) -> None:
        await cancel_quietly(self._actor, load_id, self._settings.rpc_timeout_s)

    def fail_step_loads(self, step: StepMetadata) -> None:
        """Report every load of ``step`` that did not start as failed (after a
        fault in ``start_load_kv``), so vLLM recomputes those blocks. Loads that
        did start stay in flight: their deadlines end them."""
        self._loads.fail_not_started(step)

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        """(finished sends, finished loads) since the last call.

        Xavier never delays freeing a request's blocks for sending, so the first is
        always None. A load of an aborted request is cancelled; the request is
        reported once its writes are over.
        """
        if self._loads.in_flight:
            self._take_completions(finished_req_ids)
        # once a step, whatever else happens: stagings go on as their copies end
        self._write_behind.settle(self._actor)
        # Only asynchronous loads are reported: synchronous ones finished inside
        # start_load_kv, and vLLM does not wait for them here.
        return None, (self._loads.take_finished() or None)

    def _take_completions(self, finished_req_ids: set[str]) -> None:
        """Record the asynchronous loads whose completions were pushed, and post
        cancels for those of aborted requests: no actor call waits here."""
        for done in self._posted.drain():
            if done.load_id in self._loads.in_flight:
                self._loads.in_flight[done.load_id].round_trips = done.round_trips
            self._loads.ended(done.load_id, done.outcome, done.ended_s)
        if self._actor is not None:
            self._posted.cancel_aborted(
                self._actor, self._loads.in_flight, finished_req_ids
            )

    def take_ended_loads(self) -> EndedLoads:
        """Per request whose load ended since the last call: the actor round
        trips on its critical path and the load's own time (counted)."""
        return self._loads.take_ended()

    def take_stale_loads(self) -> dict[str, StaleLoad]:
        """Per request whose lease-free load found stale locations since the
        last call: what the scheduler half must forget (``stale_loads.py``)."""
        return self._loads.take_stale()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._loads.take_errors()

    # ---- staging ----------------------------------------------------------------

    def wait_for_save(self, step: StepMetadata) -> None:
        """Stage the blocks that became full in this step's forward, and publish them.

        Returns once their copies into the staging ring are queued on the engine's
        stream; blocks that find no free ring slot are skipped and counted, never
        waited for (``write_behind.py``).
        """
        self._write_behind.stage(step.stage, self._actor)

    def totals(self) -> ConnectorTotals:
        """What this worker half counted so far (read on the loop's thread: plain
        ints the engine's thread only ever increments)."""
        direct, staging = self._direct, self._write_behind.counts
        return ConnectorTotals(
            direct_reads=0 if direct is None else direct.loads,
            direct_reads_stale=0 if direct is None else direct.stale,
            direct_read_seconds=0.0 if direct is None else direct.seconds,
            direct_read_blocks=0 if direct is None else direct.blocks,
            direct_read_wire_bytes=0 if direct is None else direct.wire_bytes,
            direct_read_useful_bytes=0 if direct is None else direct.useful_bytes,
            staged_blocks=staging.copied,
            stage_skipped_ring_full=staging.skipped_ring_full,
            stage_skipped_no_ring=staging.skipped_no_ring,
            stage_skipped_unmapped=staging.skipped_unmapped,
            ring_slots_retired=staging.ring_slots_retired,
            stagings_failed=staging.stagings_failed,
        )

    @property
    def staging_ring(self) -> StagingRing | None:
        return self._write_behind.ring

    @property
    def staging_counts(self) -> StagingCounts:
        """What became of the blocks this worker was asked to stage (totals)."""
        return self._write_behind.counts

    def wait_for_stagings(self) -> None:
        """Wait until the actor has taken every staging handed to it so far."""
        self._write_behind.drain(self._actor)

    # ---- plumbing ---------------------------------------------------------------

    def _run_actor(self, awaitable: Awaitable[Any], timeout: float) -> None:
        """Run a call to the actor with a deadline; a failure is logged, not raised.

        Loads that the call left unresolved are failed by the caller's bookkeeping
        (they stay in flight and time out), so no error is silently dropped.
        """
        try:
            self._loop.run(awaitable, timeout)
        except Exception as exc:
            logger.error("Xavier: transfer actor call failed: %r", exc)

    def close(self) -> None:
        """Wait for the stagings handed to the actor, cancel loads still running
        (their writes finish first), then refuse work."""
        self.wait_for_stagings()

        async def shut() -> None:
            if self._map_lock is None:
                self._map_lock = asyncio.Lock()
            async with self._map_lock:
                self._closed = True
            if self._actor is not None and self._loads.in_flight:
                await self._cancel_all(list(self._loads.in_flight))
            self._loads.in_flight.clear()
            if self._direct is not None:
                await self._direct.close()

        try:
            self._loop.run(shut(), self._settings.rpc_timeout_s * 2)
        except Exception as exc:
            logger.error("Xavier: worker shutdown did not finish: %r", exc)
