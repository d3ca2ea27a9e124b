"""The OpenAI-compatible serving routes: ``/v1/completions`` and ``/v1/chat/completions``.

A request is tokenised here (in a worker thread; a text the tokenizer cannot take,
or too long to fit, is a 400 before it is tokenised: ``core/prompting.py``),
checked against the model's limits (``limits.py``: a 400 naming the limit), given the model's default sampling parameters where it set
none (``core/sampling.py``), routed, and relayed, streamed (SSE) or whole. A
streamed request's first chunk is awaited before the 200 goes out, so whatever a
replica refuses before producing anything is still an HTTP error, not an error
event inside a 200.

``/v1/completions`` takes one prompt or a list of them (strings or token id lists),
as OpenAI's API does: one choice per prompt, ``index`` its position in the list,
each prompt routed on its own.

A response served by a replica names it in the ``X-Xinference-Replica`` header (a
batch: the ranks in prompt order, comma-separated); a non-streamed one also says in
``X-Xinference-Xavier-External-Tokens`` how many prompt tokens Xavier loaded from
another replica, and from which in ``X-Xinference-Xavier-Holder`` (one prompt, when
it did).

Each request is served under a cache salt, the client's ``cache_salt`` or one the
server derives from the caller (``tenancy.py``): vLLM, Xavier and the router all
keep requests of different salts from sharing KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.dispatch import ReplicaDispatcher
from ..core.messages import GenerationChunk, GenerationRequest
from ..core.prompting import check_text
from ..core.sampling import resolve
from .errors import InvalidRequest, error_message
from .limits import ModelLimits
from .logprobs import chat_logprobs, completion_logprobs
from .schemas import ChatCompletionRequest, CompletionRequest
from .tenancy import SaltPolicy, request_principal
from .vllm_sampling import is_request_error, sampling_options

logger = logging.getLogger(__name__)

REPLICA_HEADER = "X-Xinference-Replica"
EXTERNAL_TOKENS_HEADER = "X-Xinference-Xavier-External-Tokens"
HOLDER_HEADER = "X-Xinference-Xavier-Holder"

# index of the prompt in the request, chunk -> one OpenAI chunk or choice
ToJson = Callable[[int, GenerationChunk], dict[str, Any]]
# (index of the prompt, index of the choice among the prompt's n)
ChoiceKey = tuple[int, int]


@dataclasses.dataclass(slots=True)
class _Job:
    """One prompt of a request, on its way to a replica."""

    index: int
    request: GenerationRequest


def add_serving_routes(
    app: FastAPI,
    dispatcher_for: Callable[[Any], Awaitable[ReplicaDispatcher]],
    salts: SaltPolicy,
) -> None:
    """``dispatcher_for(body)``: the dispatcher of the model a request names
    (raising ``InvalidRequest`` for parameters the server cannot honour);
    ``salts``: the cache salt each request is served under (``tenancy.py``)."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        salt = salts.salt(request_principal(http), body.cache_salt)
        dispatcher = await dispatcher_for(body)
        options = await _options(dispatcher, body, body.max_tokens)
        n = int(options.get("n", 1))
        top = options.get("logprobs")
        renderer = dispatcher.renderer
        jobs = []
        context = dispatcher.deployment.max_model_len
        for index, prompt in enumerate(body.prompts()):
            # Tokenising a long prompt takes a while: not on the event loop, and
            # refused unread when it cannot fit the context (``core/prompting.py``).
            token_ids = await asyncio.to_thread(
                renderer.completion_ids, prompt, context
            )
            request = _generation_request(
                dispatcher,
                "cmpl",
                token_ids,
                body,
                body.max_tokens,
                "max_tokens",
                cache_salt=salt,
                options=options,
            )
            jobs.append(_Job(index, request))
        request_id = jobs[0].request.request_id
        if len(jobs) > 1:  # vLLM needs an id per prompt
            for job in jobs:
                job.request = dataclasses.replace(
                    job.request, request_id=f"{request_id}-{job.index}"
                )
        created = int(time.time())
        # where a streamed choice's next logprobs start: after the tokens
        # reported so far (as vLLM counts: text held back for a stop string
        # lags the tokens)
        next_offset: dict[ChoiceKey, int] = {}

        def chunk_json(index: int, chunk: GenerationChunk) -> dict[str, Any]:
            key = (index, chunk.index)
            logprobs = None
            if top is not None and chunk.logprobs is not None:
                logprobs = completion_logprobs(
                    chunk.token_ids,
                    chunk.logprobs,
                    top,
                    renderer.decode,
                    text_offset=next_offset.get(key, 0),
                )
                if body.stream and logprobs["tokens"]:
                    next_offset[key] = logprobs["text_offset"][-1] + len(
                        logprobs["tokens"][-1]
                    )
            return {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": [
                    {
                        # vLLM's numbering: each prompt's n choices in turn
                        "index": index * n + chunk.index,
                        "text": chunk.text,
                        "logprobs": logprobs,
                        "finish_reason": chunk.finish_reason,
                    }
                ],
            }

        if body.stream:
            return await _sse(dispatcher, jobs, chunk_json, body.include_usage())
        finals = await _generate_all(dispatcher, jobs)
        payload = chunk_json(0, finals[0][0])
        payload["choices"] = [
            chunk_json(i, choice)["choices"][0]
            for i, (chunk, _) in enumerate(finals)
            for choice in _choices(chunk)
        ]
        payload["usage"] = _usage([c for chunk, _ in finals for c in _choices(chunk)])
        return JSONResponse(payload, headers=_load_headers(finals))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        salt = salts.salt(request_principal(http), body.cache_salt)
        dispatcher = await dispatcher_for(body)
        options = await _options(dispatcher, body, body.token_budget())
        top = options.get("logprobs")
        renderer = dispatcher.renderer
        messages = [message.plain() for message in body.messages]
        token_ids = await asyncio.to_thread(
            _chat_ids,
            renderer,
            messages,
            dispatcher.deployment.max_model_len,
            body.chat_template_kwargs,
        )
        budget_param = (
            "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        )
        request = _generation_request(
            dispatcher,
            "chatcmpl",
            token_ids,
            body,
            body.token_budget(),
            budget_param,
            cache_salt=salt,
            options=options,
        )
        created = int(time.time())
        started: set[int] = set()  # the choices whose role went out

        def logprobs_json(chunk: GenerationChunk) -> dict[str, Any] | None:
            if top is None or chunk.logprobs is None:
                return None
            return chat_logprobs(chunk.token_ids, chunk.logprobs, top, renderer.decode)

        def chunk_json(index: int, chunk: GenerationChunk) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": chunk.text}
            if chunk.index not in started:
                delta = {"role": "assistant"} | delta
                started.add(chunk.index)
            return {
                "id": request.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [
                    {
                        "index": chunk.index,
                        "delta": delta,
                        "logprobs": logprobs_json(chunk),
                        "finish_reason": chunk.finish_reason,
                    }
                ],
            }

        jobs = [_Job(0, request)]
        if body.stream:
            return await _sse(dispatcher, jobs, chunk_json, body.include_usage())
        finals = await _generate_all(dispatcher, jobs)
        choices = _choices(finals[0][0])
        payload = {
            "id": request.request_id,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [
                {
                    "index": choice.index,
                    "message": {"role": "assistant", "content": choice.text},
                    "logprobs": logprobs_json(choice),
                    "finish_reason": choice.finish_reason,
                }
                for choice in choices
            ],
            "usage": _usage(choices),
        }
        return JSONResponse(payload, headers=_load_headers(finals))


async def _options(
    dispatcher: ReplicaDispatcher, body: Any, max_tokens: int | None
) -> dict[str, Any]:
    """The ``SamplingParams`` arguments vLLM maps the request's delegated fields
    to (``vllm_sampling.py``); checked before the prompt is tokenised, as vLLM
    checks them. In a thread the first time: it imports vLLM's request models."""
    fields = body.delegated()
    if not fields:
        return {}
    return await asyncio.to_thread(
        sampling_options,
        body._KIND,
        fields,
        max_tokens,
        dispatcher.sampling_defaults,
        body.classic(),
    )


def _chat_ids(
    renderer: Any,
    messages: list[dict[str, Any]],
    context: int | None,
    template_kwargs: dict[str, Any] | None,
) -> list[int]:
    if template_kwargs:
        return list(
            renderer.chat_ids(messages, context, template_kwargs=template_kwargs)
        )
    # without arguments as before (stand-ins of the renderer take none)
    return list(renderer.chat_ids(messages, context))


def _choices(chunk: GenerationChunk) -> list[GenerationChunk]:
    """A non-streamed request's choices (n of them), in order."""
    return [chunk, *chunk.more]


def _generation_request(
    dispatcher: ReplicaDispatcher,
    prefix: str,
    token_ids: list[int],
    body: Any,
    max_tokens: int | None,
    max_tokens_param: str,
    cache_salt: str | None = None,
    options: dict[str, Any] | None = None,
) -> GenerationRequest:
    """The request for one prompt, once it is known to fit the model, served
    under ``cache_salt`` (``tenancy.py``)."""
    deployment = dispatcher.deployment
    vocab = deployment.vocab_size
    limits = ModelLimits(
        max_model_len=deployment.max_model_len,
        # vLLM's rule: an id is valid below the larger of the two (0: unknown).
        vocab_size=max(vocab, dispatcher.renderer.vocab_size) if vocab else 0,
    )
    prompt_param = "messages" if prefix == "chatcmpl" else "prompt"
    limits.check(
        token_ids,
        max_tokens,
        prompt_param=prompt_param,
        max_tokens_param=max_tokens_param,
    )
    stop = body.stop_list()
    for index, text in enumerate(stop):
        # the replica's engine could not encode it either, and would fail late
        check_text(text, "stop" if isinstance(body.stop, str) else f"stop[{index}]")
    sampling = resolve(body.sampling(), dispatcher.sampling_defaults)
    return GenerationRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_token_ids=tuple(token_ids),
        max_tokens=max_tokens,
        temperature=float(sampling["temperature"]),
        top_p=float(sampling["top_p"]),
        top_k=int(sampling["top_k"]),
        min_p=float(sampling["min_p"]),
        repetition_penalty=float(sampling["repetition_penalty"]),
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
        cache_salt=cache_salt,
        options=options or {},
    )


async def _generate_all(
    dispatcher: ReplicaDispatcher, jobs: Sequence[_Job]
) -> list[tuple[GenerationChunk, int]]:
    """Each job's whole output and the rank that produced it, run concurrently."""

    async def one(job: _Job) -> tuple[GenerationChunk, int]:
        route = await dispatcher.route(
            job.request.prompt_token_ids, job.request.cache_salt
        )
        try:
            return await dispatcher.serve(route, job.request)
        except Exception as error:
            if is_request_error(error):  # vLLM's own request validation
                raise _invalid(error) from None
            raise

    return list(await asyncio.gather(*(one(job) for job in jobs)))


def _invalid(error: BaseException) -> InvalidRequest:
    """A replica's refusal of a request (``is_request_error``) as our 400, in
    the words vLLM's server answers with, naming the field where vLLM did."""
    if isinstance(error, ValueError | TypeError | OverflowError):
        message = error_message(error)
    else:  # vLLM's client errors: their text says which parameter, as vLLM's does
        message = str(error)
    param = getattr(error, "parameter", None) or getattr(error, "param", None)
    return InvalidRequest(message, param)


class _Opened:
    """A job's stream whose first chunk already arrived."""

    def __init__(
        self,
        index: int,
        first: tuple[GenerationChunk, int] | None,
        rest: AsyncGenerator[tuple[GenerationChunk, int], None],
    ) -> None:
        self.index = index
        self.first = first
        self.rest = rest


async def _open(dispatcher: ReplicaDispatcher, job: _Job) -> _Opened:
    """Start ``job``'s stream and wait for its first chunk: a refusal before any
    output is still an HTTP error (400 for vLLM's validation, 503 when no replica
    can serve). A replica failing before its first chunk is replaced once
    (``stream_served``)."""
    route = await dispatcher.route(job.request.prompt_token_ids, job.request.cache_salt)
    stream = dispatcher.stream_served(route, job.request)
    try:
        first = await anext(stream, None)
    except BaseException as error:
        await stream.aclose()
        if is_request_error(error):
            raise _invalid(error) from None
        raise
    return _Opened(job.index, first, stream)


async def _sse(
    dispatcher: ReplicaDispatcher,
    jobs: Sequence[_Job],
    to_json: ToJson,
    include_usage: bool,
) -> StreamingResponse:
    opened: list[_Opened] = []
    try:
        for job in jobs:
            opened.append(await _open(dispatcher, job))
    except BaseException:
        for stream in opened:
            await stream.rest.aclose()
        raise
    ranks = [str(o.first[1]) if o.first else "" for o in opened]
    headers = {REPLICA_HEADER: ",".join(ranks)}
    request_id = jobs[0].request.request_id
    return StreamingResponse(
        _events(opened, to_json, include_usage, request_id),
        media_type="text/event-stream",
        headers=headers,
    )


async def _events(
    opened: Sequence[_Opened], to_json: ToJson, include_usage: bool, request_id: str
) -> AsyncIterator[str]:
    """The SSE events of all streams, interleaved as their chunks arrive."""
    queue: asyncio.Queue[tuple[int, GenerationChunk | None, Exception | None]] = (
        asyncio.Queue()
    )

    async def pump(stream: _Opened) -> None:
        try:
            if stream.first is not None:
                queue.put_nowait((stream.index, stream.first[0], None))
            async for chunk, _ in stream.rest:
                queue.put_nowait((stream.index, chunk, None))
            queue.put_nowait((stream.index, None, None))
        except Exception as error:  # reported in-band: the 200 is sent
            queue.put_nowait((stream.index, None, error))

    tasks = [asyncio.create_task(pump(stream)) for stream in opened]
    last: dict[ChoiceKey, GenerationChunk] = {}
    try:
        running = len(tasks)
        while running:
            index, chunk, error = await queue.get()
            if error is not None:
                logger.error("stream %s failed: %r", request_id, error)
                payload = {
                    "error": {"message": error_message(error), "type": "server_error"}
                }
                yield f"data: {json.dumps(payload)}\n\n"
                return
            if chunk is None:
                running -= 1
                continue
            last[index, chunk.index] = chunk
            yield f"data: {json.dumps(to_json(index, chunk))}\n\n"
    finally:
        # Cancelling a pump closes its stream, which aborts the request on the
        # replica (a client gone, or another prompt's stream failed).
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if include_usage and last:
        # OpenAI's stream_options.include_usage: one last chunk, no choices.
        some = next(iter(last.values()))
        final = to_json(
            0, dataclasses.replace(some, text="", token_ids=(), logprobs=None)
        )
        final["choices"] = []
        final["usage"] = _usage([last[key] for key in sorted(last)])
        yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"


def _usage(chunks: Sequence[GenerationChunk]) -> dict[str, Any]:
    """Usage of a request's final chunks (one per choice of each prompt),
    summed; a prompt's tokens count once, whatever its number of choices."""
    prompts = [chunk for chunk in chunks if chunk.index == 0]
    prompt = sum(chunk.prompt_tokens for chunk in prompts)
    completion = sum(chunk.completion_tokens for chunk in chunks)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    cached = [chunk.cached_prompt_tokens for chunk in prompts]
    if all(tokens is not None for tokens in cached):
        usage["prompt_tokens_details"] = {
            "cached_tokens": sum(t for t in cached if t is not None)
        }
    return usage


def _load_headers(finals: Sequence[tuple[GenerationChunk, int]]) -> dict[str, str]:
    """Who served a finished request and what Xavier loaded for it."""
    headers = {
        REPLICA_HEADER: ",".join(str(rank) for _, rank in finals),
        EXTERNAL_TOKENS_HEADER: str(sum(c.external_prompt_tokens for c, _ in finals)),
    }
    holders = {c.external_holder_rank for c, _ in finals} - {None}
    if len(finals) == 1 and holders:
        headers[HOLDER_HEADER] = str(holders.pop())
    return headers
