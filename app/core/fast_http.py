"""Answering a hot route from uvicorn's HTTP protocol itself, without an ASGI request cycle.

A ``POST /route`` that the router answers in about 100 µs of its own cost uvicorn another
150 µs: a scope, a ``RequestResponseCycle``, a task, the middleware, and two socket writes (the
head, then the body). ``fast_protocol(app)`` is uvicorn's ``HttpToolsProtocol`` with a table of
*fast routes* (``app.state.fast_routes``: exact URL -> ``(headers, body) -> answer``): a POST to
one of them is buffered instead of starting a cycle, and the route is called with it once it is
whole. Its answer is one of:

* JSON bytes: a 200 with that body, written at once;
* an awaitable of a ``RawAnswer`` (status, headers other than Content-Length, a body: not a
  204 or 304): the answer of a route that must wait on something (the router's proxied
  completion waits on its worker), awaited in a task of the connection's. The connection counts
  as busy until it is written, so that a request pipelined behind it waits in uvicorn's queue;
  a connection lost meanwhile cancels the task (the answer is no longer wanted: a worker's job
  is cancelled, a router's hop to its worker closed, as vLLM aborts a request whose client
  left) and gets nothing; an awaitable that raises is logged and answered
  with uvicorn's own 500, and the connection closed, as is one cancelled (a shutdown's
  deadline passed);
* None: anything but the route's plain case. The request is handed to the ASGI app exactly as
  uvicorn would have handed it, body included, so the paths differ only in cost. A route that
  raises (logged) is handed over alike.

A route decides between these synchronously, before anything is awaited: a request it has
started to answer is never handed over.

Only the simple case is taken: HTTP/1.1 keep-alive, a Content-Length within
``app.state.fast_max_body_bytes``, no ``Expect``, ``Transfer-Encoding`` or ``Upgrade``, and no
earlier request on the connection still being answered (pipelining keeps uvicorn's order). The
ASGI scope is built only for a request that the app answers. uvicorn's ``limit_concurrency``
does not apply to the fast routes (kvmesh does not set it).

The protocol runs on ``app.core.http_protocol``'s joining transport, so that every other answer
(a proxied completion's head and body, say) also leaves in one write.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.core.http_protocol import OneWriteHttpToolsProtocol

__all__ = ["FastRoute", "RawAnswer", "fast_protocol"]

logger = logging.getLogger(__name__)

# An answer given later: (status, headers other than Content-Length, body).
RawAnswer = tuple[int, list[tuple[bytes, bytes]], bytes]

# (the request's headers, lower-case names, as uvicorn gives them; its body) -> a 200's JSON
# body, an awaitable of the answer, or None: the ASGI app answers.
FastRoute = Callable[[list[tuple[bytes, bytes]], bytes], bytes | Awaitable[RawAnswer] | None]

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
_FAILED: RawAnswer = (
    500,
    [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")],
    b"Internal Server Error",
)


class _NoEvent:
    def set(self) -> None:  # nothing reads the request's body once the route has it
        pass


class _Pending:
    """What uvicorn reads of a request cycle (``self.cycle``), for an answer that a fast route
    gives later: a request pipelined behind it is queued until it is complete, a shutdown asks
    it not to keep the connection, a lost connection marks it."""

    __slots__ = ("disconnected", "keep_alive", "response_complete")
    message_event = _NoEvent()

    def __init__(self) -> None:
        self.response_complete = False
        self.keep_alive = True
        self.disconnected = False


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
        self._fast_body: list[bytes] = []  # the body's chunks, as httptools gives them
        self._later: set[asyncio.Task[None]] = set()  # the answers given later, not yet written

    def on_message_begin(self) -> None:
        # uvicorn's, less the ASGI scope: a fast route never needs one (``_begin_scope``).
        self._idle_since = None  # busy (``app.core.http_protocol``'s keep-alive)
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self._fast_route = None

    def _begin_scope(self) -> None:
        """uvicorn's ``on_message_begin``, keeping the URL and headers parsed since."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers

    def on_headers_complete(self) -> None:
        route = self.routes.get(self.url)
        if (
            route is not None
            and self.parser.get_method() == b"POST"
            and (self.cycle is None or self.cycle.response_complete)
            and self.parser.get_http_version() == "1.1"
            and self.parser.should_keep_alive()
            and not self.parser.should_upgrade()
            and self._plain_length()
        ):
            self._fast_route = route
            self._fast_body = []
            return
        self._begin_scope()
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
            self._fast_body.append(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        route = self._fast_route
        if route is None:
            super().on_message_complete()
            return
        self._fast_route = None
        chunks = self._fast_body
        # Most bodies come in one read: that chunk is the body, not copied twice over.
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._fast_body = []
        try:
            answer = route(self.headers, body)
        except Exception:
            # Raised inside httptools' callback, it would become uvicorn's bare 400 "Invalid
            # HTTP request received." with no traceback: logged here, and the ASGI app answers.
            logger.exception("fast route %r failed; the ASGI app answers", self.url)
            answer = None
        if answer is None:  # uvicorn's own way, as if it had never been held back
            self._begin_scope()
            super().on_headers_complete()
            self.cycle.body += body
            super().on_message_complete()
            return
        if not isinstance(answer, bytes):
            self._answer_later(answer)
            return
        head = [_HEAD % len(answer)]
        for name, value in self.server_state.default_headers:
            head += (name, b": ", value, b"\r\n")
        head += (b"\r\n", answer)
        self.joined.write_whole(b"".join(head))
        self.on_response_complete()

    def _answer_later(self, answer: Awaitable[RawAnswer]) -> None:
        pending = _Pending()
        self.cycle = pending  # type: ignore[assignment]
        task = self.loop.create_task(self._write_later(pending, answer, self.url))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)  # a graceful shutdown waits for it, as for an ASGI cycle
        task.add_done_callback(self._later.discard)
        self._later.add(task)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for task in self._later:  # nobody to answer: the work for it stops
            task.cancel()

    async def _write_later(
        self, pending: _Pending, answer: Awaitable[RawAnswer], url: bytes
    ) -> None:
        try:
            try:
                status, headers, body = await answer
            except Exception:
                logger.exception("fast route %r failed while answering", url)
                status, headers, body = _FAILED
            self._write(pending, status, headers, body)
        finally:
            if not pending.response_complete:  # cancelled (a shutdown's deadline), or a bug
                pending.response_complete = True
                self.transport.close()

    def _write(
        self, pending: _Pending, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        if pending.disconnected or self.transport.is_closing():
            pending.response_complete = True
            return
        if (b"connection", b"close") in headers:
            pending.keep_alive = False
        head = [b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))]
        for name, value in (*headers, *self.server_state.default_headers):
            head += (name, b": ", value, b"\r\n")
        if not pending.keep_alive and (b"connection", b"close") not in headers:
            head.append(b"connection: close\r\n")
        head += (b"content-length: %d\r\n\r\n" % len(body), body)
        self.joined.write_whole(b"".join(head))
        pending.response_complete = True
        if pending.keep_alive:
            self.on_response_complete()  # starts a pipelined request, or arms the keep-alive
        else:
            self.server_state.total_requests += 1
            self.transport.close()


@functools.cache
def _reason(status: int) -> bytes:
    """The status line's phrase (an ``HTTPStatus`` lookup a response was ~1 µs)."""
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
