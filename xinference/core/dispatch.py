"""Request dispatch over a model's replicas, in the front-end process.

Replicas the supervisor reports gone or unresponsive (``ReplicaStates``, asked at
most every ``STATES_REFRESH_S`` and at once after a replica failed a request) get
no requests; a replica that failed a request is also avoided locally for
``SUSPECT_S``. A non-streamed request, or a streamed one before its first chunk,
whose replica failed is sent once more to another replica; otherwise the failure
reaches the client as ``ReplicaFailed`` (503).

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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import xoscar as xo
from xoscar.errors import ServerClosed

from ..model.llm.vllm.xavier.hashing import hash_full_blocks
from ..model.llm.vllm.xavier.stats import LatencyRecorder
from .messages import (
    DeploymentInfo,
    GenerationChunk,
    GenerationRequest,
    ReplicaFailed,
    ReplicaStates,
    ServiceUnavailable,
)
from .prompting import PromptRenderer
from .router import RouteFacts, Router, make_router

logger = logging.getLogger(__name__)

# Deadlines. A poll waits at most STREAM_POLL_S for new output; a whole request may
# run for REQUEST_TIMEOUT_S; a tracker lookup taking longer than TRACKER_TIMEOUT_S
# is routed without cache knowledge.
STREAM_POLL_S = 0.5
RPC_MARGIN_S = 10.0
REQUEST_TIMEOUT_S = 600.0
TRACKER_TIMEOUT_S = 2.0
STATES_REFRESH_S = 1.0
STATES_TIMEOUT_S = 2.0
SUSPECT_S = 5.0

# A call to a replica failing with one of these: its actor or process is not there.
_UNREACHABLE = (ServerClosed, xo.ActorNotExist, ConnectionError)

T = TypeVar("T")
StatesSource = Callable[[], Awaitable[ReplicaStates]]


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
        states: StatesSource | None = None,
    ) -> None:
        self.deployment = deployment
        self.renderer = renderer
        self._replicas = list(replicas)  # rank -> model actor ref
        self._tracker = tracker
        self._router = router
        self._in_flight = [0] * len(self._replicas)
        self.counters = [RouteCounters() for _ in self._replicas]
        self.latency = [ReplicaLatency() for _ in self._replicas]
        self.tracker_errors = 0
        self.replica_failures = 0  # requests a replica failed (retried or not)
        self.retries = 0  # of those, sent again to another replica
        self._states_source = states
        self._states = ReplicaStates(
            gone=dict(deployment.gone), unresponsive=dict(deployment.unresponsive)
        )
        self._states_at = time.monotonic()
        self._states_task: asyncio.Task[ReplicaStates] | None = None
        self._suspect_until: dict[int, float] = {}  # rank -> monotonic time

    @classmethod
    async def connect(
        cls, deployment: DeploymentInfo, states: StatesSource | None = None
    ) -> ReplicaDispatcher:
        renderer = await asyncio.to_thread(PromptRenderer.load, deployment.model_path)
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
        return cls(deployment, renderer, replicas, tracker, router, states)

    @property
    def in_flight(self) -> tuple[int, ...]:
        return tuple(self._in_flight)

    @property
    def states(self) -> ReplicaStates:
        """The supervisor's last word on which replicas are gone or unresponsive."""
        return self._states

    async def refresh_states(self, *, force: bool = False) -> None:
        """Ask the supervisor which replicas are gone or unresponsive (at most every
        ``STATES_REFRESH_S`` unless ``force``; one question at a time; a failed or
        late answer keeps what was known)."""
        if self._states_source is None:
            return
        if not force and time.monotonic() - self._states_at < STATES_REFRESH_S:
            return
        if self._states_task is None or self._states_task.done():
            self._states_task = asyncio.ensure_future(self._states_source())
        try:
            self._states = await asyncio.wait_for(
                asyncio.shield(self._states_task), STATES_TIMEOUT_S
            )
        except Exception as error:
            logger.warning("could not refresh replica states: %r", error)
        self._states_at = time.monotonic()

    def available(self, exclude: int | None = None) -> tuple[bool, ...]:
        """Which replicas may get a request: not gone, not unresponsive and not
        suspected after a failure. When that leaves none, the ones that are not
        gone (better to wait on a slow replica than to refuse)."""
        now = time.monotonic()
        gone = self._states.gone
        alive = [
            rank not in gone and rank != exclude for rank in range(len(self._replicas))
        ]
        serving = [
            ok
            and rank not in self._states.unresponsive
            and self._suspect_until.get(rank, 0.0) <= now
            for rank, ok in enumerate(alive)
        ]
        if any(serving):
            return tuple(serving)
        if any(alive):
            return tuple(alive)
        reasons = "; ".join(f"replica {r}: {why}" for r, why in sorted(gone.items()))
        raise ServiceUnavailable(
            f"no replica of {self.deployment.model_uid!r} can serve"
            + (f" ({reasons})" if reasons else "")
        )

    async def route(self, prompt_token_ids: Sequence[int]) -> Route:
        await self.refresh_states()
        holder, blocks = None, 0
        if self._router.needs_prefix:
            holder, blocks = await self._longest_prefix(prompt_token_ids)
        return self._choose(holder, blocks, self.available())

    async def _reroute(self, failed: ReplicaFailed, route: Route) -> Route | None:
        """After ``route``'s replica failed: another replica for the same request,
        or None when there is none."""
        self.replica_failures += 1
        self._suspect_until[route.rank] = time.monotonic() + SUSPECT_S
        await self.refresh_states(force=True)
        try:
            available = self.available(exclude=route.rank)
        except ServiceUnavailable:
            return None
        self.retries += 1
        logger.warning("%s; sending the request to another replica", failed)
        return self._choose(route.holder, route.prefix_blocks, available)

    def _choose(
        self, holder: int | None, blocks: int, available: tuple[bool, ...]
    ) -> Route:
        facts = RouteFacts(
            in_flight=tuple(self._in_flight),
            holder=holder,
            prefix_blocks=blocks,
            available=available,
        )
        rank = self._router.choose(facts)
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
        """The whole output from ``route``'s replica (no retry)."""
        started = time.monotonic()
        with self._counted(route.rank):
            try:
                chunk = await _bounded(
                    self._replicas[route.rank].generate(request), REQUEST_TIMEOUT_S
                )
            except _UNREACHABLE as error:
                raise ReplicaFailed(route.rank, _unreachable(error)) from None
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
        except ReplicaFailed as failed:
            retry = await self._reroute(failed, route)
            if retry is None:
                raise
        return await self.generate(retry, request), retry.rank

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
        with self._counted(route.rank):
            try:
                await _bounded(replica.open_stream(request), RPC_MARGIN_S)
            except _UNREACHABLE as error:
                raise ReplicaFailed(route.rank, _unreachable(error)) from None
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
                    except _UNREACHABLE as error:
                        raise ReplicaFailed(route.rank, _unreachable(error)) from None
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

    async def stream_served(
        self, route: Route, request: GenerationRequest
    ) -> AsyncIterator[tuple[GenerationChunk, int]]:
        """``stream``, sent once more to another replica if ``route``'s failed
        before its first chunk; each chunk with the rank that produced it."""
        produced = False
        try:
            async for chunk in self.stream(route, request):
                produced = True
                yield chunk, route.rank
            return
        except ReplicaFailed as failed:
            retry = None if produced else await self._reroute(failed, route)
            if retry is None:
                raise
        async for chunk in self.stream(retry, request):
            yield chunk, retry.rank

    async def _close_stream(self, replica: Any, request_id: str) -> None:
        try:
            await _bounded(replica.close_stream(request_id), RPC_MARGIN_S)
        except (TimeoutError, *_UNREACHABLE) as error:
            logger.warning("could not abort stream %s: %r", request_id, error)

    async def longest_prefix(
        self, prompt_token_ids: Sequence[int]
    ) -> tuple[int | None, int]:
        """(replica holding the longest published prefix, its length in blocks),
        per the block tracker; (None, 0) when nobody holds one or Xavier is off."""
        return await self._longest_prefix(prompt_token_ids)

    async def _longest_prefix(
        self, prompt_token_ids: Sequence[int]
    ) -> tuple[int | None, int]:
        namespace = self.deployment.hash_namespace
        if self._tracker is None or namespace is None:
            return None, 0
        # As the connector does: the last prompt token is always computed, so only
        # the full blocks before it can come from a cache.
        usable = list(prompt_token_ids[: max(len(prompt_token_ids) - 1, 0)])
        keys = hash_full_blocks(usable, self.deployment.block_size, namespace)
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
        return hit.rank, hit.num_blocks

    @contextlib.contextmanager
    def _counted(self, rank: int) -> Any:
        self._in_flight[rank] += 1
        try:
            yield
        finally:
            self._in_flight[rank] -= 1


def _unreachable(error: BaseException) -> str:
    return f"its process or actor is unreachable ({type(error).__name__}: {error})"


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
