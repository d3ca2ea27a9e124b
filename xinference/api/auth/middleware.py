"""The check in front of every route: a pure ASGI middleware, so it covers the
whole route table (FastAPI's own docs routes and mounted static files included),
not only the routes that remember to ask."""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.routing import Match

from .permissions import is_public, required_permission
from .service import AuthService, Forbidden, Unauthorized

logger = logging.getLogger(__name__)


class AuthMiddleware:
    def __init__(self, app: Any, service: AuthService) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.service.enabled:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        template = route_template(scope)
        if template is not None and is_public(method, template):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        try:
            principal = self.service.authenticate(authorization)
            if template is not None:  # an unknown path falls through to 404
                self.service.authorize(principal, required_permission(method, template))
        except Unauthorized as error:
            await _refuse(send, 401, str(error), {"www-authenticate": "Bearer"})
            return
        except Forbidden as error:
            await _refuse(send, 403, str(error), {})
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


def route_template(scope: Any) -> str | None:
    """The declared path of the route a request reaches (``/v1/models/{model_uid}``,
    ``/web`` for the mount), or None for a path no route has."""
    partial = None
    for route in scope["app"].router.routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return str(route.path)
        if match == Match.PARTIAL and partial is None:
            partial = str(route.path)  # the path exists, not for this method
    return partial


async def _refuse(send: Any, status: int, message: str, extra: dict[str, str]) -> None:
    body = json.dumps({"detail": message}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ] + [(name.encode(), value.encode()) for name, value in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
