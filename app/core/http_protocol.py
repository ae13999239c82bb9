"""uvicorn's httptools protocol with each answer sent in one write.

uvicorn writes a response's head as soon as the app sends ``http.response.start``, and the body
in a second write: two ``send`` system calls, and on a loopback (or a virtual machine's network)
two wake-ups of a client that waits for the answer. In ``kvmesh bench worker`` the two writes
were a sixth of the worker's CPU. ``OneWriteHttpToolsProtocol`` gives uvicorn a transport that
joins what is written during one event-loop iteration and sends it at the end of that
iteration (``call_soon``): a head and the body that follows it at once go out together; nothing
waits longer than the iteration it was written in, and a close sends what is pending first.
An answer written whole (``write_whole``: the fast routes' of ``app.core.fast_http``) leaves at
once unless something is pending before it.

uvicorn also cancels a connection's keep-alive timer on every read and arms a new one after
every answer: a timer made, scheduled and cancelled per request, 8-10 µs of the router's CPU
per ``/route`` (its thread's CPU, measured by part). Here one timer per connection is armed
once and stays armed: a request's start marks the connection busy, an answer notes when it
went idle, and the timer, when it fires, closes a connection idle for the whole timeout, or is
armed again for what is left of it (a busy one: by its next answer). The timeout counts from
the last answer, as uvicorn's does.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["OneWriteHttpToolsProtocol"]


class _JoiningTransport:
    """A transport whose writes of one loop iteration reach the socket as one write; every
    other call goes to the transport it wraps."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(bytes(data))

    def write_whole(self, data: bytes) -> None:
        """A whole answer, head and body: at once when nothing waits to be joined (it needs no
        joining, and the loop no callback), else after what does."""
        if self._pending:
            self.write(data)
        elif not self._transport.is_closing():
            self._transport.write(data)

    def writelines(self, chunks: Any) -> None:
        for data in chunks:
            self.write(data)

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = []
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` on a ``_JoiningTransport`` (``uvicorn.Config(http=...)``),
    with one keep-alive timer per connection."""

    joined: _JoiningTransport
    _idle_since: float | None = None  # when its last answer left; None while it has a request

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.joined = _JoiningTransport(transport, self.loop)
        joined: Any = self.joined
        super().connection_made(joined)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn's cancels the timer on every read. A read makes nothing busy here: a request's
        # start does (``on_message_begin``), also one in the same read as the answer before it,
        # and a stray byte between requests does not keep the connection open for ever.
        pass

    def on_message_begin(self) -> None:
        self._idle_since = None  # busy until its answer
        super().on_message_begin()

    def on_response_complete(self) -> None:
        """uvicorn's, arming the keep-alive timer only when none is armed."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            self._idle_since = None
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self._arm_keep_alive(self.timeout_keep_alive)

    def _arm_keep_alive(self, delay: float) -> None:
        self.timeout_keep_alive_task = self.loop.call_later(delay, self._keep_alive_due)

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_since is None or self.transport.is_closing():
            return  # busy: its next answer arms the timer again
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        # uvloop's timers count whole milliseconds and may fire a little early: one armed for
        # less than that would fire again at once, every iteration until the clock ticks.
        if left > 0.001:
            self._arm_keep_alive(left)
        else:
            self.timeout_keep_alive_handler()
