"""The scheduler half's dealings with peers during a lookup: who holds a prefix,
a lease on the holder's snapshots, letting leases go, and backing off from peers
that fail.

The calls run on the connector's background loop; vLLM's scheduler thread waits
for a holder's grant at most ``reply_wait_s`` (not at all while an earlier
reservation from that holder is still unanswered) and otherwise tells vLLM to ask
again on a later pass. The request, or the scheduler, may then give a reservation
up before its answer comes: ``PendingReservation`` makes exactly one side release
whatever the holder granted, the loop if the scheduler gave up first, else the
scheduler. A failed, refused or late answer is a miss.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ..aio import BackgroundLoop, with_deadline
from ..hashing import BlockHash
from ..tracker_mirror import TrackerMirror
from ..wire import LeaseGrant, PrefixHit, ReplicaIdentity

logger = logging.getLogger(__name__)

# Lease ids of grants made without a reservation (``lease_free.py``)
LEASE_FREE_PREFIX = "lease-free-"
# An incompatible holder stays incompatible until redeployed: ask again rarely.
INCOMPATIBLE_BACKOFF_S = 600.0
# A reservation still unanswered this long past its deadline means the background
# loop itself is stuck (the deadline is enforced there): given up as a failure.
STUCK_LOOP_SLACK_S = 1.0

# Remote calls the scheduler half makes; injectable so tests can run it against
# real actors in a pool or against failing peers.
QueryPrefix = Callable[[int, list[BlockHash]], Awaitable[PrefixHit | None]]
# reserve(holder, keys, lease_id, requester) and release(holder, lease_id)
Reserve = Callable[
    [PrefixHit, list[BlockHash], str, ReplicaIdentity], Awaitable[LeaseGrant]
]
Release = Callable[[PrefixHit, str], Awaitable[None]]


@dataclass(slots=True)
class Reservation:
    """A lease a holder granted, standing until it becomes a load or is let go."""

    grant: LeaseGrant
    holder: PrefixHit  # who granted it (rank and transfer actor address)
    first_block: int  # prompt block index of grant.keys[0]


@dataclass(eq=False)
class PendingReservation:
    """One reservation in flight: whom it asks, for what, and who lets go of it."""

    hit: PrefixHit
    lease_id: str
    wanted: list[BlockHash]
    first_block: int  # the request's prompt block index of wanted[0]
    future: concurrent.futures.Future[LeaseGrant] | None = None
    started: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _abandoned: bool = False
    _answered: bool = False

    def answered(self) -> bool:
        """The loop's side, once the holder answered or its deadline passed:
        whether the scheduler still wants the answer. False: it gave the
        reservation up first, and the loop must release the lease itself."""
        with self._lock:
            self._answered = True
            return not self._abandoned

    def abandon(self) -> bool:
        """The scheduler's side, giving the reservation up: whether the answer
        had come already. True: the loop left the lease to the scheduler, which
        must release it; False: the loop will."""
        with self._lock:
            self._abandoned = True
            return self._answered

    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def may_hold_lease(self) -> bool:
        """Whether an answered reservation may have left a lease on its holder: a
        grant, a deadline after which it may still have granted, or an answer
        not handed over yet. A refusal or a failed call left none."""
        future = self.future
        if future is None:
            return False
        if not future.done():
            return True
        if future.cancelled():
            return False
        error = future.exception()
        return error is None or isinstance(error, TimeoutError)


@dataclass(slots=True)
class _Backoff:
    # peer key ("tracker" or a holder address) -> monotonic time it may be asked again
    until: dict[str, float] = field(default_factory=dict)

    def blocked(self, peer: str) -> bool:
        deadline = self.until.get(peer)
        if deadline is None:
            return False
        if time.monotonic() >= deadline:
            del self.until[peer]
            return False
        return True

    def block(self, peer: str, seconds: float) -> None:
        self.until[peer] = time.monotonic() + seconds


class Reservations:
    """Lookups and leases of one scheduler half (used from vLLM's scheduler
    thread; the calls themselves run on ``loop``). ``stats`` is the scheduler
    half's counter dict, updated in place."""

    def __init__(
        self,
        *,
        rank: int,
        rpc_timeout_s: float,
        backoff_s: float,
        reply_wait_s: float,
        loop: BackgroundLoop,
        query_prefix: QueryPrefix,
        reserve: Reserve,
        release: Release,
        mirror: TrackerMirror | None,
        stats: dict[str, int],
    ) -> None:
        self._rank = rank
        self._rpc_timeout_s = rpc_timeout_s
        self._backoff_s = backoff_s
        self._reply_wait_s = reply_wait_s
        self._loop = loop
        self._query_prefix = query_prefix
        self._reserve = reserve
        self._release = release
        self._mirror = mirror
        self._stats = stats
        self._backoff = _Backoff()
        self._lease_seq = itertools.count()
        self._releases: list[concurrent.futures.Future[None]] = []
        # holder address -> a reservation it left unanswered past reply_wait_s:
        # while that one is still unanswered, later ones do not wait for it
        self._unanswered: dict[str, PendingReservation] = {}

    # ---- asking ---------------------------------------------------------------------

    def start(
        self,
        req_id: str,
        keys: list[BlockHash],
        local_blocks: int,
        identity: ReplicaIdentity,
    ) -> PendingReservation | None:
        """Ask the replica that holds the longest run of ``keys`` from block
        ``local_blocks`` on (the first one the engine lacks) for a lease on it,
        waiting at most ``reply_wait_s`` for its answer; None when nobody holds
        that block (or its holder is backed off from).

        The holder need not hold the blocks before: a key names its block's
        tokens and every token before them (``hashing.py``), so a replica that
        loaded a prefix from a peer and computed the rest serves the rest to
        any replica that has the prefix itself."""
        hit = self._find_holder(keys[local_blocks:])
        if hit is None:
            return None
        if self._backoff.blocked(hit.address):
            return None
        pending = PendingReservation(
            hit,
            f"xavier-{self._rank}-{req_id}-{next(self._lease_seq)}",
            keys[local_blocks : local_blocks + hit.num_blocks],
            local_blocks,
        )
        future = pending.future = self._loop.submit(
            self._reserve_in_loop(pending, identity)
        )
        slow = self._unanswered.get(hit.address)
        if slow is not None and slow.done():
            del self._unanswered[hit.address]
            slow = None
        if slow is None:  # an earlier request found it slow: do not wait again
            concurrent.futures.wait([future], self._reply_wait_s)
            if not future.done():
                self._unanswered[hit.address] = pending
        return pending

    def _find_holder(self, keys: list[BlockHash]) -> PrefixHit | None:
        mirror = self._mirror
        if mirror is not None and mirror.ready:
            self._stats["mirror_lookups"] += 1
            return mirror.query(self._rank, keys)
        if self._backoff.blocked("tracker"):
            return None
        try:
            return self._loop.run(
                self._query_prefix(self._rank, keys), self._rpc_timeout_s
            )
        except Exception as exc:  # any tracker failure is a miss, logged once
            self._peer_failed("tracker", "the block tracker", exc)
            return None

    async def _reserve_in_loop(
        self, pending: PendingReservation, identity: ReplicaIdentity
    ) -> LeaseGrant:
        """The reservation's call on the background loop; it releases the lease
        itself when the scheduler gave the reservation up before the answer."""
        hit, lease_id = pending.hit, pending.lease_id
        try:
            grant = await with_deadline(
                self._reserve(hit, pending.wanted, lease_id, identity),
                self._rpc_timeout_s,
            )
        except TimeoutError:
            # The holder may grant after we stopped waiting: let go of it.
            if not pending.answered():
                await self._release_within_deadline(hit, lease_id)
            raise
        except BaseException:
            pending.answered()  # nothing granted, nothing to release
            raise
        if not pending.answered():
            await self._release_within_deadline(hit, lease_id)
        return grant

    # ---- answers --------------------------------------------------------------------

    def ready(self, pending: PendingReservation) -> bool:
        """Whether ``take`` has an outcome for ``pending``: the holder answered,
        or the reservation is given up (its holder was backed off from meanwhile,
        or the loop is stuck past the deadline). False: ask again later."""
        if pending.done() or self._backoff.blocked(pending.hit.address):
            return True
        waited = time.monotonic() - pending.started
        return waited > self._rpc_timeout_s + STUCK_LOOP_SLACK_S

    def take(self, pending: PendingReservation) -> Reservation | None:
        """The hit a ``ready`` reservation became, or None (a miss, counted; its
        lease, if any, let go)."""
        future = pending.future
        assert future is not None
        hit = pending.hit
        if not future.done():
            if self._backoff.blocked(hit.address):
                # Another reservation from this holder failed meanwhile: a miss
                # now, rather than at this one's own deadline.
                self._stats["misses_peer_error"] += 1
            else:
                self._peer_failed(
                    hit.address,
                    f"replica {hit.rank}",
                    TimeoutError(
                        "the connector's background loop did not finish the call"
                    ),
                )
            self.abandon(pending)
            return None
        error = (
            future.exception()
            if not future.cancelled()
            else RuntimeError("the reservation was cancelled")
        )
        if isinstance(error, ValueError):
            # The holder compared identities and refuses (another model, dtype,
            # layout, block size or protocol): a deployment error, never a reason to
            # load wrong KV. Computing locally is correct; say so loudly, once.
            self._stats["misses_incompatible"] += 1
            self._backoff.block(hit.address, INCOMPATIBLE_BACKOFF_S)
            logger.error(
                "Xavier: replica %d cannot share KV with replica %d: %s; computing "
                "locally and not asking it again for %.0f s",
                hit.rank,
                self._rank,
                error,
                INCOMPATIBLE_BACKOFF_S,
            )
            return None
        if error is not None:  # a holder that fails to answer is a miss
            self._peer_failed(hit.address, f"replica {hit.rank}", error)
            if isinstance(error, TimeoutError):
                # The holder may have granted after we stopped waiting: let go.
                self.release_soon(hit, pending.lease_id)
            return None
        grant = future.result()
        # The holder grants the longest leading run it still has; anything else
        # (an evicted snapshot, a refusal) shortens or empties the grant.
        usable = _leading_match(grant.keys, pending.wanted)
        if usable == 0:
            self._stats["misses_refused"] += 1
            self.release_soon(hit, pending.lease_id)
            return None
        if usable < len(grant.keys):
            grant = grant.truncated(usable)
        self._stats["hits"] += 1
        self._stats["hit_blocks"] += usable
        return Reservation(grant, hit, pending.first_block)

    def _peer_failed(self, peer: str, what: str, exc: BaseException) -> None:
        self._stats["misses_peer_error"] += 1
        self._backoff.block(peer, self._backoff_s)
        logger.warning(
            "Xavier: %s did not answer (%s: %s); computing locally and not asking "
            "it again for %.0f s",
            what,
            type(exc).__name__,
            exc,
            self._backoff_s,
        )

    # ---- letting go -----------------------------------------------------------------

    def abandon(self, pending: PendingReservation) -> None:
        """Give an unanswered (or untaken) reservation up; its lease is released
        by whichever side ``PendingReservation`` says."""
        if pending.abandon() and pending.may_hold_lease():
            self.release_soon(pending.hit, pending.lease_id)

    def release_soon(self, holder: PrefixHit, lease_id: str) -> None:
        """Release a lease without waiting: the scheduler must not stall on it.
        A lease-free grant (``lease_free.py``) pinned nothing: no call."""
        if lease_id.startswith(LEASE_FREE_PREFIX):
            return
        self._releases = [f for f in self._releases if not f.done()]
        self._releases.append(
            self._loop.submit(self._release_within_deadline(holder, lease_id))
        )

    async def _release_within_deadline(self, holder: PrefixHit, lease_id: str) -> None:
        try:
            await with_deadline(self._release(holder, lease_id), self._rpc_timeout_s)
        except Exception as exc:  # the holder's lease expires with it
            logger.warning(
                "Xavier: releasing lease %s on %s failed: %s",
                lease_id,
                holder.address,
                exc,
            )

    def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for the releases sent so far to finish."""
        pending, self._releases = self._releases, []
        concurrent.futures.wait(pending, timeout)


def _leading_match(granted: Sequence[BlockHash], wanted: Sequence[BlockHash]) -> int:
    count = 0
    for got, want in zip(granted, wanted, strict=False):
        if got != want:
            break
        count += 1
    return count
