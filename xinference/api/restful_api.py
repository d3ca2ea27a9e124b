"""The REST API: model management plus OpenAI-compatible serving and /metrics.

    POST   /v1/models                 launch (options as in ``LaunchRequest``);
                                      ``?wait_ready=false`` returns at once
    GET    /v1/models                 OpenAI model list, with each model's state
    GET    /v1/models/{uid}           one model: state, replicas, Xavier settings
    GET    /v1/models/{uid}/progress  launch progress (``progress``: 0..1, as upstream)
    POST   /v1/models/{uid}/cancel    stop a launch in progress and tear it down
    GET    /v1/models/{uid}/replicas  each replica's own report (from its process)
    GET    /v1/models/{uid}/stats     each replica's counters and Xavier stats (JSON)
    GET    /v1/model_registrations/LLM  the model names a launch takes
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
    GET    /status                    liveness: {"ok": true} (HEAD / and HEAD /status
                                      answer as GET, without a body)

Authentication (``auth/``: /token, /v1/cluster/auth, /v1/admin/...) checks every
route's permission in a middleware; it is off unless ``create_app`` gets an
enabled ``AuthService``. A request body over the server's limit is a 413 before
any route reads it (``body_limit.py``; ``ServerOptions.max_request_bytes``).

The app talks to the supervisor for management and to the replicas (through
``ReplicaDispatcher``) for serving (``serving.py``: the OpenAI routes and their
response headers). Every error is a JSON body on a connection kept open
(``errors.py``: which status for which error).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import xoscar as xo
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from ..core.dispatch import ReplicaDispatcher
from ..core.messages import DeploymentInfo, ReplicaStats
from ..core.metrics import CONTENT_TYPE, ReplicaSample, render
from ..core.registry import registered_models
from ..core.supervisor import SupervisorActor
from .auth import AuthMiddleware, AuthService, auth_router
from .body_limit import BodyLimit
from .errors import InvalidRequest, install_error_handlers
from .schemas import LaunchRequest, PrefixRequest
from .server_options import ServerOptions
from .serving import add_serving_routes
from .tenancy import SaltPolicy, request_principal
from .tokenize_routes import add_tokenize_routes

logger = logging.getLogger(__name__)

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


def create_app(
    supervisor_address: str,
    auth: AuthService | None = None,
    options: ServerOptions | None = None,
) -> FastAPI:
    """The FastAPI app for the supervisor at ``supervisor_address`` (open unless
    ``auth`` is an enabled service; ``options``: the operator's, else defaults)."""
    options = options or ServerOptions()
    app = FastAPI(title="Xinference", version="0.1.0")
    # ---- authentication (auth/): every route, including those below ---------------
    auth = auth or AuthService.disabled()
    app.add_middleware(AuthMiddleware, service=auth)
    # Outside the authentication check (a middleware added later wraps the ones
    # before it): no body beyond the limit is read, whoever sends it.
    app.add_middleware(BodyLimit, max_bytes=options.max_request_bytes)
    app.include_router(auth_router(auth))
    hub_cell: list[ModelHub] = []

    async def hub() -> ModelHub:
        if not hub_cell:
            supervisor = await xo.actor_ref(
                address=supervisor_address, uid=SupervisorActor.default_uid()
            )
            hub_cell.append(ModelHub(supervisor))
        return hub_cell[0]

    install_error_handlers(app)
    salts = SaltPolicy(options.kv_sharing)
    add_serving_routes(app, lambda body: _dispatcher(hub, body), salts)
    add_tokenize_routes(app, lambda body: _dispatcher(hub, body))

    # HEAD answers as GET does (probes and link checkers send it), out of the
    # OpenAPI description, where it would repeat the GET operation
    @app.get("/status")
    @app.head("/status", include_in_schema=False)
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
    @app.head("/", include_in_schema=False)
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

    @app.get("/v1/model_registrations/{model_type}")
    async def model_registrations(model_type: str) -> list[dict[str, Any]]:
        """The model names a launch takes (``model_name``), as upstream's route
        lists its registrations: the built-in offline models and the entries of
        ``$XINFERENCE_HOME/models.json``. Only LLMs are served here."""
        if model_type != "LLM":
            raise LookupError(f"no {model_type!r} models here: only 'LLM' is served")
        known = await asyncio.to_thread(registered_models)
        return [
            {
                "model_name": name,
                "is_builtin": model.build is not None,
                "description": model.description,
            }
            for name, model in sorted(known.items())
        ]

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
        return [replica_stats_json(replica) for replica in reports]

    @app.post("/v1/models/{model_uid}/prefix")
    async def prefix(
        model_uid: str, body: PrefixRequest, request: Request
    ) -> dict[str, Any]:
        """Which replica holds the longest published prefix of a prompt (Xavier's
        block tracker, as the cache-aware router sees it), under the salt the
        same prompt would be served under: no caller looks up another tenant's
        prefixes. With ``after_blocks``, the longest run from that block on, as a
        replica that has the blocks before it looks it up (``prefix_blocks``
        counts those too)."""
        salt = salts.salt(request_principal(request), body.cache_salt)
        dispatcher = await (await hub()).get(model_uid)
        # No prompt that cannot fit is looked up: it could never have been served.
        context = dispatcher.deployment.max_model_len
        if body.messages is not None:
            messages = [message.plain() for message in body.messages]
            token_ids = await asyncio.to_thread(
                dispatcher.renderer.chat_ids, messages, context
            )
        else:
            token_ids = await asyncio.to_thread(
                dispatcher.renderer.completion_ids, body.prompt or "", context
            )
        holder, blocks = await dispatcher.longest_prefix(
            token_ids, salt, body.after_blocks
        )
        return {
            "holder": holder,
            "prefix_blocks": blocks,
            "prefix_tokens": blocks * dispatcher.deployment.block_size,
            "prompt_tokens": len(token_ids),
            "after_blocks": body.after_blocks,
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


async def _dispatcher(
    hub: Callable[[], Awaitable[ModelHub]], body: Any
) -> ReplicaDispatcher:
    refused = body.refused()
    if refused:
        raise InvalidRequest(
            f"unsupported parameter(s): {', '.join(refused)} "
            "(this server cannot honour them yet; see the parity table in "
            "docs/user-guide.md)",
            param=refused[0],
        )
    return await (await hub()).get(body.model)


def replica_stats_json(replica: ReplicaStats) -> dict[str, Any]:
    """A replica's stats as JSON, each ``XavierStats`` with its ``totals`` (both
    tiers and both load paths summed: what the page shows)."""
    data = dataclasses.asdict(replica)
    if replica.xavier is not None:
        data["xavier"] = replica.xavier.as_dict()
    data["xavier_ranks"] = [ranks.as_dict() for ranks in replica.xavier_ranks]
    return data


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
