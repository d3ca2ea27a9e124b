"""Lease-free synchronous loads READ by the engine process itself.

The fast path's load through the transfer actor costs a round trip on the hit's
path (``load_now``), on top of the reservation. Here the worker half owns a NIXL
agent (created once its caches are mapped, with no device tier of its own) and
loads a lease-free grant (``lease_free.py``) in this step, with no actor call:

1. the holder's endpoint is loaded ahead, when the worker first sees a load from
   that holder (an asynchronous, leased one: the first load from a peer always
   is, ``SyncLoadPolicy``), through the transfer actor once, off any hit's path;
2. the rows are READ into this agent's receive slab and scattered into the
   destination engine blocks (``NixlDirectTransport.load``, ``row_scatter``);
3. then the slots' generation words are READ back and compared
   (``generation_words.py``); a changed word fails its block and the blocks after
   it, vLLM recomputes them (``stale_loads.py``: the index was stale, the holder
   is not at fault).

The engine thread waits at most the load's bound (``fast_path.py``) plus
``REPLY_ALLOWANCE_S``; past it, the load is fenced: every scatter into engine
blocks runs under the load's lock and checks its flag, so once the engine thread
has set the flag under that lock no write lands any more, and the blocks are
reported failed. READs land only in the receive slab, never in engine blocks: one
that outlives its deadline lands in a retired slab (``endpoint.py``). A load that
cannot run here (no agent, the holder not met yet) fails: vLLM recomputes, and its
holder goes back to leased loads for a while (``SyncLoadPolicy.missed``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..actor.loads import LoadCancelled, row_scatter
from ..aio import BackgroundLoop, with_deadline
from ..engine.blocks import BlockMajorCache
from ..engine.device import DeviceWorkMark
from ..engine.layout import detect_layout
from ..stats import TransportStats
from ..store.generations import mismatches
from ..transports.nixl.generation_words import read_words
from ..transports.nixl.placement import PLACEMENT_SLAB
from ..transports.nixl.transport import NixlDirectTransport
from ..wire import LoadRequest, TransportHint
from .stale_loads import StaleLoad
from .step import RequestLoad

# per load id: None (loaded and verified), the stale blocks, or why it failed
Outcome = str | StaleLoad | None

logger = logging.getLogger(__name__)

# Beyond a load's bound, how long the engine thread waits for the loop's answer
# before it fences the load itself.
REPLY_ALLOWANCE_S = 0.005
# A READ of this agent that outlives this is abandoned (its slab retired): a
# stalled holder keeps the slab from other direct loads at most this long.
TRANSFER_TIMEOUT_S = 0.25

# holder_call(address, rank) -> call(op, *args) on that holder's transport
HolderCalls = Callable[[str, int], Callable[..., Awaitable[Any]]]


@dataclass(slots=True)
class _Fence:
    """Keeps a load's writes out of its engine blocks once the engine gave up."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def close(self) -> None:
        with self.lock:  # a scatter in progress ends first
            self.closed = True


class DirectReads:
    """The worker's own NIXL agent and the lease-free loads it runs."""

    def __init__(
        self,
        loop: BackgroundLoop,
        cache: BlockMajorCache,
        name: str,
        holder_calls: HolderCalls,
        rpc_timeout_s: float,
    ) -> None:
        self._loop = loop
        self._cache = cache
        self._name = name
        self._holder_calls = holder_calls
        self._rpc_timeout_s = rpc_timeout_s
        self._transport: NixlDirectTransport | None = None
        self._starting: concurrent.futures.Future[None] | None = None
        # holder rank -> its endpoint is being loaded, or was (done future)
        self._meeting: dict[int, concurrent.futures.Future[None]] = {}
        # generation words READ back into the agent's words scratch must not
        # overlap (peer checks use another scratch): created on the loop
        self._scratch_lock: asyncio.Lock | None = None
        self.loads = 0
        self.stale = 0  # loads failed because a generation word had changed
        # the loads' own time (their READs, scatters and word checks), summed: with
        # ``loads``, the mean a lease-free load took, which no actor sees
        self.seconds = 0.0
        # the blocks those loads brought the engine and it kept: all of a verified
        # load's, a stale one's before its first stale block
        self.blocks = 0

    # ---- setup (off any hit's path) ---------------------------------------------

    def start(self) -> None:
        """Create the agent in the background (once)."""
        if self._starting is None:
            self._starting = self._loop.submit(self._create())

    async def _create(self) -> None:
        geometry = self._cache.geometry
        try:
            self._transport = await NixlDirectTransport.create(
                f"{self._name}-engine",
                geometry,
                # no tier of its own; the empty rows put the receive slab on the
                # engine's device, so a CUDA holder's rows move VRAM to VRAM
                # (cuda_ipc) instead of through host memory
                torch.empty(
                    (0, geometry.layer_block_nbytes),
                    dtype=torch.uint8,
                    device=self._cache.device,
                ),
                rpc_timeout_s=self._rpc_timeout_s,
                transfer_timeout_s=TRANSFER_TIMEOUT_S,
                placement=PLACEMENT_SLAB,
                reads_peer_words=True,
            )
        except Exception as exc:
            logger.warning(
                "Xavier: no NIXL agent in the engine process (%s: %s); lease-free "
                "loads fail and are recomputed",
                type(exc).__name__,
                exc,
            )
            raise

    def prepare(self, holder_rank: int, holder_address: str) -> None:
        """Load ``holder_rank``'s endpoint in the background, unless done or
        under way (a failed attempt is tried again at the next call)."""
        meeting = self._meeting.get(holder_rank)
        if meeting is not None and not (meeting.done() and meeting.exception()):
            return
        self.start()
        self._meeting[holder_rank] = self._loop.submit(
            self._meet(holder_rank, holder_address)
        )

    async def _meet(self, holder_rank: int, holder_address: str) -> None:
        assert self._starting is not None
        await asyncio.wrap_future(self._starting)
        assert self._transport is not None
        holder = self._holder_call(holder_address, holder_rank)
        await self._transport.meet(holder, holder_rank)

    def ready(self, holder_rank: int) -> bool:
        """Whether a lease-free load from ``holder_rank`` can run here now."""
        meeting = self._meeting.get(holder_rank)
        return (
            meeting is not None
            and meeting.done()
            and meeting.exception() is None
            and self._transport is not None
            and self._transport.known_peer(holder_rank) is not None
        )

    # ---- loads (the engine thread) ------------------------------------------------

    def load_now(
        self, requests: Sequence[LoadRequest], bound_s: float
    ) -> dict[str, Outcome]:
        """Load ``requests`` before this step's forward, within ``bound_s``: per
        load id, None (loaded and verified), its stale blocks, or why its blocks
        must be recomputed.
        Returns with no write of any of them still able to land."""
        outcomes: dict[str, Outcome] = {}
        fences = {req.load_id: _Fence() for req in requests}
        written = DeviceWorkMark(self._cache.device)
        runnable = []
        for req in requests:
            if self.ready(req.grant.holder_rank):
                runnable.append(req)
            else:
                outcomes[req.load_id] = "the engine's NIXL agent has not met the holder"
                self.prepare(req.grant.holder_rank, req.holder_address)
        if runnable:
            future = self._loop.submit(
                self._load_all(runnable, fences, written, outcomes)
            )
            try:
                future.result(bound_s + REPLY_ALLOWANCE_S)
            except (TimeoutError, concurrent.futures.TimeoutError):
                pass
            except Exception as exc:  # outcomes say which loads it left open
                logger.error("Xavier: direct loads failed: %r", exc)
            for req in runnable:
                fences[req.load_id].close()
                if req.load_id not in outcomes:
                    outcomes[req.load_id] = (
                        f"no result within the synchronous bound of "
                        f"{bound_s * 1e3:.1f} ms"
                    )
        written.wait()  # the scatters' device work, before the forward reads it
        return outcomes

    async def _load_all(
        self,
        requests: Sequence[LoadRequest],
        fences: dict[str, _Fence],
        written: DeviceWorkMark,
        outcomes: dict[str, Outcome],
    ) -> None:
        async def one(req: LoadRequest) -> None:
            fence = fences[req.load_id]
            error: Outcome
            try:
                error = await self._load_one(req, fence, written)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            with fence.lock:
                if not fence.closed:  # else the engine thread reported it
                    outcomes[req.load_id] = error
                    if error is None:
                        self.blocks += len(req.grant.keys)
                    elif isinstance(error, StaleLoad):
                        self.blocks += error.first

        await asyncio.gather(*(one(req) for req in requests))

    async def _load_one(
        self, req: LoadRequest, fence: _Fence, written: DeviceWorkMark
    ) -> Outcome:
        started = time.perf_counter()
        transport = self._transport
        grant = req.grant
        peer = None if transport is None else transport.known_peer(grant.holder_rank)
        hint = grant.transport_hint
        if transport is None or peer is None or hint is None or not grant.lease_free:
            return "not a lease-free load this agent can run"
        assert grant.generations is not None

        def stop_if_fenced() -> None:
            if fence.closed:
                raise LoadCancelled(f"load {req.load_id!r} was fenced")

        scatter = row_scatter(
            self._cache,
            req.dst_block_ids,
            written,
            complete_each_chunk=False,
            check=stop_if_fenced,
        )

        def scatter_unless_fenced(first_row: int, rows: torch.Tensor) -> None:
            with fence.lock:
                scatter(first_row, rows)

        await transport.load(
            self._holder_call(req.holder_address, grant.holder_rank),
            grant.holder_rank,
            grant.lease_id,
            grant.keys,
            scatter_unless_fenced,
            hint=TransportHint(peer.epoch, hint.per_key),
        )
        # Only now, with every row landed: a word read earlier could predate
        # a reuse that overwrote the rows during the READ.
        num_layers = self._cache.geometry.num_layers
        slots = [row // num_layers for row in hint.per_key]
        async with self._scratch():
            words = await read_words(
                transport.endpoint, peer, slots, TRANSFER_TIMEOUT_S
            )
        stale = mismatches(grant.generations, words)
        self.loads += 1
        self.seconds += time.perf_counter() - started
        if stale:
            self.stale += 1
            return StaleLoad.of(grant, stale)
        return None

    @property
    def wire_bytes(self) -> int:
        """Bytes this agent's READs brought in (rows; generation words apart)."""
        return self._received().received_wire_bytes

    @property
    def useful_bytes(self) -> int:
        """Of those, the rows' payload the loads asked for."""
        return self._received().received_useful_bytes

    def _received(self) -> TransportStats:
        transport = self._transport
        return TransportStats() if transport is None else transport.stats()

    # ---- plumbing -----------------------------------------------------------------

    def _holder_call(self, address: str, rank: int) -> Callable[..., Awaitable[Any]]:
        call = self._holder_calls(address, rank)

        async def with_timeout(op: str, *args: Any) -> Any:
            return await with_deadline(call(op, *args), self._rpc_timeout_s)

        return with_timeout

    def _scratch(self) -> asyncio.Lock:
        if self._scratch_lock is None:
            self._scratch_lock = asyncio.Lock()
        return self._scratch_lock

    async def close(self) -> None:
        """On the loop: close the agent (waits for READs in progress)."""
        if self._transport is not None:
            await self._transport.close()


# the worker's kv caches -> its DirectReads (None: none in this deployment)
DirectReadsFactory = Callable[[list[torch.Tensor]], DirectReads | None]


def run_lease_free(
    direct: DirectReads | None, items: Sequence[RequestLoad]
) -> tuple[dict[str, Outcome], list[RequestLoad]]:
    """The worker's hook, with this step's planned loads: loads the lease-free
    ones here, within the largest of their bounds (per load id, None or why it
    failed), and returns the others, whose holders it meets meanwhile for later
    lease-free loads. Without an agent every lease-free load fails (vLLM
    recomputes; never the actor's path, which does not check generations)."""
    lease_free = [i for i in items if i.load is not None and i.load.grant.lease_free]
    rest = [i for i in items if i.load is not None and not i.load.grant.lease_free]
    if direct is not None:
        for item in rest:
            assert item.load is not None
            direct.prepare(item.load.grant.holder_rank, item.load.holder_address)
    requests = [item.load for item in lease_free if item.load is not None]
    if not requests:
        return {}, rest
    if direct is None:
        failed: Outcome = "no NIXL agent in the engine process"
        return {r.load_id: failed for r in requests}, rest
    bound_s = max((item.bound_s or 0.0) for item in lease_free)
    return direct.load_now(requests, bound_s), rest


def direct_reads_factory(
    *,
    enabled: bool,
    loop: BackgroundLoop,
    num_blocks: int,
    layout_hint: str | None,
    name: str,
    holder_calls: HolderCalls,
    rpc_timeout_s: float,
) -> DirectReadsFactory | None:
    """What the facade gives the worker: None unless lease-free loads can be
    offered (the fast path on, GPU-first, NIXL between the actors)."""
    if not enabled:
        return None

    def make(kv_caches: list[torch.Tensor]) -> DirectReads | None:
        try:
            layout = detect_layout(kv_caches, num_blocks, layout_hint)
            cache = BlockMajorCache(kv_caches, layout)
        except Exception as exc:
            logger.warning(
                "Xavier: no engine-process reads (%r): lease-free loads fail", exc
            )
            return None
        reads = DirectReads(loop, cache, name, holder_calls, rpc_timeout_s)
        reads.start()
        return reads

    return make
