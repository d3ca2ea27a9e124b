"""The largest request body the server reads: anything larger is a 413 with a JSON
body, before any route (or the authentication check) sees it.

Without a limit a client can make the server read, parse and hold a body of any
size (the issue's 32 MB body with a junk field was accepted). A body that declares
its length is refused on its ``Content-Length`` before a byte of it is read; one
sent in chunks is counted as it arrives and refused once it passes the limit. A
body within the limit is read here whole and handed to the application as one
message, which it would have read whole anyway.
"""

from __future__ import annotations

from typing import Any

from ..model.llm.vllm.xavier.config import format_size, parse_size
from .errors import ErrorResponse, error_body

# Enough for a prompt of several million characters (a context of a million
# tokens is about four million characters of English), JSON-escaped; ``xinference-
# local`` / ``xinference-supervisor --max-request-bytes`` changes it.
DEFAULT_MAX_REQUEST_SIZE = "16MiB"
DEFAULT_MAX_REQUEST_BYTES = parse_size(DEFAULT_MAX_REQUEST_SIZE)
OPTION = "--max-request-bytes"


class BodyLimit:
    """ASGI middleware: a request body of at most ``max_bytes``, else 413."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the request size limit must be positive: {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"is {declared} bytes, over")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, "is over")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            # the body once, then the client's own messages (a disconnect ends
            # a stream the client no longer reads)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any, what: str) -> None:
        message = (
            f"the request body {what} this server's limit of {self.max_bytes} "
            f"bytes ({format_size(self.max_bytes)}; the server option {OPTION} "
            "sets it)"
        )
        response = ErrorResponse(
            error_body(message, "invalid_request_error"), status_code=413
        )
        await response(scope, receive, send)


def _content_length(scope: Any) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server itself refuses a malformed length
    return None
