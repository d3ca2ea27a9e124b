"""How the REST API answers errors: always a JSON body, never a dropped connection.

Starlette sends an exception no handler claims to its outermost middleware, which
answers 500 and then re-raises it to the server; uvicorn logs "Exception in ASGI
application" and closes the keep-alive connection, so a client's next request on
it fails (``ConnectionResetError`` in upstream Xinference's client) and the openai
client silently sends the failed request again. ``JsonErrors`` catches such an
exception inside that middleware, logs it once, and answers a JSON 500 on the same
connection.

Status codes: 400 for a request the user can fix (``InvalidRequest``, a prompt the
tokenizer cannot take or the context cannot hold, a bad launch option), 404 for an
unknown model (naming the launched ones to a caller who may list them), 409 for a launch cancelled while it was awaited, 413 for a body over
the server's limit (``body_limit.py``), 503 (with Retry-After) when no replica can
serve, 500 for anything else.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..core.dispatch import ReplicaUnavailable
from ..core.messages import ModelNotLaunched, ServiceUnavailable
from ..core.options import LaunchOptionError
from ..core.prompting import PromptRefused
from ..core.supervisor import LaunchCancelled
from .auth.permissions import MODELS_LIST

logger = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """A serving request the server cannot honour; ``param`` names the culprit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ErrorResponse(JSONResponse):
    """An error's JSON with every non-ASCII character escaped. An error may quote
    the request (FastAPI's 422 echoes the input; a 404 names the model asked
    for), and a lone surrogate, valid in JSON as an escape, cannot be encoded to
    UTF-8: the error itself would fail, as a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode(
            "ascii"
        )


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (its clients read error.message) plus "detail", which
    upstream Xinference's client and FastAPI's own errors use."""
    return {
        "detail": message,
        "error": {"message": message, "type": kind, "param": param, "code": None},
    }


def error_message(error: BaseException) -> str:
    # KeyError/LookupError str() adds quotes; the first argument reads better.
    return str(error.args[0]) if error.args else repr(error)


class JsonErrors:
    """ASGI middleware: an exception that escaped every handler becomes a JSON 500
    (when no response has started; a started response, a stream, cannot change its
    status, and the streams of this API report their errors in-band)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as error:
            if started:
                raise
            logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            response = ErrorResponse(
                error_body(error_message(error), "server_error"), status_code=500
            )
            await response(scope, receive, send)


def _may_list_models(request: Request) -> bool:
    """Whether the caller may see the launched models' uids (``GET /v1/models``):
    anyone with authentication off."""
    principal = getattr(request.state, "principal", None)
    return principal is None or principal.may(MODELS_LIST)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the API can raise, answered with its status and a JSON body."""

    @app.exception_handler(LaunchOptionError)
    async def _bad_option(_: Request, error: LaunchOptionError) -> ErrorResponse:
        # error_message: one raised in a replica's process comes through xoscar,
        # whose str() puts "[address=..., pid=...]" before the message
        return ErrorResponse(
            error_body(error_message(error), "invalid_request_error"), status_code=400
        )

    @app.exception_handler(InvalidRequest)
    async def _invalid_request(_: Request, error: InvalidRequest) -> ErrorResponse:
        return ErrorResponse(
            error_body(str(error), "invalid_request_error", error.param),
            status_code=400,
        )

    @app.exception_handler(PromptRefused)
    async def _bad_prompt(_: Request, error: PromptRefused) -> ErrorResponse:
        return ErrorResponse(
            error_body(str(error), "invalid_request_error", error.param),
            status_code=400,
        )

    @app.exception_handler(LaunchCancelled)
    async def _cancelled(_: Request, error: LaunchCancelled) -> ErrorResponse:
        return ErrorResponse(error_body(str(error), "conflict"), status_code=409)

    async def _unavailable(_: Request, error: Exception) -> ErrorResponse:
        # A replica died under the request, or none can serve: the model's other
        # replicas (if any) keep serving, so the client may retry.
        return ErrorResponse(
            error_body(error_message(error), "server_error"),
            status_code=503,
            headers={"Retry-After": "1"},
        )

    app.add_exception_handler(ServiceUnavailable, _unavailable)
    app.add_exception_handler(ReplicaUnavailable, _unavailable)

    @app.exception_handler(RequestValidationError)
    async def _unparsed(_: Request, error: RequestValidationError) -> ErrorResponse:
        # FastAPI's own 422 and body, rendered so that it can quote any input
        return ErrorResponse(
            {"detail": jsonable_encoder(error.errors())}, status_code=422
        )

    @app.exception_handler(LookupError)
    async def _not_found(request: Request, error: LookupError) -> ErrorResponse:
        message = error_message(error)
        if isinstance(error, ModelNotLaunched) and _may_list_models(request):
            message = f"{message}; {error.listing()}"
        return ErrorResponse(error_body(message, "not_found_error"), status_code=404)

    app.add_middleware(JsonErrors)
