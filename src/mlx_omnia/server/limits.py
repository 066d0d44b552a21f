"""The request body limit (--max-body), counted while the body is read, whatever its transfer
encoding: a body over it is refused before the rest of it is read."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_omnia.server.dialects.errors import dialect_of, error_response
from mlx_omnia.server.errors import ApiError


class BodyLimit:
    """ASGI middleware: reads a request's body up to `limit` bytes and hands it to the app whole;
    one byte more answers 413 in the dialect's shape and closes the connection (the rest is
    never read)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        parts: list[bytes] = []
        size = 0
        last: Message = {"type": "http.request", "body": b"", "more_body": False}
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app hears it
                last = message
                break
            body: bytes = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            parts.append(body)
            if not message.get("more_body", False):
                break
        first: list[Message] = [
            {"type": "http.request", "body": b"".join(parts), "more_body": False}
            if last["type"] == "http.request"
            else last
        ]

        async def replay() -> Message:
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = ApiError("too_large", f"request body over {self.limit} bytes (--max-body)")
        response = error_response(dialect_of(scope["path"]), error)
        response.headers["connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)
