"""The scheduler half of the Xavier connector: what to load, from whom, into where.

It runs in vLLM's engine-core process and works on plain data handed over by the
facade (``vllm_facade.py``): token ids, counts and block ids, never vLLM objects.
Per request it

1. hashes the prompt's full blocks once (the last prompt token never counts: vLLM
   must compute at least one token to sample the next, so only
   ``prompt[: len - 1]``'s full blocks can come from a peer);
2. looks up the longest prefix another replica holds, beyond the blocks vLLM
   already has locally, in its mirror of the tracker's index (the tracker itself
   while the mirror is not ready), and reserves leases on the holder's snapshots:
   no round trip for a prompt nobody holds, one for a hit. A holder slower than a
   few milliseconds does not hold the scheduler up: vLLM is told to ask again, and
   the answer is taken on a later pass;
3. after vLLM allocated destination blocks, turns the reservation into a load;
4. each step, names the blocks that became full, to stage and publish them: prompt
   blocks, blocks of generated tokens (a later turn of the conversation, on another
   replica, starts with them) and blocks recomputed after a failed load;
5. releases a reservation that never became a load when the request goes away.

A failed, refused or late answer from a peer is a miss: the engine computes the
blocks itself. A holder costs the scheduler at most ``reply_wait_s`` per request
(nothing while an earlier request's reservation from it is still unanswered); the
tracker, asked only while the mirror is not ready, at most one RPC deadline.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..aio import BackgroundLoop, with_deadline
from ..hashing import BlockHash, extend_full_blocks, hash_full_blocks
from ..tracker_mirror import TrackerMirror
from ..wire import LeaseGrant, LoadRequest, PrefixHit, ReplicaIdentity, StageItem
from .pending import PendingReservation
from .step import RequestLoad, ScheduledRequest, StageAfterLoad, StepMetadata

logger = logging.getLogger(__name__)


# An incompatible holder stays incompatible until redeployed: ask again rarely.
INCOMPATIBLE_BACKOFF_S = 600.0
# A reservation still unanswered this long past its deadline means the background
# loop itself is stuck (the deadline is enforced there): given up as a failure.
STUCK_LOOP_SLACK_S = 1.0


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """What the scheduler half needs, validated by the facade."""

    rank: int
    namespace: str  # hash namespace: identical on every replica of one model
    block_size: int
    load_async: bool  # True when a device budget is configured (GPU-first)
    rpc_timeout_s: float
    # A holder (or the tracker) that failed is not asked again for this long.
    backoff_s: float = 30.0
    # How long the scheduler thread waits for a holder to grant a reservation
    # before it tells vLLM to ask again on a later pass. A holder answers within a
    # millisecond or two (then the load is planned in this very pass); a stopped
    # one must not hold up every other request of the replica.
    reply_wait_s: float = 0.005


@dataclass(slots=True)
class _Reservation:
    grant: LeaseGrant
    holder: PrefixHit  # who granted it (rank and transfer actor address)
    first_block: int  # prompt block index of grant.keys[0]


@dataclass(slots=True)
class _RequestState:
    # The request's tokens, prompt first: a read-only view that vLLM extends with
    # each generated token (or a copy of the prompt when none was handed over).
    tokens: Sequence[int]
    num_prompt_tokens: int
    # Chain hashes of the full blocks of ``tokens`` hashed so far (the prompt's
    # from the start, generated blocks as they fill): keys[i] names exactly the
    # tokens of block i and everything before it.
    keys: list[BlockHash]
    staged_upto: int = 0  # blocks [0, staged_upto) need no staging here
    reservation: _Reservation | None = None
    # asked of a holder, not answered yet (vLLM was told to ask again)
    pending: PendingReservation | None = None
    holder_rank: int | None = None
    loaded_into: tuple[int, ...] = ()  # the engine blocks its load writes
    # The load planned for the request, started or not: its first block position
    # and the engine blocks from there (None: no destination). A failed one is
    # recomputed by vLLM from its first failed block, which is staged again.
    load_first: int = 0
    load_blocks: tuple[int | None, ...] = ()
    # group 0's block table, position -> block id, rebuilt from each step's
    # scheduler output; None until vLLM has sent the whole table once
    block_ids: list[int] | None = None
    # A load was planned (or failed to be): the request never gets a second one,
    # so a load that keeps failing cannot make vLLM retry it forever.
    load_attempted: bool = False


# Remote calls the scheduler half makes; injectable so tests can run it against
# real actors in a pool or against failing peers.
QueryPrefix = Callable[[int, list[BlockHash]], Awaitable[PrefixHit | None]]
# reserve(holder, keys, lease_id, requester) and release(holder, lease_id)
Reserve = Callable[
    [PrefixHit, list[BlockHash], str, ReplicaIdentity], Awaitable[LeaseGrant]
]
Release = Callable[[PrefixHit, str], Awaitable[None]]


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


class SchedulerSide:
    """Per-engine scheduler state of the Xavier connector (single-threaded use)."""

    def __init__(
        self,
        settings: SchedulerSettings,
        loop: BackgroundLoop,
        query_prefix: QueryPrefix,
        reserve: Reserve,
        release: Release,
        mirror: TrackerMirror | None = None,
    ) -> None:
        self._settings = settings
        self._mirror = mirror
        self._loop = loop
        self._query_prefix = query_prefix
        self._reserve = reserve
        self._release = release
        self._identity: ReplicaIdentity | None = None
        # req_id -> per-request state, from the first lookup to request_finished
        self._requests: dict[str, _RequestState] = {}
        # loads decided since the last step was built
        self._new_loads: list[RequestLoad] = []
        self._backoff = _Backoff()
        self._lease_seq = itertools.count()
        self._releases: list[concurrent.futures.Future[None]] = []
        # holder address -> a reservation it left unanswered past reply_wait_s:
        # while that one is still unanswered, later ones do not wait for it
        self._unanswered: dict[str, PendingReservation] = {}
        # counters for logs and tests
        self.stats: dict[str, int] = {
            "lookups": 0,
            "mirror_lookups": 0,
            "hits": 0,
            "hit_blocks": 0,
            "deferred": 0,  # lookups answered "ask again": the holder was slow
            "misses_refused": 0,
            "misses_peer_error": 0,
            "misses_incompatible": 0,
            "loads_failed": 0,
            "staged_blocks": 0,
        }

    @property
    def identity(self) -> ReplicaIdentity | None:
        return self._identity

    def set_identity(self, identity: ReplicaIdentity) -> None:
        """This replica's identity, known once the worker mapped its caches."""
        if self._identity is None:
            logger.info("Xavier replica %d ready: %s", self._settings.rank, identity)
        self._identity = identity

    # ---- lookup and reservation -------------------------------------------------

    def num_new_matched_tokens(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        num_computed_tokens: int,
        allow_remote: bool = True,
        all_token_ids: Sequence[int] | None = None,
    ) -> tuple[int | None, bool]:
        """Tokens a peer can supply beyond ``num_computed_tokens``, and whether async.

        ``all_token_ids`` is the request's live token sequence (the prompt, then
        every generated token as vLLM appends it); with it, blocks of generated
        tokens are staged too. It is read, never modified, and only up to the
        tokens whose KV a step computed.

        vLLM may ask again for the same request (when it could not schedule it): a
        standing reservation that still fits is reused, otherwise it is released
        before a new one is made. ``allow_remote=False`` (the request must not read
        cached prefixes) only records the prompt, so its blocks are still staged.
        A request gets at most one load: once one was planned, whatever became of
        it, later questions are answered with 0 (vLLM asks again after a failed
        load; a fault that repeats must not make it retry forever). ``(None,
        False)`` means a holder was asked and has not answered within
        ``reply_wait_s``: vLLM skips the request for this pass and asks again.
        """
        state = self._state_for(req_id, prompt_token_ids, all_token_ids)
        block_size = self._settings.block_size
        local_blocks = num_computed_tokens // block_size
        # Only the prompt minus its last token can be supplied.
        lookup_blocks = (state.num_prompt_tokens - 1) // block_size
        state.staged_upto = max(state.staged_upto, local_blocks)
        if (
            lookup_blocks <= local_blocks
            or self._identity is None
            or not allow_remote
            or state.load_attempted
        ):
            self._drop_reservation(state)
            return 0, False

        standing = state.reservation
        if standing is not None:
            if standing.first_block == local_blocks:
                return self._answer(standing)
            self._drop_reservation(state)
        pending = state.pending
        if pending is not None:
            if pending.first_block == local_blocks:
                return self._settle(state, pending)
            self._drop_reservation(state)

        self.stats["lookups"] += 1
        pending = self._start_reservation(
            req_id, state.keys[:lookup_blocks], local_blocks
        )
        if pending is None:
            return 0, False
        state.pending = pending
        answer = self._settle(state, pending)
        if answer[0] is None:
            self.stats["deferred"] += 1
        return answer

    def _answer(self, reservation: _Reservation) -> tuple[int, bool]:
        tokens = len(reservation.grant.keys) * self._settings.block_size
        return tokens, self._settings.load_async

    def _start_reservation(
        self, req_id: str, keys: list[BlockHash], local_blocks: int
    ) -> PendingReservation | None:
        """Ask the holder of the longest prefix for a lease on the blocks beyond
        ``local_blocks``, waiting at most ``reply_wait_s`` for its answer; None
        when nobody holds more (or the holder is backed off from)."""
        settings = self._settings
        hit = self._find_holder(keys)
        if hit is None or hit.num_blocks <= local_blocks:
            return None
        if self._backoff.blocked(hit.address):
            return None
        assert self._identity is not None
        pending = PendingReservation(
            hit,
            f"xavier-{settings.rank}-{req_id}-{next(self._lease_seq)}",
            keys[local_blocks : hit.num_blocks],
            local_blocks,
        )
        future = pending.future = self._loop.submit(
            self._reserve_in_loop(pending, self._identity)
        )
        slow = self._unanswered.get(hit.address)
        if slow is not None and slow.done():
            del self._unanswered[hit.address]
            slow = None
        if slow is None:  # an earlier request found it slow: do not wait again
            concurrent.futures.wait([future], settings.reply_wait_s)
            if not future.done():
                self._unanswered[hit.address] = pending
        return pending

    async def _reserve_in_loop(
        self, pending: PendingReservation, identity: ReplicaIdentity
    ) -> LeaseGrant:
        """The reservation's call on the background loop; it releases the lease
        itself when the scheduler gave the reservation up before the answer."""
        hit, lease_id = pending.hit, pending.lease_id
        try:
            grant = await with_deadline(
                self._reserve(hit, pending.wanted, lease_id, identity),
                self._settings.rpc_timeout_s,
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

    def _settle(
        self, state: _RequestState, pending: PendingReservation
    ) -> tuple[int | None, bool]:
        """What to tell vLLM about ``pending``: ask again while it is unanswered,
        else the hit it became (standing in ``state.reservation``) or a miss."""
        future = pending.future
        assert future is not None
        if not future.done():
            if self._backoff.blocked(pending.hit.address):
                # Another reservation from this holder failed meanwhile: a miss
                # now, rather than at this one's own deadline.
                self._drop_reservation(state)
                self.stats["misses_peer_error"] += 1
                return 0, False
            waited = time.monotonic() - pending.started
            if waited <= self._settings.rpc_timeout_s + STUCK_LOOP_SLACK_S:
                return None, False
            self._drop_reservation(state)
            self._peer_failed(
                pending.hit.address,
                f"replica {pending.hit.rank}",
                TimeoutError("the connector's background loop did not finish the call"),
            )
            return 0, False
        state.pending = None
        hit = pending.hit
        error = (
            future.exception()
            if not future.cancelled()
            else RuntimeError("the reservation was cancelled")
        )
        if isinstance(error, ValueError):
            # The holder compared identities and refuses (another model, dtype,
            # layout, block size or protocol): a deployment error, never a reason to
            # load wrong KV. Computing locally is correct; say so loudly, once.
            self.stats["misses_incompatible"] += 1
            self._backoff.block(hit.address, INCOMPATIBLE_BACKOFF_S)
            logger.error(
                "Xavier: replica %d cannot share KV with replica %d: %s; computing "
                "locally and not asking it again for %.0f s",
                hit.rank,
                self._settings.rank,
                error,
                INCOMPATIBLE_BACKOFF_S,
            )
            return 0, False
        if error is not None:  # a holder that fails to answer is a miss
            self._peer_failed(hit.address, f"replica {hit.rank}", error)
            if isinstance(error, TimeoutError):
                # The holder may have granted after we stopped waiting: let go.
                self._release_soon(hit, pending.lease_id)
            return 0, False
        reservation = self._accept(pending, future.result())
        if reservation is None:
            return 0, False
        state.reservation = reservation
        return self._answer(reservation)

    def _accept(
        self, pending: PendingReservation, grant: LeaseGrant
    ) -> _Reservation | None:
        # The holder grants the longest leading run it still has; anything else
        # (an evicted snapshot, a refusal) shortens or empties the grant.
        usable = _leading_match(grant.keys, pending.wanted)
        if usable == 0:
            self.stats["misses_refused"] += 1
            self._release_soon(pending.hit, pending.lease_id)
            return None
        if usable < len(grant.keys):
            grant = grant.truncated(usable)
        self.stats["hits"] += 1
        self.stats["hit_blocks"] += usable
        return _Reservation(grant, pending.hit, pending.first_block)

    def _find_holder(self, keys: list[BlockHash]) -> PrefixHit | None:
        mirror = self._mirror
        if mirror is not None and mirror.ready:
            self.stats["mirror_lookups"] += 1
            return mirror.query(self._settings.rank, keys)
        if self._backoff.blocked("tracker"):
            return None
        try:
            return self._loop.run(
                self._query_prefix(self._settings.rank, keys),
                self._settings.rpc_timeout_s,
            )
        except Exception as exc:  # any tracker failure is a miss, logged once
            self._peer_failed("tracker", "the block tracker", exc)
            return None

    def _peer_failed(self, peer: str, what: str, exc: BaseException) -> None:
        self.stats["misses_peer_error"] += 1
        self._backoff.block(peer, self._settings.backoff_s)
        logger.warning(
            "Xavier: %s did not answer (%s: %s); computing locally and not asking "
            "it again for %.0f s",
            what,
            type(exc).__name__,
            exc,
            self._settings.backoff_s,
        )

    # ---- allocation -> load -----------------------------------------------------

    def on_allocated(
        self,
        req_id: str,
        block_ids: Sequence[Sequence[int | None]],
        num_external_tokens: int,
    ) -> None:
        """vLLM allocated blocks for ``req_id``; ``block_ids`` per cache group.

        With ``num_external_tokens == 0`` nothing is loaded: a standing reservation
        (vLLM preferred its local hit, or this is the second call after an async
        load) is released.
        """
        state = self._requests.get(req_id)
        if state is None:
            return
        reservation = state.reservation
        if num_external_tokens == 0 or reservation is None:
            self._drop_reservation(state)
            return
        state.reservation = None
        state.load_attempted = True
        block_size = self._settings.block_size
        num_blocks = num_external_tokens // block_size
        if num_external_tokens % block_size or not (
            0 < num_blocks <= len(reservation.grant.keys)
        ):
            raise AssertionError(
                f"vLLM asked for {num_external_tokens} external tokens of request "
                f"{req_id}, but {len(reservation.grant.keys)} blocks of "
                f"{block_size} tokens were offered"
            )
        grant = reservation.grant.truncated(num_blocks)
        first = reservation.first_block
        group = block_ids[0] if block_ids else ()
        destinations = list(group[first : first + num_blocks])
        state.load_first, state.load_blocks = first, tuple(destinations)
        if len(destinations) != num_blocks or any(b is None for b in destinations):
            # vLLM counts these tokens as external already: the worker reports the
            # real destinations as failed so vLLM recomputes them.
            logger.error(
                "Xavier: request %s has no destination for every loaded block "
                "(%s); recomputing",
                req_id,
                destinations,
            )
            self._release_soon(reservation.holder, grant.lease_id)
            failed = tuple(b for b in destinations if b is not None)
            self._new_loads.append(RequestLoad(req_id, None, failed))
            return
        load = LoadRequest(
            load_id=grant.lease_id,
            grant=grant,
            holder_address=reservation.holder.address,
            dst_block_ids=tuple(int(b) for b in destinations if b is not None),
        )
        # From here on the lease belongs to the load: the transfer actor releases
        # it when the load ends (or is cancelled), never while writes are running.
        self._new_loads.append(RequestLoad(req_id, load))
        state.loaded_into = load.dst_block_ids
        state.holder_rank = grant.holder_rank
        state.staged_upto = max(state.staged_upto, first + num_blocks)

    # ---- recovery from a fault in the connector ---------------------------------

    def drop_reservation(self, req_id: str) -> None:
        """Let go of ``req_id``'s standing reservation, if any (the lookup that
        made it failed afterwards, so vLLM was told there is nothing to load)."""
        state = self._requests.get(req_id)
        if state is not None:
            self._drop_reservation(state)

    def abandon_load(self, req_id: str, block_ids: Sequence[int | None]) -> None:
        """Turning ``req_id``'s reservation into a load failed after vLLM had
        counted external tokens: release the reservation and have the worker
        report ``block_ids`` (the request's blocks) as failed, so vLLM recomputes
        them and stops waiting for an asynchronous load."""
        self.drop_reservation(req_id)
        state = self._requests.get(req_id)
        if state is not None:
            state.load_attempted = True
            state.load_first, state.load_blocks = 0, tuple(block_ids)
        self._new_loads = [item for item in self._new_loads if item.req_id != req_id]
        failed = tuple(b for b in block_ids if b is not None)
        self._new_loads.append(RequestLoad(req_id, None, failed))

    def loads_failed(self, block_ids: set[int]) -> None:
        """The worker reported ``block_ids`` as not loaded (vLLM recomputes them):
        a request whose load wrote any of them did not get its blocks from a peer,
        and computes them itself from the first failed one on, so those blocks
        are staged again as they fill.
        """
        if not block_ids:
            return
        for state in self._requests.values():
            failed_at = next(
                (
                    state.load_first + offset
                    for offset, block in enumerate(state.load_blocks)
                    if block in block_ids
                ),
                None,
            )
            if failed_at is None:
                continue
            if state.loaded_into:
                self.stats["loads_failed"] += 1
                state.loaded_into = ()
            state.load_blocks = ()
            state.staged_upto = min(state.staged_upto, failed_at)

    def fail_pending_loads(self) -> StepMetadata:
        """A step that only fails the loads decided since the last step (building
        the step failed): their leases are released and the worker reports their
        blocks as failed, so vLLM recomputes them and stops waiting."""
        failed = []
        for item in self._new_loads:
            if item.load is None:
                failed.append(item)
                continue
            self._release_soon(
                PrefixHit(item.load.grant.holder_rank, item.load.holder_address, 0),
                item.load.grant.lease_id,
            )
            failed.append(RequestLoad(item.req_id, None, item.load.dst_block_ids))
            self.loads_failed(set(item.load.dst_block_ids))
        self._new_loads = []
        return StepMetadata(loads=tuple(failed), load_async=self._settings.load_async)

    # ---- per step ---------------------------------------------------------------

    def build_step(self, scheduled: Sequence[ScheduledRequest]) -> StepMetadata:
        """Loads to start and blocks to stage this step; resets the step state.

        A block is staged in the step whose forward completes its KV, or later
        while its request is still scheduled (a generated token vLLM has not
        handed over yet), never before all of its tokens are known: its key is
        the chain hash of exactly those tokens. Blocks a request computes in the
        same forward as its synchronous load are staged only if that load
        succeeds (their KV attended to the loaded blocks).
        """
        block_size = self._settings.block_size
        loads, self._new_loads = tuple(self._new_loads), []
        # a synchronous load fills its blocks before this step's forward
        loading_now = (
            {} if self._settings.load_async else {item.req_id: item for item in loads}
        )
        stage: list[StageItem] = []
        conditional: list[StageAfterLoad] = []
        for item in scheduled:
            state = self._requests.get(item.req_id)
            if state is None:
                continue
            if item.whole_table:
                state.block_ids = list(item.block_ids)
            elif state.block_ids is not None:
                state.block_ids.extend(item.block_ids)
            table = state.block_ids
            if table is None:
                # Never saw the whole table (cannot happen with the vLLM versions
                # we support): staging by guessed positions could publish the wrong
                # block under a key, so this request publishes nothing.
                continue
            # KV exists after this forward for the computed and scheduled tokens;
            # of those, only the ones vLLM already handed over have known ids.
            done_tokens = min(
                item.num_computed_tokens + item.num_scheduled_tokens,
                len(state.tokens),
            )
            full = min(done_tokens // block_size, len(table))
            if full > len(state.keys):
                extend_full_blocks(
                    state.keys,
                    state.tokens[: full * block_size],
                    block_size,
                    self._settings.namespace,
                )
            items = tuple(
                StageItem(state.keys[index], table[index])
                for index in range(state.staged_upto, full)
            )
            state.staged_upto = max(state.staged_upto, full)
            if not items:
                continue
            load = loading_now.get(item.req_id)
            if load is not None and load.load is None:
                # The load cannot start: vLLM recomputes the request from its
                # first failed block (loads_failed stages those blocks again).
                continue
            if load is not None and load.load is not None:
                conditional.append(StageAfterLoad(load.load.dst_block_ids, items))
            else:
                stage.extend(items)
        self.stats["staged_blocks"] += len(stage) + sum(
            len(c.items) for c in conditional
        )
        return StepMetadata(
            loads=loads,
            stage=tuple(stage),
            load_async=self._settings.load_async,
            stage_after_load=tuple(conditional),
        )

    # ---- end of a request -------------------------------------------------------

    def request_finished(self, req_id: str) -> dict[str, Any] | None:
        """Forget ``req_id``; returns what it loaded, for the request's output."""
        state = self._requests.pop(req_id, None)
        if state is None:
            return None
        self._drop_reservation(state)
        if not state.loaded_into:
            return None
        return {
            "xavier_external_tokens": len(state.loaded_into)
            * self._settings.block_size,
            "xavier_holder_rank": state.holder_rank,
        }

    def close(self) -> None:
        """Release every standing reservation (waits at most one RPC deadline)."""
        for state in self._requests.values():
            self._drop_reservation(state)
        self._requests.clear()
        self.flush(self._settings.rpc_timeout_s)

    # ---- helpers ----------------------------------------------------------------

    def _state_for(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        all_token_ids: Sequence[int] | None,
    ) -> _RequestState:
        state = self._requests.get(req_id)
        if state is None:
            prompt = list(prompt_token_ids)
            if (
                all_token_ids is not None
                and list(all_token_ids[: len(prompt)]) != prompt
            ):
                raise ValueError(
                    f"request {req_id}: its token sequence does not start with its "
                    "prompt"
                )
            keys = hash_full_blocks(
                prompt, self._settings.block_size, self._settings.namespace
            )
            tokens = prompt if all_token_ids is None else all_token_ids
            state = _RequestState(tokens, len(prompt), keys)
            self._requests[req_id] = state
        return state

    def _drop_reservation(self, state: _RequestState) -> None:
        """Let go of the request's reservation, standing or still unanswered."""
        reservation, state.reservation = state.reservation, None
        if reservation is not None:
            self._release_soon(reservation.holder, reservation.grant.lease_id)
        pending, state.pending = state.pending, None
        if (
            pending is not None
            and pending.abandon()  # answered already: the lease is ours to release
            and _may_hold_lease(pending)
        ):
            self._release_soon(pending.hit, pending.lease_id)

    def _release_soon(self, holder: PrefixHit, lease_id: str) -> None:
        """Release a lease without waiting: the scheduler must not stall on it."""
        self._releases = [f for f in self._releases if not f.done()]
        self._releases.append(
            self._loop.submit(self._release_within_deadline(holder, lease_id))
        )

    async def _release_within_deadline(self, holder: PrefixHit, lease_id: str) -> None:
        try:
            await with_deadline(
                self._release(holder, lease_id), self._settings.rpc_timeout_s
            )
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


def _may_hold_lease(pending: PendingReservation) -> bool:
    """Whether an answered reservation may have left a lease on its holder: a
    grant, a deadline after which it may still have granted, or an answer not
    handed over yet. A refusal or a failed call left none."""
    future = pending.future
    if future is None:
        return False
    if not future.done():
        return True
    if future.cancelled():
        return False
    error = future.exception()
    return error is None or isinstance(error, TimeoutError)


def _leading_match(granted: Sequence[BlockHash], wanted: Sequence[BlockHash]) -> int:
    count = 0
    for got, want in zip(granted, wanted, strict=False):
        if got != want:
            break
        count += 1
    return count
