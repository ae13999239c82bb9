"""The router's HTTP client for the hop to a worker: keep-alive HTTP/1.1 on an asyncio protocol.

httpx cost about 700 µs of CPU per request in isolation on a 2-core VM (its connection pool, anyio,
h11, the request and response models); in ``kvmesh bench proxy`` the router spent 2.3 ms of busy
CPU per proxied completion with it, 0.9 ms with this client (docs/benchmarks.md). ``WorkerClient``
does only what the proxy needs: a POST of JSON bytes written in one write, the status line and
headers, then the body by Content-Length or chunked transfer coding, read whole (``aread``) or as
it comes (``aiter_raw``). Connections are kept per ``host:port`` and reused, newest first. An idle
connection is checked as it is taken: one the worker has closed (or sent anything on: it is
readable) or idle longer than ``keep_alive_s`` is dropped, not reused, and a new one made. A
request once written is never sent again: a worker that closes without answering may have read it
(a completion run twice, or a 409 on its request id), so that is the caller's error. Idle
connections that expire or that the worker closes are also swept from every worker's pool (at
most once a second on ``post``, and every ``keep_alive_s`` while any are idle), and
``forget(url)`` drops a removed worker's pool, so that none is left in CLOSE_WAIT. Connections
in use are not capped (httpx's pool held 1,024 and queued the rest; a worker bounds what it takes
with its queue length). A URL whose scheme is not ``http`` (``https://``) goes to ``fallback``, an
httpx client.

Exceptions (httpx's names, so that the 502s say what they said before)::

    UpstreamError
    ├── ConnectError        the worker refused or could not be reached
    ├── ConnectTimeout      no connection within ``connect_timeout_s``
    ├── ReadTimeout         no head, no next part of a streamed or chunked answer, or not
    │                       the whole of a body of known length read by ``aread``, within
    │                       ``read_timeout_s``
    ├── ReadError           the connection failed while reading or writing
    └── RemoteProtocolError the worker closed without an answer, or answered something else

The proxy treats these and ``httpx.HTTPError`` alike (``UPSTREAM_ERRORS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import select
import time
from collections.abc import AsyncIterator, Mapping
from typing import Protocol, cast
from urllib.parse import urlsplit

import httpx

__all__ = [
    "KEEP_ALIVE_S",
    "UPSTREAM_ERRORS",
    "ConnectError",
    "ConnectTimeout",
    "HttpxUpstream",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "Upstream",
    "UpstreamError",
    "UpstreamResponse",
    "WorkerClient",
]

# Idle connections are dropped after this long: well inside the services' own 75 s
# (``app.core.http.uvicorn_config``), so that the worker seldom closes one as it is reused.
KEEP_ALIVE_S = 30.0
_MAX_HEAD_BYTES = 64 * 1024
_READ_BYTES = 64 * 1024
_PAUSE_BYTES = 4 * _READ_BYTES  # received and unread past this, the socket is not read
_SWEEP_EVERY_S = 1.0  # the most often ``post`` sweeps the idle pools
_DIGITS = re.compile(r"[0-9]{1,18}")  # a Content-Length: ASCII digits only (not "²", "+1")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")  # a chunk size: plain hex (not "-3", "0x10", "1_0")


class UpstreamError(Exception):
    """The hop to a worker failed (see the module docstring)."""


class ConnectError(UpstreamError):
    pass


class ConnectTimeout(UpstreamError):
    pass


class ReadTimeout(UpstreamError):
    pass


class ReadError(UpstreamError):
    pass


class RemoteProtocolError(UpstreamError):
    pass


UPSTREAM_ERRORS = (UpstreamError, httpx.HTTPError)


class UpstreamResponse(Protocol):
    """What the proxy reads of a worker's answer (an ``httpx.Response`` is one)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    async def aread(self) -> bytes: ...

    def aiter_raw(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Upstream(Protocol):
    """Sends a POST of JSON bytes to a worker; the answer's head is in when it returns."""

    async def post(self, url: str, body: bytes) -> UpstreamResponse: ...

    def forget(self, url: str) -> None:
        """The worker at ``url`` is gone: drop what is kept for it."""

    async def aclose(self) -> None: ...


class HttpxUpstream:
    """``Upstream`` over an httpx client (which stays the caller's to close)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self._json = {"content-type": "application/json"}

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        request = self.client.build_request("POST", url, content=body, headers=self._json)
        return await self.client.send(request, stream=True)

    def forget(self, url: str) -> None:
        return None  # httpx's pool expires its own connections

    async def aclose(self) -> None:
        return None


class _Connection(asyncio.Protocol):
    """One connection to a worker, as an asyncio protocol: the bytes received and not read
    yet, and the read waiting for more. (asyncio's streams on top of a transport cost a
    ``StreamReader`` and ``StreamWriter`` in Python, and a task lookup, a timer and a
    ``getpid`` system call per read for the timeout; here a read that finds its bytes
    waits for nothing, and one that waits has one future and one timer.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.fd = -1
        self.idle_since = 0.0
        self._poller: select.poll | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: Exception | None = None
        self._paused = False
        self._expired = False  # the deadline of the read under way passed
        self.closed: asyncio.Future[None] = loop.create_future()

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.fd = sock.fileno()
            self._poller = select.poll()
            self._poller.register(self.fd, select.POLLIN | select.POLLPRI)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) > _PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True  # a reader slower than the worker: stop reading until it is
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._error = exc
        self._wake()
        if not self.closed.done():
            self.closed.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the pool's questions ----------------------------------------------------------------

    def open(self) -> bool:
        """Neither side has closed it, as far as the loop has seen."""
        return not (self._eof or self.transport is None or self.transport.is_closing())

    def usable(self) -> bool:
        """Open, and nothing to read: between answers a worker sends nothing, so a readable
        socket is one it has closed (its FIN in, not yet seen by the loop) or spoken out of turn
        on (as httpcore checks a pooled connection)."""
        if not self.open() or self._buffer:
            return False
        if self._poller is None:
            return True
        try:
            return not self._poller.poll(0)
        except OSError:
            return False

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- writing and reading -------------------------------------------------------------------

    def write(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.transport.writelines((head, body))  # one writev, the body not copied

    async def read_until(
        self,
        separator: bytes,
        timeout_s: float,
        closed: str = "the worker closed in the middle of its answer",
    ) -> bytes:
        """Up to and with ``separator``, which must come within ``_MAX_HEAD_BYTES``; ``closed``
        says what it means when the worker closes first."""
        buffer = self._buffer
        handle: asyncio.Handle | None = None
        try:
            while (end := buffer.find(separator, 0, _MAX_HEAD_BYTES + len(separator))) < 0:
                if len(buffer) > _MAX_HEAD_BYTES:
                    raise RemoteProtocolError("a line of the answer is too long")
                self._check_open(closed)
                handle = await self._wait(timeout_s, handle)
        finally:
            if handle is not None:
                handle.cancel()
        return self._take(end + len(separator))

    async def read_exactly(self, size: int, timeout_s: float) -> bytes:
        buffer = self._buffer
        handle: asyncio.Handle | None = None
        try:
            while len(buffer) < size:
                self._check_open("the worker closed in the middle of its answer")
                handle = await self._wait(timeout_s, handle)
        finally:
            if handle is not None:
                handle.cancel()
        return self._take(size)

    async def read_some(self, most: int, timeout_s: float) -> bytes:
        """What has come (at most ``most`` bytes), or b"" once the worker closed."""
        buffer = self._buffer
        handle: asyncio.Handle | None = None
        try:
            while not buffer:
                if self._eof:
                    if self._error is not None:
                        raise ReadError(str(self._error) or type(self._error).__name__)
                    return b""
                handle = await self._wait(timeout_s, handle)
        finally:
            if handle is not None:
                handle.cancel()
        return self._take(most)

    def _take(self, size: int) -> bytes:
        """The first ``size`` bytes received (or all there are), no longer kept."""
        buffer = self._buffer
        if len(buffer) <= size:  # the usual case: the whole buffer, one copy
            data = bytes(buffer)
            buffer.clear()
        else:
            data = bytes(buffer[:size])
            del buffer[:size]
        return data

    def _check_open(self, closed: str) -> None:
        if self._eof:
            if self._error is not None:
                raise ReadError(str(self._error) or type(self._error).__name__)
            raise RemoteProtocolError(closed)

    async def _wait(self, timeout_s: float, handle: asyncio.Handle | None) -> asyncio.Handle:
        """Until more bytes come, the worker closes, or the read's deadline (one timer for
        the whole read, set at its first wait) passes."""
        if handle is None:
            self._expired = False
            handle = self.loop.call_later(timeout_s, self._expire, timeout_s)
        elif self._expired:  # it fired as bytes came, with no read waiting: too late all the same
            raise ReadTimeout(f"no answer within {timeout_s} s")
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        waiter = self._waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        return handle

    def _expire(self, timeout_s: float) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_exception(ReadTimeout(f"no answer within {timeout_s} s"))
        else:  # (the clock is not asked: uvloop's timers may fire before their when())
            self._expired = True


class _Response:
    """A worker's answer, its head read; the body is read once (``aread`` or ``aiter_raw``),
    after which the connection goes back to the pool if the worker keeps it open."""

    def __init__(
        self,
        client: WorkerClient,
        key: tuple[str, int],
        connection: _Connection,
        version: str,
        status_code: int,
        headers: dict[str, str],
    ) -> None:
        self._client = client
        self._key = key
        self._connection: _Connection | None = connection
        self.status_code = status_code
        self.headers = headers
        self._chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        length = headers.get("content-length")
        if length is not None and not self._chunked and _DIGITS.fullmatch(length) is None:
            raise RemoteProtocolError(f"bad Content-Length {length[:40]!r}")
        self._length = int(length) if length is not None and not self._chunked else None
        # HTTP/1.1 keeps the connection unless told otherwise; HTTP/1.0 closes it unless told.
        keep = headers.get("connection", "").lower()
        keep_alive = keep == "keep-alive" if version == "HTTP/1.0" else keep != "close"
        self._reusable = keep_alive and (self._chunked or self._length is not None)

    async def aread(self) -> bytes:
        connection = self._connection
        if connection is None or self._chunked or self._length is None:
            return b"".join([chunk async for chunk in self.aiter_raw()])
        # The usual answer, a body of known length (a completion's JSON): one read, and one
        # timeout for the whole of it.
        self._connection = None
        try:
            data = await connection.read_exactly(self._length, self._client.read_timeout_s)
        except BaseException:
            connection.close()
            raise
        self._done(connection)
        return data

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            raise RemoteProtocolError("the answer was already read or closed")
        try:
            async for data in self._body(connection):
                yield data
        except BaseException:  # a failure, or the reader stopped early: the rest is unread
            self._connection = None
            connection.close()
            raise
        self._connection = None
        self._done(connection)

    def _done(self, connection: _Connection) -> None:
        """The answer read to its end: the connection back to the pool, or closed."""
        if self._reusable:
            self._client.release(self._key, connection)
        else:
            connection.close()

    async def _body(self, connection: _Connection) -> AsyncIterator[bytes]:
        timeout_s = self._client.read_timeout_s
        if self._chunked:
            while True:
                line = await connection.read_until(b"\r\n", timeout_s)
                digits = line.split(b";", 1)[0].strip(b" \t\r\n")
                if _HEX.fullmatch(digits) is None:
                    raise RemoteProtocolError(f"bad chunk size {line[:40]!r}")
                size = int(digits, 16)
                if size == 0:
                    while await connection.read_until(b"\r\n", timeout_s) != b"\r\n":
                        pass  # trailers
                    return
                data = await connection.read_exactly(size + 2, timeout_s)
                if data[-2:] != b"\r\n":
                    raise RemoteProtocolError("a chunk longer than its size")
                yield data[:-2]
        elif self._length is not None:
            left = self._length
            while left > 0:
                data = await connection.read_some(min(left, _READ_BYTES), timeout_s)
                if not data:
                    raise RemoteProtocolError("the worker closed in the middle of its answer")
                left -= len(data)
                yield data
        else:  # until the worker closes
            while data := await connection.read_some(_READ_BYTES, timeout_s):
                yield data

    async def aclose(self) -> None:
        """Drops the connection unless its answer was read to the end."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()


class WorkerClient:
    """``Upstream`` with keep-alive connections per worker (see the module docstring)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        fallback: Upstream,
        max_idle_per_worker: int = 64,
        keep_alive_s: float = KEEP_ALIVE_S,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.fallback = fallback
        self.max_idle_per_worker = max_idle_per_worker
        self.keep_alive_s = keep_alive_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._addresses: dict[str, tuple[str, int, bytes] | None] = {}  # URL -> host, port, path
        self._closed = False
        self._swept_at = time.monotonic()
        self._sweep_every_s = max(min(_SWEEP_EVERY_S, keep_alive_s), 0.01)
        self._sweeper: asyncio.TimerHandle | None = None

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        if url in self._addresses:
            address = self._addresses[url]
        else:
            address = self._addresses[url] = _address(url)
        if address is None:
            return await self.fallback.post(url, body)
        host, port, path = address
        key = (host, port)
        head = (
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (path, host.encode(), port, len(body))
        )
        if time.monotonic() - self._swept_at >= self._sweep_every_s:
            self.sweep()
        # Sent once: a failure after the write is the caller's (the worker may have read it).
        return await self._exchange(key, await self._connection(key), head, body)

    async def _exchange(
        self, key: tuple[str, int], connection: _Connection, head: bytes, body: bytes
    ) -> _Response:
        try:
            connection.write(head, body)
            version, status, headers = await self._read_head(connection)
            return _Response(self, key, connection, version, status, headers)
        except BaseException:
            connection.close()
            raise

    async def _read_head(self, connection: _Connection) -> tuple[str, int, dict[str, str]]:
        while True:
            head = await connection.read_until(
                b"\r\n\r\n", self.read_timeout_s, "the worker closed without an answer"
            )
            lines = head.decode("latin-1").split("\r\n")
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise RemoteProtocolError(f"not an HTTP/1.1 answer: {lines[0][:60]!r}")
            if not 100 <= int(code) < 200:
                break
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return version, int(code), headers

    async def _connection(self, key: tuple[str, int]) -> _Connection:
        """A kept-alive connection to ``key`` still open and unexpired, else a new one."""
        if self._closed:
            raise ConnectError("the client is closed")
        idle = self._idle.get(key)
        if idle:
            oldest = time.monotonic() - self.keep_alive_s
            while idle:
                connection = idle.pop()
                if connection.idle_since > oldest and connection.usable():
                    return connection
                connection.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), key[0], key[1]
                )
        except TimeoutError:
            raise ConnectTimeout(f"no connection within {self.connect_timeout_s} s") from None
        except OSError as exc:
            raise ConnectError(str(exc) or type(exc).__name__) from None
        return connection

    def release(self, key: tuple[str, int], connection: _Connection) -> None:
        """A connection whose answer was read to the end, back to the pool. (Whether the
        worker closed it since is asked of the socket when it is taken again, not here: one
        system call a request fewer.)"""
        idle = self._idle.setdefault(key, [])
        if self._closed or len(idle) >= self.max_idle_per_worker or not connection.open():
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(max(self.keep_alive_s, 0.01), self._tick)

    def sweep(self) -> int:
        """Close the idle connections, of every worker, that are expired or that the worker
        has closed; how many."""
        now = time.monotonic()
        self._swept_at = now
        oldest = now - self.keep_alive_s
        dropped = 0
        for key, idle in list(self._idle.items()):
            kept = []
            for connection in idle:
                if connection.idle_since > oldest and connection.usable():
                    kept.append(connection)
                else:
                    connection.close()
                    dropped += 1
            if kept:
                idle[:] = kept
            else:
                del self._idle[key]
        return dropped

    def _tick(self) -> None:
        self._sweeper = None
        self.sweep()
        if self._idle and not self._closed:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(max(self.keep_alive_s, 0.01), self._tick)

    def idle_connections(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    def forget(self, url: str) -> None:
        """The worker at ``url`` was removed: close its idle connections, forget its URLs."""
        address = _address(url)
        if address is None:
            return
        key = address[:2]
        for connection in self._idle.pop(key, []):
            connection.close()
        for known, parts in list(self._addresses.items()):
            if parts is not None and parts[:2] == key:
                del self._addresses[known]

    async def aclose(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        connections = [c for idle in self._idle.values() for c in idle]
        self._idle.clear()
        for connection in connections:
            connection.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                await connection.closed
        await self.fallback.aclose()


def _address(url: str) -> tuple[str, int, bytes] | None:
    """(host, port, path) of an ``http://`` URL; None for another scheme (the fallback's)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return None
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname, parts.port or 80, path.encode()
