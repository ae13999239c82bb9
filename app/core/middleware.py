"""ASGI middleware shared by kvmesh's HTTP services.

``BodyLimit`` refuses a request body over ``max_bytes`` with 413, in OpenAI's error shape: at
once when its Content-Length says so (a Content-Length that is not a number is a 400), else as
soon as the bytes received pass the limit while the body streams in (chunked uploads). The
framework's handler answers that 413 when the framework reads the body; when something else
read it (a middleware such as the router's fast path) and let the error through, ``BodyLimit``
answers it itself, so it never becomes a 500.
"""

from __future__ import annotations

import orjson
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodyLimit", "error_body"]


def error_body(
    message: str, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, object]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _BodyTooLarge(HTTPException):
    """The body passed the limit while it streamed in (an HTTPException, so that the
    framework's own handler answers it when the framework is the one reading)."""


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    await _reply(send, 400, "Content-Length is not a number")
                    return
                if int(value) > self.max_bytes:
                    await _reply(send, 413, self._too_large())
                    return
                break
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the framework's body reading, which lets HTTPException
                    # through to the app's handler (any other error becomes a 400 there).
                    raise _BodyTooLarge(413, self._too_large())
            return message

        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except _BodyTooLarge:
            if started:
                raise
            await _reply(send, 413, self._too_large())


async def _reply(send: Send, status: int, message: str) -> None:
    body = orjson.dumps(error_body(message, "invalid_request_error"))
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
