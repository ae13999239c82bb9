"""Answering a hot route from uvicorn's HTTP protocol itself, without an ASGI request cycle.

A ``POST /route`` that the router answers in about 100 µs of its own cost uvicorn another
150 µs: a scope, a ``RequestResponseCycle``, a task, the middleware, and two socket writes (the
head, then the body). ``fast_protocol(app)`` is uvicorn's ``HttpToolsProtocol`` with a table of
synchronous *fast routes* (``app.state.fast_routes``: exact URL -> ``(headers, body) -> JSON
bytes or None``): a POST to one of them is buffered instead of starting a cycle, and answered
with one write when the route gives its answer. When it gives None (anything but its plain
case) or raises (logged), the request is handed to the ASGI app exactly as uvicorn would have
handed it, body included, so the two paths differ only in cost.

Only the simple case is taken: HTTP/1.1 keep-alive, a Content-Length within
``app.state.fast_max_body_bytes``, no ``Expect`` or ``Transfer-Encoding``, and no earlier
request on the connection still being answered (pipelining keeps uvicorn's order).

The protocol runs on ``app.core.http_protocol``'s joining transport, so that every other answer
(a proxied completion's head and body, say) also leaves in one write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.core.http_protocol import OneWriteHttpToolsProtocol

__all__ = ["FastRoute", "fast_protocol"]

logger = logging.getLogger(__name__)

# (the request's headers, lower-case names, as uvicorn gives them; its body) -> a 200's JSON
# body, or None: the ASGI app answers.
FastRoute = Callable[[list[tuple[bytes, bytes]], bytes], bytes | None]

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"


def fast_protocol(app: FastAPI) -> type[HttpToolsProtocol] | None:
    """uvicorn's protocol with ``app``'s fast routes, or None when it declares none."""
    routes: Mapping[bytes, FastRoute] | None = getattr(app.state, "fast_routes", None)
    if not routes:
        return None
    max_body_bytes: int = getattr(app.state, "fast_max_body_bytes", 1 << 20)
    return type(
        "FastHttpToolsProtocol",
        (_FastProtocol,),
        {"routes": dict(routes), "max_body_bytes": max_body_bytes},
    )


class _FastProtocol(OneWriteHttpToolsProtocol):
    routes: dict[bytes, FastRoute]
    max_body_bytes: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fast_route: FastRoute | None = None
        self._fast_body = bytearray()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._fast_route = None

    def on_headers_complete(self) -> None:
        route = self.routes.get(self.url)
        if (
            route is not None
            and self.parser.get_method() == b"POST"
            and (self.cycle is None or self.cycle.response_complete)
            and self.parser.get_http_version() == "1.1"
            and self.parser.should_keep_alive()
            and self._plain_length()
        ):
            self._fast_route = route
            self._fast_body = bytearray()
            return
        super().on_headers_complete()

    def _plain_length(self) -> bool:
        length = False
        for name, value in self.headers:
            if name == b"content-length":
                length = value.isdigit() and int(value) <= self.max_body_bytes
            elif name == b"expect" or name == b"transfer-encoding":
                return False
        return length

    def on_body(self, body: bytes) -> None:
        if self._fast_route is not None:
            self._fast_body += body
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        route = self._fast_route
        if route is None:
            super().on_message_complete()
            return
        self._fast_route = None
        body = bytes(self._fast_body)
        self._fast_body = bytearray()
        try:
            answer = route(self.headers, body)
        except Exception:
            # Raised inside httptools' callback, it would become uvicorn's bare 400 "Invalid
            # HTTP request received." with no traceback: logged here, and the ASGI app answers.
            logger.exception("fast route %r failed; the ASGI app answers", self.url)
            answer = None
        if answer is None:  # uvicorn's own way, as if it had never been held back
            super().on_headers_complete()
            self.cycle.body += body
            super().on_message_complete()
            return
        head = [_HEAD % len(answer)]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        head += (b"\r\n", answer)
        self.transport.write(b"".join(head))
        self.on_response_complete()
