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
   the answer is taken on a later pass (the calls to peers: ``reservations.py``).
   A synchronous hit whose locations the holder published is granted here, with
   no call at all (``lease_free.py``);
3. after vLLM allocated destination blocks, turns the reservation into a load;
4. each step, names the blocks that became full, to stage and publish them: prompt
   blocks, blocks of generated tokens (a later turn of the conversation, on another
   replica, starts with them) and blocks recomputed after a failed load. A request
   that loaded blocks from a peer publishes the blocks it computed after them once
   the worker has reported the load ended (their KV was computed from the loaded
   blocks: a failed load makes them wrong); the loaded blocks themselves are not
   staged again, their holder has them. A lookup asks for the run from the first
   block the engine lacks, whoever holds the blocks before it, so sharing runs
   both ways. Blocks the tracker already lists for this replica are not staged
   again;
5. releases a reservation that never became a load when the request goes away.

A failed, refused or late answer from a peer is a miss: the engine computes the
blocks itself. A holder costs the scheduler at most ``reply_wait_s`` per request
(nothing while an earlier request's reservation from it is still unanswered); the
tracker, asked only while the mirror is not ready, at most one RPC deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..aio import BackgroundLoop
from ..hashing import extend_full_blocks
from ..tracker_mirror import TrackerMirror
from ..wire import LoadRequest, PrefixHit, ReplicaIdentity, StageItem
from .fast_path import SyncLoadPolicy
from .lease_free import lease_free_reservation
from .request_state import RequestState
from .reservations import (
    PendingReservation,
    QueryPrefix,
    Release,
    Reservation,
    Reservations,
    Reserve,
)
from .stale_loads import StaleLoad
from .step import RequestLoad, ScheduledRequest, StepMetadata

logger = logging.getLogger(__name__)


# Decode fills a block of every running request every ``block_size`` steps: one
# staging per step, each with its fixed cost on the engine's thread and a call to
# the transfer actor (on an H100 the seed's workload, 64 output tokens at
# concurrency 16, staged in most of its steps). Generated blocks are batched
# instead, every this many steps or with a step's prompt blocks.
GENERATED_BATCH_PASSES = 8


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
    # False: routing only (``XavierConfig.remote_loads``): look nothing up.
    remote_loads: bool = True
    # GPU-first only: which hits load synchronously, within a hard bound (None:
    # every hit loads asynchronously). CPU-only deployments load every hit
    # synchronously, with the whole load deadline.
    sync_loads: SyncLoadPolicy | None = None


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
        self._identity: ReplicaIdentity | None = None
        # req_id -> per-request state, from the first lookup to request_finished
        self._requests: dict[str, RequestState] = {}
        # loads decided since the last step was built
        self._new_loads: list[RequestLoad] = []
        self._passes = 0  # steps built so far: one per pass of vLLM's scheduler
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
            "sync_answers": 0,  # hits answered (n, False) in a GPU-first deployment
            "sync_loads_failed": 0,
            "lease_free_answers": 0,  # of sync_answers, made with no reservation
            "stale_loads": 0,  # lease-free loads that found stale locations
            "staged_blocks": 0,
            "already_published": 0,  # full blocks not staged: listed for us
        }
        self._mirror = mirror
        self._reservations = Reservations(
            rank=settings.rank,
            rpc_timeout_s=settings.rpc_timeout_s,
            backoff_s=settings.backoff_s,
            reply_wait_s=settings.reply_wait_s,
            loop=loop,
            query_prefix=query_prefix,
            reserve=reserve,
            release=release,
            mirror=mirror,
            stats=self.stats,
        )

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
        cache_salt: str | None = None,
    ) -> tuple[int | None, bool]:
        """Tokens a peer can supply beyond ``num_computed_tokens``, and whether async.

        ``all_token_ids`` is the request's live token sequence (the prompt, then
        every generated token as vLLM appends it); with it, blocks of generated
        tokens are staged too. It is read, never modified, and only up to the
        tokens whose KV a step computed. ``cache_salt`` is vLLM's per-request
        salt: the request's keys are salted as vLLM salts its own (``hashing``).

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
        state = self._state_for(req_id, prompt_token_ids, all_token_ids, cache_salt)
        block_size = self._settings.block_size
        local_blocks = num_computed_tokens // block_size
        # Only the prompt minus its last token can be supplied.
        lookup_blocks = (state.num_prompt_tokens - 1) // block_size
        state.staged_upto = max(state.staged_upto, local_blocks)
        if (
            lookup_blocks <= local_blocks
            or self._identity is None
            or not allow_remote
            or not self._settings.remote_loads
            or state.load_attempted
        ):
            self._drop_reservation(state)
            return 0, False

        standing = state.reservation
        if standing is not None:
            if standing.first_block == local_blocks:
                return self._answer(state, standing)
            self._drop_reservation(state)
        pending = state.pending
        if pending is not None:
            if pending.first_block == local_blocks:
                return self._settle(state, pending)
            self._drop_reservation(state)

        self.stats["lookups"] += 1
        lease_free = lease_free_reservation(
            self._mirror,
            self._settings.sync_loads if self._settings.load_async else None,
            self._settings.rank,
            self._identity,
            state.keys[:lookup_blocks],
            local_blocks,
        )
        if lease_free is not None:  # no round trip: see lease_free.py
            self.stats["lease_free_answers"] += 1
            state.reservation = lease_free
            return self._answer(state, lease_free)
        mirror_lookups = self.stats["mirror_lookups"]
        pending = self._reservations.start(
            req_id, state.keys[:lookup_blocks], local_blocks, self._identity
        )
        if self.stats["mirror_lookups"] == mirror_lookups:
            state.round_trips += 1  # the mirror was not ready: the tracker was asked
        if pending is None:
            return 0, False
        state.round_trips += 1  # the reservation on the holder
        state.pending = pending
        answer = self._settle(state, pending)
        if answer[0] is None:
            self.stats["deferred"] += 1
        return answer

    def _answer(
        self, state: RequestState, reservation: Reservation
    ) -> tuple[int, bool]:
        tokens = len(reservation.grant.keys) * self._settings.block_size
        bound = None
        policy = self._settings.sync_loads
        if self._settings.load_async and policy is not None and self._identity:
            bound = policy.bound_s(
                reservation.holder.address,
                reservation.grant.tiers,
                len(reservation.grant.keys) * self._identity.geometry.block_nbytes,
            )
        state.answered_async = self._settings.load_async and bound is None
        state.answered_bound_s = bound
        if bound is not None:
            self.stats["sync_answers"] += 1
        return tokens, state.answered_async

    def _settle(
        self, state: RequestState, pending: PendingReservation
    ) -> tuple[int | None, bool]:
        """What to tell vLLM about ``pending``: ask again while it is unanswered,
        else the hit it became (standing in ``state.reservation``) or a miss."""
        if not self._reservations.ready(pending):
            state.passes_deferred += 1
            return None, False
        state.pending = None
        reservation = self._reservations.take(pending)
        if reservation is None:
            return 0, False
        state.reservation = reservation
        return self._answer(state, reservation)

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
            self._reservations.release_soon(reservation.holder, grant.lease_id)
            failed = tuple(b for b in destinations if b is not None)
            self._new_loads.append(
                RequestLoad(req_id, None, failed, asynchronous=state.answered_async)
            )
            return
        load = LoadRequest(
            load_id=grant.lease_id,
            grant=grant,
            holder_address=reservation.holder.address,
            dst_block_ids=tuple(int(b) for b in destinations if b is not None),
        )
        # From here on the lease belongs to the load: the transfer actor releases
        # it when the load ends (or is cancelled), never while writes are running.
        self._new_loads.append(
            RequestLoad(
                req_id,
                load,
                asynchronous=state.answered_async,
                bound_s=state.answered_bound_s,
            )
        )
        state.loaded_into = load.dst_block_ids
        state.load_holder_address = load.holder_address
        state.holder_rank = grant.holder_rank
        state.staged_upto = max(state.staged_upto, first + num_blocks)

    # ---- recovery from a fault in the connector ---------------------------------

    def answered_async(self, req_id: str) -> bool | None:
        """Whether vLLM was told ``req_id`` loads asynchronously (None: unknown)."""
        state = self._requests.get(req_id)
        return None if state is None else state.answered_async

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
        state = self._requests.get(req_id)
        asynchronous = self._settings.load_async
        if state is not None:
            state.load_attempted = True
            state.load_first, state.load_blocks = 0, tuple(block_ids)
            asynchronous = state.answered_async
        self._new_loads = [item for item in self._new_loads if item.req_id != req_id]
        failed = tuple(b for b in block_ids if b is not None)
        self._new_loads.append(
            RequestLoad(req_id, None, failed, asynchronous=asynchronous)
        )
        # Last: a release that fails must not keep the blocks from being reported.
        self.drop_reservation(req_id)

    def loads_stale(self, reports: Mapping[str, StaleLoad]) -> None:
        """Lease-free loads that found stale locations (before their failed
        blocks are reported): their holders are not at fault, and the mirror
        forgets those locations, so the next hits on them reserve."""
        for req_id, report in reports.items():
            self.stats["stale_loads"] += 1
            state = self._requests.get(req_id)
            if state is not None:
                state.load_stale = True
            if self._mirror is not None:
                self._mirror.forget_locations(report.holder_rank, report.stale)

    def loads_failed(self, block_ids: set[int]) -> None:
        """The worker reported ``block_ids`` as not loaded (vLLM recomputes them):
        a request whose load wrote any of them got from its peer none of its
        blocks (after a stale load: those before the first stale one), and
        computes the rest itself from the first failed one on, so those blocks
        are staged again as they fill.
        """
        if not block_ids:
            return
        for state in self._requests.values():
            failed_at = state.first_failed(block_ids)
            if failed_at is None:
                continue
            if state.loaded_into:
                self.stats["loads_failed"] += 1
                # a stale load's blocks before the first stale one were verified
                kept = failed_at - state.load_first if state.load_stale else 0
                state.loaded_into = state.loaded_into[:kept]
                policy = self._settings.sync_loads
                if (
                    state.answered_bound_s is not None
                    and policy is not None
                    and not state.load_stale  # the index was stale, not the holder
                ):
                    # past its bound, or failed: its holder's next hits go the
                    # asynchronous way for a while
                    self.stats["sync_loads_failed"] += 1
                    if state.load_holder_address is not None:
                        policy.missed(state.load_holder_address)
            state.load_blocks = ()
            state.staged_upto = min(state.staged_upto, failed_at)

    def record_load_round_trips(
        self, round_trips: dict[str, int], load_seconds: dict[str, float] | None = None
    ) -> None:
        """The worker's count of actor round trips per ended load (its start, its
        waits or polls, the actor's calls on the holder), and each load's own time.
        A request listed here has its load behind it: what it computed on top of
        the loaded blocks may be staged (``build_step``)."""
        for req_id, count in round_trips.items():
            state = self._requests.get(req_id)
            if state is not None:
                state.round_trips += count
                # its failed blocks, if any, are delivered with this report
                state.load_ended = True
        for req_id, seconds in (load_seconds or {}).items():
            state = self._requests.get(req_id)
            if state is not None:
                state.load_s = seconds

    def fail_pending_loads(self) -> StepMetadata:
        """A step that only fails the loads decided since the last step (building
        the step failed): their leases are released and the worker reports their
        blocks as failed, so vLLM recomputes them and stops waiting."""
        failed = []
        for item in self._new_loads:
            if item.load is None:
                failed.append(item)
                continue
            self._reservations.release_soon(
                PrefixHit(item.load.grant.holder_rank, item.load.holder_address, 0),
                item.load.grant.lease_id,
            )
            failed.append(
                RequestLoad(
                    item.req_id,
                    None,
                    item.load.dst_block_ids,
                    asynchronous=item.asynchronous,
                )
            )
            self.loads_failed(set(item.load.dst_block_ids))
        self._new_loads = []
        return StepMetadata(loads=tuple(failed), load_async=self._settings.load_async)

    # ---- per step ---------------------------------------------------------------

    def build_step(self, scheduled: Sequence[ScheduledRequest]) -> StepMetadata:
        """Loads to start and blocks to stage this step; resets the step state.

        A block is staged in the step whose forward completes its KV, or later
        while its request is still scheduled (a generated token vLLM has not
        handed over yet), never before all of its tokens are known: its key is
        the chain hash of exactly those tokens. Blocks of generated tokens wait
        (``held_back``) for a step that stages anything else or for every
        ``GENERATED_BATCH_PASSES``-th one, and go then if their request is
        scheduled in it (its blocks are still its own); a request that ends or
        is preempted first loses them, which costs a later turn at most a few
        blocks' recomputation. A request with a load stages
        nothing until the worker reported the load ended (``load_ended``): the
        KV of its blocks after the load was computed from the loaded blocks, so
        it is right only if the load was. A load that failed has moved the mark
        back by then (``loads_failed``), and the blocks vLLM recomputes are
        staged as they fill; one that succeeded lets the blocks computed since
        be staged in the request's next scheduled step (their engine blocks are
        the request's until it finishes).
        """
        block_size = self._settings.block_size
        loads, self._new_loads = tuple(self._new_loads), []
        # vLLM recomputes a load that cannot start from its first block on
        not_started = {item.req_id for item in loads if item.load is None}
        stage: list[StageItem] = []
        generated: list[RequestState] = []  # scheduled, with generated blocks held
        for item in scheduled:
            state = self._requests.get(item.req_id)
            if state is None:
                continue
            if item.whole_table:
                # A new table (resumed after preemption): held blocks are gone,
                # staged again from the new one as vLLM recomputes them (they
                # are the last ones counted as staged).
                state.staged_upto -= len(state.held_back)
                state.held_back.clear()
                state.block_ids = list(item.block_ids)
            elif state.block_ids is not None:
                state.block_ids.extend(item.block_ids)
            if state.passes_waited is None and item.num_scheduled_tokens > 0:
                state.passes_waited = self._passes - state.asked_at_pass
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
                    state.cache_salt,
                )
            if state.loaded_into and not state.load_ended:
                continue  # see the docstring: staged once the load is known good
            first, state.staged_upto = state.staged_upto, max(state.staged_upto, full)
            if item.req_id in not_started:
                continue  # loads_failed moves the mark back to what vLLM recomputes
            # Blocks wholly in the prompt now; generated ones wait for a batch.
            prompt_end = max(first, min(full, state.num_prompt_tokens // block_size))
            stage.extend(
                StageItem(state.keys[index], table[index])
                for index in range(first, prompt_end)
            )
            state.held_back.extend(
                StageItem(state.keys[index], table[index])
                for index in range(prompt_end, full)
            )
            if state.held_back:
                generated.append(state)
        if stage or self._passes % GENERATED_BATCH_PASSES == 0:
            for state in generated:  # scheduled now: their blocks are theirs
                stage.extend(state.held_back)
                state.held_back.clear()
        stage = self._not_published_here(stage)
        self.stats["staged_blocks"] += len(stage)
        self._passes += 1
        return StepMetadata(
            loads=loads, stage=tuple(stage), load_async=self._settings.load_async
        )

    def _not_published_here(self, items: list[StageItem]) -> list[StageItem]:
        """``items`` less the blocks the tracker already lists for this replica,
        as the mirror last saw it. A local hit recomputes the block that holds
        its prompt's last token, which the serve that cached the prompt here
        staged already. A block the mirror does not list yet is staged again, as
        every block was before this check."""
        mirror = self._mirror
        if not items or mirror is None:
            return items
        held = mirror.held_by(self._settings.rank, [item.key for item in items])
        self.stats["already_published"] += len(held)
        return [item for item in items if item.key not in held]

    # ---- end of a request -------------------------------------------------------

    def request_finished(self, req_id: str) -> dict[str, Any] | None:
        """Forget ``req_id``; returns what it loaded, for the request's output."""
        state = self._requests.pop(req_id, None)
        if state is None:
            return None
        self._drop_reservation(state)
        if not state.loaded_into:
            return None
        policy = self._settings.sync_loads
        if policy is not None and state.load_holder_address is not None:
            policy.met(state.load_holder_address)  # its load was not failed
        return state.output(self._settings.block_size)

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
        cache_salt: str | None = None,
    ) -> RequestState:
        state = self._requests.get(req_id)
        if state is None:
            state = RequestState.first_asked(
                req_id,
                prompt_token_ids,
                all_token_ids,
                self._settings.block_size,
                self._settings.namespace,
                self._passes,
                cache_salt,
            )
            self._requests[req_id] = state
        return state

    def _drop_reservation(self, state: RequestState) -> None:
        """Let go of the request's reservation, standing or still unanswered."""
        reservation, state.reservation = state.reservation, None
        if reservation is not None:
            self._reservations.release_soon(
                reservation.holder, reservation.grant.lease_id
            )
        pending, state.pending = state.pending, None
        if pending is not None:
            self._reservations.abandon(pending)

    def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for the releases sent so far to finish."""
        self._reservations.flush(timeout)
