"""The replica model actor: one vLLM engine in one sub-pool process.

The worker creates one ``ReplicaModelActor`` per replica, each in its own sub-pool.
With Xavier on, the replica's transfer actor lives in the same sub-pool; this actor
creates it when the supervisor says every replica has loaded, and closes it at
shutdown.

Streaming uses an explicit poll protocol (``open_stream`` / ``next_chunks`` /
``close_stream``) instead of remote generators: every poll has a deadline, an
abandoned stream is reaped, and the front end batches whatever arrived since its
last poll into one round trip.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import xoscar as xo

from ..model.llm.vllm.xavier.config import XavierReplicaSettings
from ..model.llm.vllm.xavier.rank_stats import merge_rank_stats
from ..model.llm.vllm.xavier.stats import XavierStats
from .messages import (
    GenerationChunk,
    GenerationRequest,
    ReplicaFailed,
    ReplicaInfo,
    ReplicaReport,
    ReplicaSpec,
    ReplicaStats,
    StreamBatch,
)
from .vllm_engine import VLLMEngine

logger = logging.getLogger(__name__)

# A stream nobody polled for this long lost its consumer: abort it.
STREAM_IDLE_TIMEOUT_S = 60.0
# At shutdown, how long the requests still running get to send vLLM their aborts.
ABORT_WAIT_S = 5.0
_REAP_INTERVAL_S = 5.0
_MAP_POLL_S = 0.2
_REPORTED_ENV = ("UCX_TLS", "UCX_MEMTYPE_CACHE", "CUDA_VISIBLE_DEVICES")


def model_actor_uid(model_uid: str, rank: int) -> str:
    return f"model-{model_uid}-{rank}"


class _End:
    """Queue marker: the generation finished (``error`` None) or failed."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


@dataclass
class _Stream:
    queue: asyncio.Queue[GenerationChunk | _End] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None  # the producer, set right after creation
    last_poll: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class ReplicaModelActor(xo.StatelessActor):
    """Serves one replica. Stateless in xoscar's sense: calls run concurrently."""

    def __init__(self, spec: ReplicaSpec) -> None:
        super().__init__()
        self._spec = spec
        self._engine: VLLMEngine | None = None
        self._load_seconds = 0.0
        self._streams: dict[str, _Stream] = {}  # request id -> its stream
        # the calls of ``generate`` in progress (a stream has its own task)
        self._generating: set[asyncio.Task[Any]] = set()
        self._stopping = False  # shutdown_engine began: cancellations are its
        self._reaper: asyncio.Task[None] | None = None
        self._transfer: Any = None  # its ranks' transfer actors (TransferActorGroup)
        self._loaded = False  # the engine started once
        self._loaded_xavier = False  # the transfer actor was created once
        self._requests_total = 0
        self._in_flight = 0
        self._prompt_tokens = 0
        self._cached_prompt_tokens = 0
        self._generated_tokens = 0

    async def __post_create__(self) -> None:
        self._reaper = asyncio.create_task(self._reap_abandoned_streams())

    async def __pre_destroy__(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for stream in list(self._streams.values()):
            stream.cancel()

    # ---- life cycle ---------------------------------------------------------------

    async def load(self) -> ReplicaInfo:
        """Start the engine (in a thread: it blocks for tens of seconds), warm it up."""
        if self._engine is not None:
            raise RuntimeError(f"replica {self._spec.rank} is already loaded")
        started = time.monotonic()
        engine = await asyncio.to_thread(VLLMEngine.start, self._spec)
        self._engine = engine
        self._loaded = True
        await engine.warm_up()
        self._load_seconds = time.monotonic() - started
        return ReplicaInfo(
            rank=self._spec.rank,
            address=self.address,
            actor_uid=self.uid.decode() if isinstance(self.uid, bytes) else self.uid,
            pid=os.getpid(),
            num_kv_blocks=engine.num_kv_blocks,
            block_size=engine.block_size,
            load_seconds=self._load_seconds,
            hash_namespace=engine.hash_namespace(),
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
        )

    async def start_transfer_actor(self) -> str:
        """Create this replica's Xavier transfer actors (one per engine rank) in
        this sub-pool; rank 0's uid."""
        settings = self._require_xavier()
        self._require_engine()
        # Imported here, in the replica process: it pulls in torch and NIXL, which
        # the supervisor and front-end processes never need.
        from ..model.llm.vllm.xavier.actor.rank_group import TransferActorGroup
        from ..model.llm.vllm.xavier.actor.transfer_actor import TransferActorConfig

        config = TransferActorConfig(
            model_uid=settings.model_uid,
            rank=settings.rank,
            tracker_address=settings.tracker_address,
            tracker_uid=settings.tracker_uid,
            gpu_cache_bytes=settings.config.gpu_cache_bytes,
            # None: the CPU tier holds as many snapshots as the engine has KV blocks
            # (learnt when the connector maps the engine's caches).
            cpu_capacity_blocks=None,
            transport=settings.config.transport,
            rpc_timeout_s=settings.rpc_timeout_s,
            tp_size=settings.tensor_parallel_size,
        )
        self._transfer = await TransferActorGroup.create(config, self.address)
        self._loaded_xavier = True
        return settings.transfer_uid

    async def wait_xavier_ready(self, timeout_s: float) -> None:
        """Step the engine until its connector has mapped the KV cache into the
        transfer actor, so the first user request can already be shared.

        The connector retries the mapping at engine steps once the transfer actor
        exists; warm-up requests make the steps happen. The worker half reports the
        mapping to the scheduler half with a step's output, so one more request
        runs after the mapping is seen: from then on lookups are answered.
        """
        engine = self._require_engine()
        if self._transfer is None:
            raise RuntimeError(f"replica {self._spec.rank} has no transfer actor")
        deadline = time.monotonic() + timeout_s
        while not (stats := await self._transfer.stats()).mapped:
            if stats.mapping_error is not None:
                # the transfer actor itself refused the engine's caches (too
                # large a store, a layout it cannot read): retrying cannot help
                raise RuntimeError(
                    f"replica {self._spec.rank}: the Xavier connector could not "
                    "map the engine KV cache into its transfer actor: "
                    f"{stats.mapping_error}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replica {self._spec.rank}: the Xavier connector did not map "
                    f"the engine KV cache into its transfer actor in {timeout_s:.0f} s"
                )
            await engine.warm_up()
            await asyncio.sleep(_MAP_POLL_S)
        await engine.warm_up()

    async def shutdown_engine(self) -> None:
        """Abort the requests in progress, then stop the engine and its
        processes. The aborts reach vLLM while it runs, so that nothing waits
        for its output when ``VLLMEngine.stop`` ends the output handler."""
        self._stopping = True
        running = [s.task for s in self._streams.values() if s.task is not None]
        running += list(self._generating)
        for stream in list(self._streams.values()):
            stream.cancel()
        for task in list(self._generating):
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=ABORT_WAIT_S)
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.stop()

    async def close_transfer_actor(self) -> dict[str, Any] | None:
        """Drain and close the transfer actor; its final counters as plain data
        (``XavierStats.as_dict()``; None: no actor)."""
        transfer, self._transfer = self._transfer, None
        if transfer is None:
            return None
        try:
            final: XavierStats = await transfer.stats()
            await transfer.close()
        finally:
            await transfer.destroy()
        return final.as_dict()

    # ---- introspection ------------------------------------------------------------

    async def report(self) -> ReplicaReport:
        """What this process sees: its pid, its environment, the engine's config."""
        engine = self._require_engine()
        connector, module, hybrid_disabled = engine.kv_transfer()
        tp, pp = engine.parallel_sizes()
        return ReplicaReport(
            rank=self._spec.rank,
            pid=os.getpid(),
            env={k: os.environ[k] for k in _REPORTED_ENV if k in os.environ},
            xavier=engine.xavier_settings(),
            kv_connector=connector,
            kv_connector_module_path=module,
            disable_hybrid_kv_cache_manager=hybrid_disabled,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            block_size=engine.block_size,
            transfer_actor_alive=self._transfer is not None,
        )

    async def health(self) -> str | None:
        """Why this replica can no longer serve, or None while it can. Cheap: the
        supervisor's liveness monitor asks every second (``core/liveness.py``)."""
        if self._engine is None:
            return "its engine is not running" if self._loaded else None
        if self._engine.dead:
            return "its vLLM engine core died"
        if self._spec.xavier is not None and self._loaded_xavier and not self._transfer:
            return "its Xavier transfer actor is gone"
        return None

    async def stats(self) -> ReplicaStats:
        xavier = None
        ranks: list[XavierStats] = []
        if self._transfer is not None:
            ranks = await self._transfer.rank_stats()
            xavier = merge_rank_stats(ranks)
        return ReplicaStats(
            model_uid=self._spec.model_uid,
            rank=self._spec.rank,
            block_size=self._engine.block_size if self._engine is not None else 0,
            requests_total=self._requests_total,
            requests_in_flight=self._in_flight,
            prompt_tokens_total=self._prompt_tokens,
            cached_prompt_tokens_total=self._cached_prompt_tokens,
            generated_tokens_total=self._generated_tokens,
            xavier=xavier,
            xavier_ranks=tuple(ranks) if len(ranks) > 1 else (),
        )

    # ---- generation ---------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> GenerationChunk:
        """The whole output of one request."""
        engine = self._require_engine()
        final: GenerationChunk | None = None
        task = asyncio.current_task()
        if task is not None:
            self._generating.add(task)
        self._begin(request)
        try:
            async for chunk in engine.generate(request, stream=False):
                final = chunk
        except asyncio.CancelledError:
            if not self._stopping:
                raise  # the caller's cancellation: vLLM aborted the request
            raise ReplicaFailed(
                self._spec.rank, "the replica was shut down while serving it"
            ) from None
        except Exception as error:
            raise self._failure(engine, error) from None
        finally:
            self._end(*(() if final is None else (final, *final.more)))
            if task is not None:
                self._generating.discard(task)
        if final is None:
            raise RuntimeError(f"request {request.request_id} produced no output")
        return final

    async def open_stream(self, request: GenerationRequest) -> None:
        """Start generating ``request``; poll with ``next_chunks(request_id, ...)``."""
        engine = self._require_engine()
        if request.request_id in self._streams:
            raise ValueError(f"stream {request.request_id!r} is already open")
        stream = _Stream()
        self._streams[request.request_id] = stream
        stream.task = asyncio.create_task(self._produce(engine, request, stream))

    async def next_chunks(self, request_id: str, max_wait_s: float) -> StreamBatch:
        """Whatever the stream produced since the last call, waiting at most
        ``max_wait_s`` for the first chunk (an empty batch means: nothing yet)."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"no open stream {request_id!r}")
        stream.last_poll = time.monotonic()
        items: list[GenerationChunk | _End] = []
        try:
            items.append(await asyncio.wait_for(stream.queue.get(), max_wait_s))
        except TimeoutError:
            return StreamBatch(chunks=(), done=False)
        while not stream.queue.empty():
            items.append(stream.queue.get_nowait())
        chunks = tuple(item for item in items if isinstance(item, GenerationChunk))
        end = next((item for item in items if isinstance(item, _End)), None)
        if end is None:
            return StreamBatch(chunks=chunks, done=False)
        del self._streams[request_id]
        if end.error is not None:
            raise end.error
        return StreamBatch(chunks=chunks, done=True)

    async def close_stream(self, request_id: str) -> None:
        """Abort a stream (the client went away); unknown ids are a no-op."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    async def _produce(
        self, engine: VLLMEngine, request: GenerationRequest, stream: _Stream
    ) -> None:
        last: dict[int, GenerationChunk] = {}  # per choice (n > 1)
        self._begin(request)
        try:
            async for chunk in engine.generate(request, stream=True):
                last[chunk.index] = chunk
                stream.queue.put_nowait(chunk)
        except asyncio.CancelledError:
            stream.queue.put_nowait(_End(RuntimeError("stream aborted")))
            raise
        except Exception as error:  # handed to the consumer, which raises it
            stream.queue.put_nowait(_End(self._failure(engine, error)))
        else:
            stream.queue.put_nowait(_End())
        finally:
            self._end(*last.values())

    async def _reap_abandoned_streams(self) -> None:
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            now = time.monotonic()
            for request_id, stream in list(self._streams.items()):
                if now - stream.last_poll > STREAM_IDLE_TIMEOUT_S:
                    logger.warning(
                        "replica %d: aborting stream %s, not polled for %.0f s",
                        self._spec.rank,
                        request_id,
                        now - stream.last_poll,
                    )
                    await self.close_stream(request_id)

    # ---- bookkeeping --------------------------------------------------------------

    def _begin(self, request: GenerationRequest) -> None:
        self._requests_total += 1
        self._in_flight += 1
        self._prompt_tokens += len(request.prompt_token_ids)

    def _end(self, *last: GenerationChunk) -> None:
        """A request ended; ``last``: each of its choices' last chunk (none when
        it produced nothing)."""
        self._in_flight -= 1
        self._generated_tokens += sum(chunk.completion_tokens for chunk in last)
        if last:  # the prompt's, the same on every choice
            self._cached_prompt_tokens += last[0].cached_prompt_tokens or 0

    def _failure(self, engine: VLLMEngine, error: Exception) -> Exception:
        """``error`` as the caller should see it: a dead engine is this replica's
        failure (the front end answers 503 and routes elsewhere), anything else
        (vLLM refusing a request, ...) stays what it was."""
        if engine.dead:
            return ReplicaFailed(
                self._spec.rank, f"its vLLM engine core died ({error!r})"
            )
        return error

    def _require_engine(self) -> VLLMEngine:
        if self._engine is None:
            raise RuntimeError(f"replica {self._spec.rank} has no running engine")
        return self._engine

    def _require_xavier(self) -> XavierReplicaSettings:
        if self._spec.xavier is None:
            raise RuntimeError(f"replica {self._spec.rank} was launched without Xavier")
        return self._spec.xavier
