"""The REST API: model management plus OpenAI-compatible serving and /metrics.

    POST   /v1/models                 launch (options as in ``LaunchRequest``);
                                      ``?wait_ready=false`` returns at once
    GET    /v1/models                 OpenAI model list, with each model's state
    GET    /v1/models/{uid}           one model: state, replicas, Xavier settings
    GET    /v1/models/{uid}/progress  launch progress (``progress``: 0..1, as upstream)
    POST   /v1/models/{uid}/cancel    stop a launch in progress and tear it down
    GET    /v1/models/{uid}/replicas  each replica's own report (from its process)
    GET    /v1/models/{uid}/stats     each replica's counters and Xavier stats (JSON)
    POST   /v1/models/{uid}/prefix    who holds the longest cached prefix of a prompt
    DELETE /v1/models/{uid}           terminate (or cancel a launch: it answers 409);
                                      returns the final Xavier counters
    POST   /v1/completions            OpenAI completions, streamed (SSE) or not
    POST   /v1/chat/completions       OpenAI chat completions, streamed (SSE) or not
    GET    /v1/address                the supervisor's xoscar address (workers
                                      started with -e find it here)
    GET    /v1/workers                the registered workers and their replicas
    GET    /metrics                   Prometheus text, per replica
    GET    /                          the web page (``web/``, static files under /web)

The app talks to the supervisor for management and to the replicas (through
``ReplicaDispatcher``) for serving. A response served by a replica names it in the
``X-Xinference-Replica`` header; a non-streamed one also says in
``X-Xinference-Xavier-External-Tokens`` how many prompt tokens Xavier loaded from
another replica, and from which in ``X-Xinference-Xavier-Holder`` (when it did).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import xoscar as xo
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from ..core.dispatch import ReplicaDispatcher, ReplicaUnavailable, Route
from ..core.messages import (
    DeploymentInfo,
    GenerationChunk,
    GenerationRequest,
    ServiceUnavailable,
)
from ..core.metrics import CONTENT_TYPE, ReplicaSample, render
from ..core.options import LaunchOptionError
from ..core.supervisor import LaunchCancelled, SupervisorActor
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    LaunchRequest,
    PrefixRequest,
)

logger = logging.getLogger(__name__)

REPLICA_HEADER = "X-Xinference-Replica"
EXTERNAL_TOKENS_HEADER = "X-Xinference-Xavier-External-Tokens"
HOLDER_HEADER = "X-Xinference-Xavier-Holder"
WEB_DIR = Path(__file__).resolve().parent / "web"
# How often a dispatcher asks the supervisor which replicas are gone (at most).
GONE_REFRESH_S = 1.0


class ModelHub:
    """The front end's dispatchers, one per ready model, built on first use.

    Every terminate goes through this API, which forgets the model's dispatcher;
    a replica that vanished otherwise surfaces as ``ActorNotExist`` and the
    dispatcher is dropped then.
    """

    def __init__(self, supervisor: Any) -> None:
        self.supervisor = supervisor
        self._dispatchers: dict[str, ReplicaDispatcher] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, model_uid: str) -> ReplicaDispatcher:
        dispatcher = self._dispatchers.get(model_uid)
        if dispatcher is not None:
            if time.monotonic() - dispatcher.gone_checked > GONE_REFRESH_S:
                # gone (worker lost, engine or process dead) and unresponsive
                dispatcher.update_states(
                    await self.supervisor.replica_states(model_uid)
                )
            return dispatcher
        async with self._locks.setdefault(model_uid, asyncio.Lock()):
            dispatcher = self._dispatchers.get(model_uid)
            if dispatcher is None:
                deployment = await self.supervisor.describe_model(model_uid)
                dispatcher = await ReplicaDispatcher.connect(deployment)
                self._dispatchers[model_uid] = dispatcher
        return dispatcher

    def peek(self, model_uid: str) -> ReplicaDispatcher | None:
        return self._dispatchers.get(model_uid)

    def forget(self, model_uid: str) -> None:
        self._dispatchers.pop(model_uid, None)


def create_app(supervisor_address: str) -> FastAPI:
    """The FastAPI app for the supervisor at ``supervisor_address``."""
    app = FastAPI(title="Xinference", version="0.1.0")
    hub_cell: list[ModelHub] = []

    async def hub() -> ModelHub:
        if not hub_cell:
            supervisor = await xo.actor_ref(
                address=supervisor_address, uid=SupervisorActor.default_uid()
            )
            hub_cell.append(ModelHub(supervisor))
        return hub_cell[0]

    @app.exception_handler(LaunchOptionError)
    async def _bad_option(_: Request, error: LaunchOptionError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=400)

    @app.exception_handler(InvalidRequest)
    async def _invalid_request(_: Request, error: InvalidRequest) -> JSONResponse:
        # OpenAI's error shape (its clients read error.message) plus "detail",
        # which upstream Xinference's client reads.
        message = str(error)
        body = {
            "detail": message,
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": error.param,
                "code": None,
            },
        }
        return JSONResponse(body, status_code=400)

    @app.exception_handler(LaunchCancelled)
    async def _cancelled(_: Request, error: LaunchCancelled) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=409)

    async def _unavailable(_: Request, error: Exception) -> JSONResponse:
        # A replica died under the request, or none can serve: the model's other
        # replicas (if any) keep serving, so the client may retry.
        message = str(error)
        body = {
            "detail": message,
            "error": {"message": message, "type": "server_error", "code": 503},
        }
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    app.add_exception_handler(ServiceUnavailable, _unavailable)
    app.add_exception_handler(ReplicaUnavailable, _unavailable)

    @app.exception_handler(LookupError)
    async def _not_found(_: Request, error: LookupError) -> JSONResponse:
        return JSONResponse({"detail": _message(error)}, status_code=404)

    @app.exception_handler(Exception)
    async def _failed(_: Request, error: Exception) -> JSONResponse:
        logger.error("request failed: %r", error)
        return JSONResponse({"detail": _message(error)}, status_code=500)

    @app.get("/status")
    async def status() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/v1/address")
    async def address() -> dict[str, Any]:
        return {"address": supervisor_address}

    @app.get("/v1/workers")
    async def workers() -> list[dict[str, Any]]:
        models = await hub()
        return list(await models.supervisor.list_workers())

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")

    # ---- management ---------------------------------------------------------------

    @app.post("/v1/models")
    async def launch(body: LaunchRequest, wait_ready: bool = True) -> dict[str, Any]:
        models = await hub()
        launched = await models.supervisor.launch_model(body.model_dump(), wait_ready)
        if isinstance(launched, str):  # not waited for: only the uid is known yet
            return {"model_uid": launched}
        return _deployment_json(launched)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        models = await hub()
        progress = await models.supervisor.list_models()
        ready = {d.model_uid: d for d in await models.supervisor.describe_models()}
        data = []
        for item in progress:
            deployment = ready.get(item.model_uid)
            entry: dict[str, Any] = {
                "id": item.model_uid,
                "object": "model",
                "created": int(deployment.created) if deployment else 0,
                "owned_by": "xinference",
                "status": item.state,
                "replica": item.replicas_total,
                "replicas_ready": item.replicas_ready,
            }
            if item.state == "degraded":  # which replicas do not serve, and why
                entry["detail"] = item.detail
            if deployment is not None:
                entry |= _upstream_description(deployment)
                entry["xavier"] = deployment.xavier_description
                entry["router"] = deployment.router.kind
                entry["replicas"] = _replica_states(deployment)
            data.append(entry)
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_uid}")
    async def describe(model_uid: str) -> dict[str, Any]:
        models = await hub()
        return _deployment_json(await models.supervisor.describe_model(model_uid))

    @app.get("/v1/models/{model_uid}/progress")
    async def progress(model_uid: str) -> dict[str, Any]:
        models = await hub()
        state = await models.supervisor.progress(model_uid)
        # Upstream's key: a fraction, 1.0 only once every replica serves; while
        # launching, the share of its steps done (engines loaded included).
        done = 1.0 if state.state == "ready" else 0.0
        if state.state == "launching":
            done = min(state.fraction, 0.99)
        return {"progress": round(done, 3)} | dataclasses.asdict(state)

    @app.post("/v1/models/{model_uid}/cancel")
    async def cancel(model_uid: str) -> dict[str, Any]:
        models = await hub()
        models.forget(model_uid)
        await models.supervisor.cancel_launch(model_uid)
        return {"model_uid": model_uid, "cancelled": True}

    @app.get("/v1/models/{model_uid}/replicas")
    async def replicas(model_uid: str) -> list[dict[str, Any]]:
        models = await hub()
        reports = await models.supervisor.report_replicas(model_uid)
        return [_report_json(report) for report in reports]

    @app.get("/v1/models/{model_uid}/stats")
    async def stats(model_uid: str) -> list[dict[str, Any]]:
        """Each replica's serving counters and Xavier stats, as ``/metrics`` has
        them, in JSON (``xavier`` is None with Xavier off)."""
        models = await hub()
        reports = await models.supervisor.collect_stats(model_uid)
        return [dataclasses.asdict(replica) for replica in reports]

    @app.post("/v1/models/{model_uid}/prefix")
    async def prefix(model_uid: str, body: PrefixRequest) -> dict[str, Any]:
        """Which replica holds the longest published prefix of a prompt (Xavier's
        block tracker, as the cache-aware router sees it)."""
        dispatcher = await (await hub()).get(model_uid)
        if body.messages is not None:
            messages = [message.plain() for message in body.messages]
            token_ids = await asyncio.to_thread(dispatcher.renderer.chat_ids, messages)
        else:
            token_ids = await asyncio.to_thread(
                dispatcher.renderer.completion_ids, body.prompt or ""
            )
        holder, blocks = await dispatcher.longest_prefix(token_ids)
        return {
            "holder": holder,
            "prefix_blocks": blocks,
            "prefix_tokens": blocks * dispatcher.deployment.block_size,
            "prompt_tokens": len(token_ids),
        }

    @app.delete("/v1/models/{model_uid}")
    async def terminate(model_uid: str) -> dict[str, Any]:
        models = await hub()
        models.forget(model_uid)
        counters = await models.supervisor.terminate_model(model_uid)
        return {
            "model_uid": model_uid,
            "xavier_counters": {str(rank): stats for rank, stats in counters.items()},
        }

    # ---- serving ------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        dispatcher = await _dispatcher(await hub(), body)
        # Tokenising a long prompt takes a while: not on the event loop.
        token_ids = await asyncio.to_thread(
            dispatcher.renderer.completion_ids, body.prompt
        )
        request = _generation_request("cmpl", token_ids, body, body.max_tokens)
        route = await dispatcher.route(token_ids)
        headers = {REPLICA_HEADER: str(route.rank)}
        created = int(time.time())

        def chunk_json(chunk: GenerationChunk) -> dict[str, Any]:
            return {
                "id": request.request_id,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": [
                    {
                        "index": 0,
                        "text": chunk.text,
                        "logprobs": None,
                        "finish_reason": chunk.finish_reason,
                    }
                ],
            }

        if body.stream:
            return _sse(
                dispatcher, route, request, chunk_json, headers, body.include_usage()
            )
        chunk, rank = await _generate(dispatcher, route, request)
        payload = chunk_json(chunk) | {"usage": _usage(chunk)}
        headers[REPLICA_HEADER] = str(rank)
        return JSONResponse(payload, headers=headers | _load_headers(chunk))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        dispatcher = await _dispatcher(await hub(), body)
        messages = [message.plain() for message in body.messages]
        token_ids = await asyncio.to_thread(dispatcher.renderer.chat_ids, messages)
        request = _generation_request("chatcmpl", token_ids, body, body.token_budget())
        route = await dispatcher.route(token_ids)
        headers = {REPLICA_HEADER: str(route.rank)}
        created = int(time.time())
        first = [True]

        def chunk_json(chunk: GenerationChunk) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": chunk.text}
            if first[0]:
                delta = {"role": "assistant"} | delta
                first[0] = False
            return {
                "id": request.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [
                    {"index": 0, "delta": delta, "finish_reason": chunk.finish_reason}
                ],
            }

        if body.stream:
            return _sse(
                dispatcher, route, request, chunk_json, headers, body.include_usage()
            )
        chunk, rank = await _generate(dispatcher, route, request)
        headers[REPLICA_HEADER] = str(rank)
        payload = {
            "id": request.request_id,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": chunk.text},
                    "finish_reason": chunk.finish_reason,
                }
            ],
            "usage": _usage(chunk),
        }
        return JSONResponse(payload, headers=headers | _load_headers(chunk))

    # ---- metrics ------------------------------------------------------------------

    @app.get("/metrics")
    async def metrics() -> Response:
        models = await hub()
        samples: list[ReplicaSample] = []
        for deployment in await models.supervisor.describe_models():
            uid = deployment.model_uid
            dispatcher = models.peek(uid)
            addresses = {
                replica.rank: replica.address for replica in deployment.replicas
            }
            for stats in await models.supervisor.collect_stats(uid):
                rank = stats.rank
                samples.append(
                    ReplicaSample(
                        stats=stats,
                        routing=(
                            None if dispatcher is None else dispatcher.counters[rank]
                        ),
                        latency=(
                            None if dispatcher is None else dispatcher.latency[rank]
                        ),
                        address=addresses.get(rank, ""),
                    )
                )
        return Response(render(samples), media_type=CONTENT_TYPE)

    return app


async def _dispatcher(models: ModelHub, body: Any) -> ReplicaDispatcher:
    refused = body.refused()
    if refused:
        raise InvalidRequest(
            f"unsupported parameter(s): {', '.join(refused)} "
            "(this server cannot honour them; only n=1 is served)",
            param=refused[0],
        )
    return await models.get(body.model)


class InvalidRequest(ValueError):
    """A serving request the server cannot honour; ``param`` names the culprit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _generation_request(
    prefix: str, token_ids: list[int], body: Any, max_tokens: int | None
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_token_ids=tuple(token_ids),
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
    )


async def _generate(
    dispatcher: ReplicaDispatcher, route: Route, request: GenerationRequest
) -> tuple[GenerationChunk, int]:
    try:
        return await dispatcher.serve(route, request)
    except ValueError as error:  # vLLM's request validation (too long, ...)
        raise InvalidRequest(_message(error)) from None


def _sse(
    dispatcher: ReplicaDispatcher,
    route: Route,
    request: GenerationRequest,
    to_json: Callable[[GenerationChunk], dict[str, Any]],
    headers: dict[str, str],
    include_usage: bool,
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        last: GenerationChunk | None = None
        try:
            # A replica that fails before the first chunk is replaced once; the
            # replica header (sent first) then names the one that failed.
            async for chunk, _ in dispatcher.stream_served(route, request):
                last = chunk
                yield f"data: {json.dumps(to_json(chunk))}\n\n"
        except Exception as error:  # the status line is sent: report in-band
            logger.exception("stream %s failed", request.request_id)
            payload = {"error": {"message": _message(error), "type": "server_error"}}
            yield f"data: {json.dumps(payload)}\n\n"
            return
        if include_usage and last is not None:
            # OpenAI's stream_options.include_usage: one last chunk, no choices.
            final = to_json(dataclasses.replace(last, text="", token_ids=()))
            final["choices"] = []
            final["usage"] = _usage(last)
            yield f"data: {json.dumps(final)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


def _usage(chunk: GenerationChunk) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "total_tokens": chunk.prompt_tokens + chunk.completion_tokens,
    }
    if chunk.cached_prompt_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": chunk.cached_prompt_tokens}
    return usage


def _load_headers(chunk: GenerationChunk) -> dict[str, str]:
    """What Xavier loaded for a finished request, as response headers."""
    headers = {EXTERNAL_TOKENS_HEADER: str(chunk.external_prompt_tokens)}
    if chunk.external_holder_rank is not None:
        headers[HOLDER_HEADER] = str(chunk.external_holder_rank)
    return headers


def _upstream_description(deployment: DeploymentInfo) -> dict[str, Any]:
    """The keys upstream Xinference's client and CLI read from a model's
    description (its client picks the chat handle by ``model_ability``)."""
    return {
        "model_type": "LLM",
        "model_name": deployment.model_name,
        "model_engine": deployment.model_engine,
        "model_ability": ["generate", "chat"],
        "model_format": None,  # vLLM reads it from the model directory
        "model_size_in_billions": None,
        "quantization": deployment.quantization,
        "replica": len(deployment.replicas),
    }


def _deployment_json(deployment: DeploymentInfo) -> dict[str, Any]:
    return _upstream_description(deployment) | {
        "model_uid": deployment.model_uid,
        "model_path": deployment.model_path,
        "model_engine": deployment.model_engine,
        "xavier": deployment.xavier_description,
        "xavier_enabled": deployment.xavier_enabled,
        "router": dataclasses.asdict(deployment.router),
        "replicas": [
            dataclasses.asdict(replica)
            | {"state": deployment.replica_state(replica.rank)}
            for replica in deployment.replicas
        ],
        "gone": {str(rank): why for rank, why in deployment.gone.items()},
    }


def _replica_states(deployment: DeploymentInfo) -> list[dict[str, Any]]:
    """Where each replica runs and whether it serves (``xinference list``)."""
    return [
        {
            "rank": replica.rank,
            "worker": replica.worker,
            "address": replica.address,
            "state": (
                "gone"
                if replica.rank in deployment.gone
                else (
                    "unresponsive"
                    if replica.rank in deployment.unresponsive
                    else "ready"
                )
            ),
            "reason": deployment.gone.get(
                replica.rank, deployment.unresponsive.get(replica.rank)
            ),
        }
        for replica in deployment.replicas
    ]


def _report_json(report: Any) -> dict[str, Any]:
    data = dataclasses.asdict(report)
    # XavierReplicaSettings is slotted and nested: give it the connector's dict shape.
    data["xavier"] = None if report.xavier is None else report.xavier.to_dict()
    return data


def _message(error: BaseException) -> str:
    # KeyError/LookupError str() adds quotes; the first argument reads better.
    return str(error.args[0]) if error.args else repr(error)
