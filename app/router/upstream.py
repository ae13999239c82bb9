"""The router's HTTP client for the hop to a worker: keep-alive HTTP/1.1 on asyncio streams.

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
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Protocol
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


class _Connection:
    __slots__ = ("fd", "idle_since", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0
        sock = writer.get_extra_info("socket")
        self.fd: int = sock.fileno() if sock is not None else -1

    def open(self) -> bool:
        """Neither side has closed it, as far as the loop has seen."""
        return not (self.writer.is_closing() or self.reader.at_eof())

    def usable(self) -> bool:
        """Open, and nothing to read: between answers a worker sends nothing, so a readable
        socket is one it has closed (its FIN in, not yet seen by the loop) or spoken out of turn
        on (as httpcore checks a pooled connection)."""
        if not self.open():
            return False
        if self.fd < 0:
            return True
        poller = select.poll()
        poller.register(self.fd, select.POLLIN | select.POLLPRI)
        try:
            return not poller.poll(0)
        except OSError:
            return False

    def close(self) -> None:
        self.writer.close()


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
            data = await self._client.read(connection.reader.readexactly(self._length))
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
            async for data in self._body(connection.reader):
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

    async def _body(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        read = self._client.read
        if self._chunked:
            while True:
                line = await read(reader.readuntil(b"\r\n"))
                digits = line.split(b";", 1)[0].strip(b" \t\r\n")
                if _HEX.fullmatch(digits) is None:
                    raise RemoteProtocolError(f"bad chunk size {line[:40]!r}")
                size = int(digits, 16)
                if size == 0:
                    while await read(reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                        pass
                    return
                data = await read(reader.readexactly(size + 2))
                if data[-2:] != b"\r\n":
                    raise RemoteProtocolError("a chunk longer than its size")
                yield data[:-2]
        elif self._length is not None:
            left = self._length
            while left > 0:
                data = await read(reader.read(min(left, _READ_BYTES)))
                if not data:
                    raise RemoteProtocolError("the worker closed in the middle of its answer")
                left -= len(data)
                yield data
        else:  # until the worker closes
            while data := await read(reader.read(_READ_BYTES)):
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
            connection.writer.writelines((head, body))  # one writev, the body not copied
            version, status, headers = await self._read_head(connection.reader)
            return _Response(self, key, connection, version, status, headers)
        except BaseException:
            connection.close()
            raise

    async def read(self, pending: Awaitable[bytes]) -> bytes:
        """``await pending`` (a stream read) within the read timeout, its errors ours.

        The timeout is ``asyncio.timeout``'s way (the task cancelled at the deadline, that
        cancellation told from any other by ``uncancel``) without its context manager, whose
        two coroutines and state were 9 of the 39 µs of CPU of a round trip (two reads)."""
        task = asyncio.current_task()
        assert task is not None
        expired: list[bool] = []
        cancelling = task.cancelling()
        handle = asyncio.get_running_loop().call_later(self.read_timeout_s, _expire, task, expired)
        try:
            data = await pending
        except asyncio.CancelledError:
            if expired and task.uncancel() <= cancelling:  # ours alone: the deadline passed
                raise ReadTimeout(f"no answer within {self.read_timeout_s} s") from None
            raise
        except asyncio.IncompleteReadError:
            raise RemoteProtocolError("the worker closed in the middle of its answer") from None
        except asyncio.LimitOverrunError:
            raise RemoteProtocolError("a line of the answer is too long") from None
        except OSError as exc:
            raise ReadError(str(exc) or type(exc).__name__) from None
        finally:
            handle.cancel()
        return data

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[str, int, dict[str, str]]:
        while True:
            try:
                head = await self.read(reader.readuntil(b"\r\n\r\n"))
            except RemoteProtocolError:
                raise RemoteProtocolError("the worker closed without an answer") from None
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
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    key[0], key[1], limit=_MAX_HEAD_BYTES
                )
        except TimeoutError:
            raise ConnectTimeout(f"no connection within {self.connect_timeout_s} s") from None
        except OSError as exc:
            raise ConnectError(str(exc) or type(exc).__name__) from None
        return _Connection(reader, writer)

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
                await connection.writer.wait_closed()
        await self.fallback.aclose()


def _expire(task: asyncio.Task[object], expired: list[bool]) -> None:
    expired.append(True)
    task.cancel()


def _address(url: str) -> tuple[str, int, bytes] | None:
    """(host, port, path) of an ``http://`` URL; None for another scheme (the fallback's)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return None
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname, parts.port or 80, path.encode()
