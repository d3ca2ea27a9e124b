"""Request dispatch over a model's replicas, in the front-end process.

The dispatcher holds the deployment's prompt renderer (the front end tokenises once,
before routing), asks the router for a replica (for the cache-aware router, after
asking the block tracker who holds the longest prefix), counts the request in flight
on that replica while it runs, and relays the replica's output. It talks to the replica model actors directly; the supervisor is
not on the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import xoscar as xo

from ..model.llm.vllm.xavier.hashing import hash_full_blocks
from ..model.llm.vllm.xavier.stats import LatencyRecorder
from .messages import (
    DeploymentInfo,
    GenerationChunk,
    GenerationRequest,
    ReplicaFailed,
    ReplicaStates,
)
from .prompting import PromptRenderer
from .router import RouteFacts, Router, make_router
from .sampling import load_sampling_defaults

logger = logging.getLogger(__name__)

# Deadlines. A poll waits at most STREAM_POLL_S for new output; a whole request may
# run for REQUEST_TIMEOUT_S; a tracker lookup taking longer than TRACKER_TIMEOUT_S
# is routed without cache knowledge.
STREAM_POLL_S = 0.5
RPC_MARGIN_S = 10.0
REQUEST_TIMEOUT_S = 600.0
TRACKER_TIMEOUT_S = 2.0
# A replica that refused a connection is skipped for this long, or until the
# supervisor's verdict arrives (``update_gone``), whichever comes first.
SUSPECT_S = 10.0
# What a call to a replica whose process or host went away raises.
_UNREACHABLE = (ConnectionError, xo.errors.ServerClosed, xo.ActorNotExist)


class ReplicaUnavailable(RuntimeError):
    """The chosen replica (or every replica) cannot serve: gone or unreachable."""


T = TypeVar("T")
# What a request's replica failing looks like here: it is sent once to another.
_FAILED = (ReplicaUnavailable, ReplicaFailed)


@dataclass(frozen=True, slots=True)
class Route:
    """The replica chosen for one request, and why."""

    rank: int
    holder: int | None  # longest-prefix holder per the tracker (cache-aware only)
    prefix_blocks: int


@dataclass(slots=True)
class RouteCounters:
    """Per-replica routing counters (mutable, owned by one dispatcher)."""

    routed: int = 0
    routed_to_holder: int = 0  # cache-aware: sent where the prefix already was
    holder_too_busy: int = 0  # cache-aware: the holder was skipped for load


# Latency histogram bounds in seconds (upstream Xinference's request-duration buckets).
LATENCY_BOUNDS_S = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


@dataclass(slots=True)
class ReplicaLatency:
    """What clients waited on one replica, measured in the front end: to the first
    token (streamed requests: a non-streamed reply arrives whole) and to the end
    (every successful request)."""

    first_token: LatencyRecorder = field(
        default_factory=lambda: LatencyRecorder(LATENCY_BOUNDS_S)
    )
    end_to_end: LatencyRecorder = field(
        default_factory=lambda: LatencyRecorder(LATENCY_BOUNDS_S)
    )


class ReplicaDispatcher:
    """Routes the requests of one deployment; one per model in the front end."""

    def __init__(
        self,
        deployment: DeploymentInfo,
        renderer: PromptRenderer,
        replicas: Sequence[Any],
        tracker: Any | None,
        router: Router,
        sampling_defaults: Mapping[str, float | int] | None = None,
    ) -> None:
        self.deployment = deployment
        self.renderer = renderer
        # The model's generation_config.json defaults (``core/sampling.py``).
        self.sampling_defaults = dict(sampling_defaults or {})
        self._replicas = list(replicas)  # rank -> model actor ref
        self._tracker = tracker
        self._router = router
        self._in_flight = [0] * len(self._replicas)
        self.counters = [RouteCounters() for _ in self._replicas]
        self.latency = [ReplicaLatency() for _ in self._replicas]
        self.tracker_errors = 0
        # rank -> why the supervisor took it out of service
        self.gone: dict[int, str] = dict(deployment.gone)
        self.gone_checked = time.monotonic()
        self._suspect: dict[int, float] = {}  # rank -> when a call to it failed
        # set when the supervisor declares the rank gone: ends the requests waiting
        # on it (a replica cut off by the network would otherwise hold them until
        # REQUEST_TIMEOUT_S)
        self._gone_events: dict[int, asyncio.Event] = {}
        # rank -> why it missed its last health probe (the supervisor's liveness
        # monitor): no requests until it answers, unless no other replica can
        self.unresponsive: dict[int, str] = dict(deployment.unresponsive)
        self.replica_failures = 0  # requests a replica failed (re-sent or not)
        self.retries = 0  # of those, sent again to another replica

    def update_states(self, states: ReplicaStates) -> None:
        """The supervisor's current gone and unresponsive replicas."""
        self.unresponsive = dict(states.unresponsive)
        self.update_gone(states.gone)

    def update_gone(self, gone: dict[int, str]) -> None:
        """The supervisor's current list of gone replicas."""
        self.gone = dict(gone)
        self.gone_checked = time.monotonic()
        for rank in gone:
            self._gone_event(rank).set()
        for rank in gone:
            self._suspect.pop(rank, None)

    def live_ranks(self, exclude: int | None = None) -> list[int]:
        """Replicas a request may go to: not gone, not suspected after a failure,
        not unresponsive (unless every other one is: better to wait on a slow
        replica than to refuse)."""
        now = time.monotonic()
        live = [
            rank
            for rank in range(len(self._replicas))
            if rank not in self.gone
            and rank != exclude
            and now - self._suspect.get(rank, -SUSPECT_S) >= SUSPECT_S
        ]
        answering = [rank for rank in live if rank not in self.unresponsive]
        return answering or live

    @classmethod
    async def connect(cls, deployment: DeploymentInfo) -> ReplicaDispatcher:
        renderer = await asyncio.to_thread(PromptRenderer.load, deployment.model_path)
        defaults = await asyncio.to_thread(
            load_sampling_defaults,
            deployment.model_path,
            deployment.generation_config,
        )
        replicas = [
            await xo.actor_ref(address=replica.address, uid=replica.actor_uid)
            for replica in deployment.replicas
        ]
        tracker = None
        if deployment.tracker_address and deployment.tracker_uid:
            tracker = await xo.actor_ref(
                address=deployment.tracker_address, uid=deployment.tracker_uid
            )
        router = make_router(deployment.router.kind, deployment.router.busy_margin)
        return cls(deployment, renderer, replicas, tracker, router, defaults)

    @property
    def in_flight(self) -> tuple[int, ...]:
        return tuple(self._in_flight)

    async def route(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> Route:
        """A replica for a prompt served under ``cache_salt``: the cache-aware
        router looks its prefix up under that salt, so a prefix cached for
        another salt never draws it (it would be a miss there anyway)."""
        holder, blocks = None, 0
        if self._router.needs_prefix:
            holder, blocks = await self._longest_prefix(prompt_token_ids, cache_salt)
        return self._choose(holder, blocks, self.live_ranks())

    async def _reroute(self, failed: Exception, route: Route) -> Route | None:
        """After ``route``'s replica failed a request before any output went out:
        another replica for it, or None when there is none."""
        self.replica_failures += 1
        self._suspect[route.rank] = time.monotonic()
        live = self.live_ranks(exclude=route.rank)
        if not live:
            return None
        self.retries += 1
        logger.warning("%s; sending the request to another replica", failed)
        return self._choose(route.holder, route.prefix_blocks, live)

    def _choose(self, holder: int | None, blocks: int, live: list[int]) -> Route:
        if not live:
            reasons = "; ".join(
                f"replica {rank}: {why}" for rank, why in sorted(self.gone.items())
            )
            raise ReplicaUnavailable(
                f"no replica of {self.deployment.model_uid} can serve"
                + (f" ({reasons})" if reasons else "")
            )
        if holder is not None and holder not in live:
            holder, blocks = None, 0
        # The router sees the live replicas only (positions in ``live``).
        facts = RouteFacts(
            in_flight=tuple(self._in_flight[rank] for rank in live),
            holder=None if holder is None else live.index(holder),
            prefix_blocks=blocks,
        )
        rank = live[self._router.choose(facts)]
        counters = self.counters[rank]
        counters.routed += 1
        if holder is not None and blocks > 0:
            if rank == holder:
                counters.routed_to_holder += 1
            else:
                self.counters[holder].holder_too_busy += 1
        return Route(rank=rank, holder=holder, prefix_blocks=blocks)

    async def generate(
        self, route: Route, request: GenerationRequest
    ) -> GenerationChunk:
        started = time.monotonic()
        with self._counted(route.rank), self._reachable(route.rank):
            chunk = await self._unless_gone(
                route.rank,
                self._replicas[route.rank].generate(request),
                REQUEST_TIMEOUT_S,
            )
        self.latency[route.rank].end_to_end.record(time.monotonic() - started)
        return chunk

    async def serve(
        self, route: Route, request: GenerationRequest
    ) -> tuple[GenerationChunk, int]:
        """The whole output and the rank that produced it: ``route``'s replica, or
        once another one if that replica failed (nothing was sent to the client
        yet, so the request can start over)."""
        try:
            return await self.generate(route, request), route.rank
        except _FAILED as failed:
            retry = await self._reroute(failed, route)
            if retry is None:
                raise
        return await self.generate(retry, request), retry.rank

    async def stream_served(
        self, route: Route, request: GenerationRequest
    ) -> AsyncGenerator[tuple[GenerationChunk, int], None]:
        """``stream``, sent once more to another replica if ``route``'s failed
        before its first chunk; each chunk with the rank that produced it."""
        produced = False
        try:
            async for chunk in self.stream(route, request):
                produced = True
                yield chunk, route.rank
            return
        except _FAILED as failed:
            retry = None if produced else await self._reroute(failed, route)
            if retry is None:
                raise
        async for chunk in self.stream(retry, request):
            yield chunk, retry.rank

    async def stream(
        self, route: Route, request: GenerationRequest
    ) -> AsyncIterator[GenerationChunk]:
        """Chunks as the replica produces them; closing the iterator aborts the
        request on the replica."""
        replica = self._replicas[route.rank]
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + REQUEST_TIMEOUT_S
        latency, first_token = self.latency[route.rank], True
        with self._counted(route.rank), self._reachable(route.rank):
            await _bounded(replica.open_stream(request), RPC_MARGIN_S)
            done = False
            try:
                while not done:
                    if loop.time() > deadline:
                        raise TimeoutError(
                            f"request {request.request_id} ran past "
                            f"{REQUEST_TIMEOUT_S:.0f} s"
                        )
                    try:
                        batch = await _bounded(
                            replica.next_chunks(request.request_id, STREAM_POLL_S),
                            STREAM_POLL_S + RPC_MARGIN_S,
                        )
                    except TimeoutError:
                        raise ReplicaFailed(
                            route.rank,
                            f"no answer to a stream poll in "
                            f"{STREAM_POLL_S + RPC_MARGIN_S:.1f} s",
                        ) from None
                    done = batch.done
                    for chunk in batch.chunks:
                        if first_token and chunk.token_ids:
                            latency.first_token.record(loop.time() - started)
                            first_token = False
                        yield chunk
                latency.end_to_end.record(loop.time() - started)
            finally:
                if not done:
                    # Shielded: the consumer may be cancelled, the abort must go out.
                    await asyncio.shield(
                        self._close_stream(replica, request.request_id)
                    )

    async def _close_stream(self, replica: Any, request_id: str) -> None:
        try:
            await _bounded(replica.close_stream(request_id), RPC_MARGIN_S)
        except (TimeoutError, *_UNREACHABLE) as error:
            logger.warning("could not abort stream %s: %r", request_id, error)

    async def longest_prefix(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        after_blocks: int = 0,
    ) -> tuple[int | None, int]:
        """(replica holding the longest published prefix, its length in blocks),
        per the block tracker, for a prompt salted ``cache_salt``; (None, 0) when
        nobody holds one or Xavier is off. With ``after_blocks``: the replica
        holding the longest run from that block on, and the prefix's length
        counting the blocks before it."""
        return await self._longest_prefix(prompt_token_ids, cache_salt, after_blocks)

    async def _longest_prefix(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        after_blocks: int = 0,
    ) -> tuple[int | None, int]:
        namespace = self.deployment.hash_namespace
        if self._tracker is None or namespace is None:
            return None, 0
        # As the connector does: the last prompt token is always computed, so only
        # the full blocks before it can come from a cache.
        usable = list(prompt_token_ids[: max(len(prompt_token_ids) - 1, 0)])
        # the keys the replicas publish for this prompt under its salt
        keys = hash_full_blocks(
            usable, self.deployment.block_size, namespace, cache_salt
        )
        keys = keys[after_blocks:]
        if not keys:
            return None, 0
        try:
            hit = await _bounded(
                self._tracker.query_prefix(-1, keys), TRACKER_TIMEOUT_S
            )
        except (TimeoutError, xo.ActorNotExist, ConnectionError) as error:
            self.tracker_errors += 1
            logger.warning(
                "block tracker lookup failed (%r); routing without it", error
            )
            return None, 0
        if hit is None:
            return None, 0
        return hit.rank, after_blocks + hit.num_blocks

    def _gone_event(self, rank: int) -> asyncio.Event:
        return self._gone_events.setdefault(rank, asyncio.Event())

    async def _unless_gone(self, rank: int, call: Any, timeout: float) -> Any:
        """Await ``call`` (deadline ``timeout``), unless the replica is declared
        gone first: then the call is cancelled and the request fails with why."""
        gone = self._gone_event(rank)
        task = asyncio.ensure_future(call)
        waiter = asyncio.ensure_future(gone.wait())
        try:
            done, _ = await asyncio.wait(
                {task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiter.cancel()
            if not task.done():
                task.cancel()
        if task in done:
            return task.result()
        if gone.is_set():
            raise ReplicaUnavailable(
                f"replica {rank} of {self.deployment.model_uid} was taken out of "
                f"service while serving this request: {self.gone.get(rank, 'gone')}"
            )
        raise TimeoutError(f"replica {rank} did not answer in {timeout:.0f} s")

    @contextlib.contextmanager
    def _reachable(self, rank: int) -> Any:
        """A replica whose process or host went away fails the request at once,
        with a clear error, and is skipped by the next routes."""
        try:
            yield
        except _UNREACHABLE as error:
            self._suspect[rank] = time.monotonic()
            address = self.deployment.replicas[rank].address
            raise ReplicaUnavailable(
                f"replica {rank} of {self.deployment.model_uid} at {address} is "
                f"unreachable ({type(error).__name__}: {error}); later requests go "
                "to the other replicas"
            ) from error

    @contextlib.contextmanager
    def _counted(self, rank: int) -> Any:
        self._in_flight[rank] += 1
        try:
            yield
        finally:
            self._in_flight[rank] -= 1


async def _bounded(call: Awaitable[T], timeout: float) -> T:
    """``call`` (an actor call) under a deadline that holds even when the peer is
    stopped: ``asyncio.wait_for`` would wait for the cancelled call, and xoscar
    cancels a call by asking the peer, which never answers. Our own caller being
    cancelled still cancels the call (that is how an abort reaches a replica)."""
    task = asyncio.ensure_future(call)
    try:
        return cast(T, await xo.wait_for(task, timeout))
    except asyncio.CancelledError:
        task.cancel()
        raise
