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
    """uvicorn's ``HttpToolsProtocol`` on a ``_JoiningTransport`` (``uvicorn.Config(http=...)``)."""

    joined: _JoiningTransport

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.joined = _JoiningTransport(transport, self.loop)
        joined: Any = self.joined
        super().connection_made(joined)
