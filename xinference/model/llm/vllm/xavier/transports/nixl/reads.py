"""Posting NIXL READs on one agent and waiting for them, within a deadline.

A READ is posted inline and polled briefly without yielding (a VRAM READ over
cuda_ipc ends within the spin), then with backoff on the event loop; a post that may
do the whole copy inside the call (``cma``, large DRAM reads) goes to a thread. A READ
that misses its deadline is parked as an orphan until it ends: its destination is
handed to ``retire`` (the endpoint swaps in a fresh receive slab) and freed with
``free`` once nothing can write it; loads from that peer are refused meanwhile, so a
stalled peer costs one deadline, not one per load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ...aio import finish_even_if_cancelled
from .plan import ReadPlan
from .wire import NixlTransferError, NixlTransferTimeout

logger = logging.getLogger(__name__)

# Posting a READ performs the whole copy inside the call on some UCX transports (cma
# calls process_vm_readv there: milliseconds for a slab), so a post runs on the
# event loop only when it is surely short; larger ones go to a thread.
# On VRAM a post only queues copies, so there the descriptor count is what matters.
INLINE_POST_MAX_BYTES = 256 * 1024
INLINE_POST_MAX_DESCRIPTORS = 64
# Completion polling: spin on the transfer state right after the post for this long
# (the actor's event loop waits meanwhile; a VRAM READ over cuda_ipc is done within
# it), then yield to the event loop (asyncio.sleep(0)) for YIELD_POLL_S, then
# sleep with exponential backoff. Sub-millisecond sleeps are not worth asking for:
# the selector rounds its timeout up to whole milliseconds.
SPIN_POLL_S = 100e-6
# ... plus the time the READ's bytes take at this rate, so that a large VRAM READ
# (12 MiB: about 40 us over cuda_ipc on an H200, more on a busy host) also ends
# within the spin instead of paying a task and the event loop's turns for it.
SPIN_BYTES_PER_S = 200e9
# ... but never longer than this: the loop serves other loads and stagings too.
SPIN_MAX_S = 1e-3
YIELD_POLL_S = 200e-6
FIRST_POLL_SLEEP_S = 1e-4
MAX_POLL_SLEEP_S = 1e-3

DEST_SLAB = "slab"  # the receive slab: retired, a fresh one takes its place
DEST_ENGINE = "engine"  # engine blocks: the caller must not reuse them
DEST_PROBE = "probe"  # the peer check's scratch row: nothing reads it
DEST_WORDS = "words"  # the generation words' scratch: retired, a fresh one replaces it


@dataclass(slots=True)
class _Orphan:
    """A READ that missed its deadline and has not ended yet."""

    handle: Any
    peer: str
    since: float
    # what it may still write, from ``retire``, kept alive until it ends
    hold: Any


class ReadWaiter:
    """READs of one agent: posted, awaited, and parked when they miss a deadline.

    ``retire(destination)`` is awaited when a READ into ``destination`` misses its
    deadline and returns what the late READ may still write (kept alive until it
    ends, then given to ``free``), or None.
    """

    def __init__(
        self,
        agent: Any,
        nixl_errors: tuple[type[BaseException], ...],
        retire: Callable[[str], Awaitable[Any]],
        free: Callable[[Any], Awaitable[None]],
    ) -> None:
        self._agent = agent
        self._nixl_errors = nixl_errors
        self._retire = retire
        self._free = free
        # remote agent name -> READs from it that missed their deadline, not ended
        self._orphans: dict[str, list[_Orphan]] = {}

    async def read(
        self,
        peer: str,
        plan: ReadPlan,
        *,
        local_mem_type: str,
        remote_mem_type: str,
        timeout_s: float,
        destination: str,
    ) -> None:
        """One NIXL READ of ``plan`` from ``peer`` into ``destination`` (``DEST_*``);
        returns once it is DONE.

        Raises ``NixlTransferError`` if it fails, ``NixlTransferTimeout`` if it is not
        done within ``timeout_s``. A timed-out READ is parked (``retire`` decides
        what happens to its destination); loads from that peer are refused until
        the READ ends. A caller's cancellation waits for the READ to end (or time
        out).
        """
        if self._orphans:
            await self.reap()
        pending = self._orphans.get(peer)
        if pending:
            stalled = time.monotonic() - pending[0].since
            raise NixlTransferError(
                f"a READ from NIXL peer {peer} has not ended for {stalled:.1f} s; "
                "refusing further loads from it until it does"
            )
        if plan.descriptors == 0:
            return
        agent = self._agent
        handle = self._prepare(peer, plan, local_mem_type, remote_mem_type)
        started = time.monotonic()
        if not _post_inline(plan, local_mem_type):
            # A long post (a DRAM copy inside the call) in a thread; then wait.
            await finish_even_if_cancelled(
                self._wait(handle, None, peer, plan, started, timeout_s, destination)
            )
            return
        # The common case finishes here without yielding to the event loop: post,
        # then spin briefly (a VRAM READ over cuda_ipc takes about 20 us).
        try:
            state = self._spin(handle, agent.transfer(handle), plan.nbytes)
        except self._nixl_errors as exc:
            self._release(handle)
            raise self._failure(peer, plan, started, exc) from exc
        if state == "PROC":
            # Still in flight: it must end (or be parked) even if we are cancelled.
            await finish_even_if_cancelled(
                self._wait(handle, state, peer, plan, started, timeout_s, destination)
            )
            return
        self._end(handle, state, peer, plan)

    def _end(self, handle: Any, state: str, peer: str, plan: ReadPlan) -> None:
        """Release a READ that has ended; raise unless it succeeded."""
        self._release(handle)
        if state != "DONE":
            raise NixlTransferError(
                f"NIXL READ of {plan.nbytes} bytes from {peer} ended in state {state}"
            )

    def _prepare(
        self, peer: str, plan: ReadPlan, local_mem_type: str, remote_mem_type: str
    ) -> Any:
        agent = self._agent
        try:
            rows = plan.rows
            if rows is not None:
                return agent.make_prepped_xfer(
                    "READ", rows.local_list, rows.local, rows.remote_list, rows.remote
                )
            return agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(plan.local, mem_type=local_mem_type),
                agent.get_xfer_descs(plan.remote, mem_type=remote_mem_type),
                peer,
            )
        except self._nixl_errors as exc:
            raise NixlTransferError(
                f"NIXL refused a READ of {plan.nbytes} bytes in {plan.descriptors} "
                f"descriptors from {peer}: {exc!r}"
            ) from exc

    def _failure(
        self, peer: str, plan: ReadPlan, started: float, exc: BaseException
    ) -> NixlTransferError:
        return NixlTransferError(
            f"NIXL READ of {plan.nbytes} bytes from {peer} failed after "
            f"{time.monotonic() - started:.3f} s: {exc!r}"
        )

    async def _wait(
        self,
        handle: Any,
        state: str | None,
        peer: str,
        plan: ReadPlan,
        started: float,
        timeout_s: float,
        destination: str,
    ) -> None:
        """Poll a READ to its end or its deadline; release or park it. ``state``
        None: post it first, in a thread (the post may do the whole copy)."""
        try:
            posted: str = (
                state
                if state is not None
                else await asyncio.to_thread(self._agent.transfer, handle)
            )
            state = await self._poll(handle, posted, started + timeout_s)
        except self._nixl_errors as exc:
            self._release(handle)
            raise self._failure(peer, plan, started, exc) from exc
        if state == "PROC":
            await self._park(handle, peer, started, destination)
            at_risk = destination == DEST_ENGINE
            raise NixlTransferTimeout(
                f"NIXL READ of {plan.nbytes} bytes from {peer} did not complete "
                f"within {timeout_s} s"
                + ("; its destination blocks may still be written" if at_risk else ""),
                destination_at_risk=at_risk,
            )
        self._end(handle, state, peer, plan)

    def _spin(self, handle: Any, state: str, nbytes: int) -> str:
        """Check a just-posted READ of ``nbytes`` without yielding, for up to
        ``SPIN_POLL_S`` plus the bytes' time at ``SPIN_BYTES_PER_S``, at most
        ``SPIN_MAX_S``."""
        spin = min(SPIN_POLL_S + nbytes / SPIN_BYTES_PER_S, SPIN_MAX_S)
        until = time.perf_counter() + spin
        while state == "PROC" and time.perf_counter() < until:
            state = self._agent.check_xfer_state(handle)
        return state

    async def _poll(self, handle: Any, state: str, deadline: float) -> str:
        """Poll until the transfer leaves PROC or the deadline passes."""
        agent = self._agent
        started = time.monotonic()
        delay = FIRST_POLL_SLEEP_S
        while state == "PROC":
            now = time.monotonic()
            if now >= deadline:
                return state
            if now - started < YIELD_POLL_S:
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(min(delay, max(deadline - now, 0.0)))
                delay = min(delay * 2, MAX_POLL_SLEEP_S)
            state = agent.check_xfer_state(handle)
        return state

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except self._nixl_errors as exc:  # NIXL keeps it and frees it with the agent
            logger.warning("could not release a NIXL transfer handle: %r", exc)

    async def _park(
        self, handle: Any, peer: str, started: float, destination: str
    ) -> None:
        hold = await self._retire(destination)
        self._orphans.setdefault(peer, []).append(_Orphan(handle, peer, started, hold))
        consequence = {
            DEST_SLAB: "the receive slab was retired until it ends",
            DEST_ENGINE: "its destination engine blocks may still be written",
            DEST_PROBE: "loads from it are refused until it ends",
            DEST_WORDS: "the generation words' scratch was retired until it ends",
        }[destination]
        logger.warning("NIXL READ from %s missed its deadline; %s", peer, consequence)

    async def reap(self) -> None:
        """Release READs that missed their deadline and have ended since."""
        ended: list[_Orphan] = []
        # No await until the bookkeeping is done, so concurrent callers never see
        # (and release) the same orphan twice.
        for peer, orphans in list(self._orphans.items()):
            alive = []
            for orphan in orphans:
                try:
                    state = self._agent.check_xfer_state(orphan.handle)
                except self._nixl_errors:
                    state = "ERR"
                if state == "PROC":
                    alive.append(orphan)
                    continue
                self._release(orphan.handle)
                ended.append(orphan)
                logger.info(
                    "NIXL READ from %s ended (%s) %.1f s after it started",
                    peer,
                    state,
                    time.monotonic() - orphan.since,
                )
            if alive:
                self._orphans[peer] = alive
            else:
                del self._orphans[peer]
        for orphan in ended:
            if orphan.hold is not None:
                # e.g. a retired slab: nothing can write it any more
                await self._free(orphan.hold)

    def pending_count(self) -> int:
        """READs that missed their deadline and have not ended (as of the last
        ``reap``)."""
        return sum(len(o) for o in self._orphans.values())

    def has_pending(self, peer: str) -> bool:
        return bool(self._orphans.get(peer))

    def holds(self) -> list[Any]:
        """What the pending READs may still write (to keep alive at shutdown)."""
        return [o.hold for orphans in self._orphans.values() for o in orphans]


def _post_inline(plan: ReadPlan, local_mem_type: str) -> bool:
    if plan.descriptors > INLINE_POST_MAX_DESCRIPTORS:
        return False
    return local_mem_type == "VRAM" or plan.nbytes <= INLINE_POST_MAX_BYTES
