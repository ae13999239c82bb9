"""The router's client for the hop to a worker (``app.router.upstream``), against a scripted
HTTP server on a loopback port: what it sends, how it reads each kind of answer, when it keeps a
connection, and which error each failure is."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from app.core.net import free_port
from app.router.upstream import (
    UPSTREAM_ERRORS,
    ConnectError,
    ReadTimeout,
    RemoteProtocolError,
    UpstreamResponse,
    WorkerClient,
)

OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
)
OLD = b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

# The request number on its connection (0, 1, ...) -> what the server writes, or None: it
# closes the connection without answering; "hang": it never answers.
Script = Callable[[int], bytes | str | None]


@dataclass
class Server:
    port: int
    connections: int = 0
    requests: list[tuple[bytes, bytes]] = field(default_factory=list)  # (head, body)


@contextlib.asynccontextmanager
async def serving(script: Script) -> AsyncIterator[Server]:
    server = Server(free_port())
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.connections += 1
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            for n in range(1_000):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                server.requests.append((head, await reader.readexactly(length)))
                answer = script(n)
                if answer == "hang":
                    await asyncio.sleep(10)
                if not isinstance(answer, bytes):
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", server.port)
    try:
        yield server
    finally:
        listener.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await listener.wait_closed()


class Recorder:
    """A fallback that records what it was given."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, bytes]] = []
        self.closed = False

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        self.posts.append((url, body))
        raise ConnectError("recorded")

    async def aclose(self) -> None:
        self.closed = True


def client(fallback: Recorder | None = None, **options: float) -> WorkerClient:
    values = {"connect_timeout_s": 2.0, "read_timeout_s": 5.0, **options}
    return WorkerClient(fallback=fallback or Recorder(), **values)  # type: ignore[arg-type]


async def test_a_post_is_one_request_and_its_connection_is_kept() -> None:
    async with serving(lambda n: OK) as server:
        upstream = client()
        for body in (b'{"prompt":[1]}', b'{"prompt":[2]}'):
            answer = await upstream.post(f"http://127.0.0.1:{server.port}/v1/completions", body)
            assert answer.status_code == 200
            assert answer.headers["content-type"] == "application/json"
            assert await answer.aread() == b'{"ok":true}'
        await upstream.aclose()
    assert server.connections == 1
    heads = [head.decode() for head, _ in server.requests]
    assert (
        heads
        == [
            f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{server.port}\r\n"
            f"content-type: application/json\r\ncontent-length: 14\r\n\r\n"
        ]
        * 2
    )
    assert [body for _, body in server.requests] == [b'{"prompt":[1]}', b'{"prompt":[2]}']


async def test_a_chunked_answer_comes_chunk_by_chunk_and_keeps_the_connection() -> None:
    async with serving(lambda n: CHUNKED) as server:
        upstream = client()
        for _ in range(2):
            answer = await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
            assert answer.headers["content-type"] == "text/event-stream"
            assert [chunk async for chunk in answer.aiter_raw()] == [b"data: 1\n\n", b"data: 2\n\n"]
        await upstream.aclose()
    assert server.connections == 1


@pytest.mark.parametrize(
    ("script", "connections"),
    [
        (lambda n: OLD, 2),  # HTTP/1.0 without keep-alive: closed after each answer
        (lambda n: OK if n == 0 else None, 2),  # the worker closed the kept connection: once more
        (lambda n: OK.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1), 2),
    ],
)
async def test_a_connection_the_worker_does_not_keep_is_not_reused(
    script: Script, connections: int
) -> None:
    async with serving(script) as server:
        upstream = client()
        for _ in range(2):
            answer = await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
            assert answer.status_code == 200
            await answer.aread()
        await upstream.aclose()
    assert server.connections == connections


async def test_idle_connections_expire_and_unread_answers_drop_theirs() -> None:
    async with serving(lambda n: OK) as server:
        upstream = client(keep_alive_s=0.0)
        for _ in range(2):
            await (await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")).aread()
        assert server.connections == 2
        await upstream.aclose()
        upstream = client()
        for _ in range(2):
            await (await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")).aclose()
        await upstream.aclose()
    assert server.connections == 4


async def test_each_failure_is_its_own_error() -> None:
    upstream = client(read_timeout_s=0.2)
    with pytest.raises(ConnectError):
        await upstream.post(f"http://127.0.0.1:{free_port()}/x", b"{}")
    async with serving(lambda n: None) as server:  # a new connection closed unanswered
        with pytest.raises(RemoteProtocolError, match="closed without an answer"):
            await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
    async with serving(lambda n: "hang") as server:
        with pytest.raises(ReadTimeout):
            await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
    async with serving(lambda n: b"SSH-2.0-OpenSSH\r\n\r\n") as server:
        with pytest.raises(RemoteProtocolError, match=r"not an HTTP/1\.1 answer"):
            await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
    truncated = OK[:-3]
    async with serving(lambda n: truncated) as server:
        answer = await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
        with pytest.raises(ReadTimeout):  # the rest of the body never comes
            await answer.aread()
    await upstream.aclose()
    assert all(issubclass(e, UPSTREAM_ERRORS) for e in (ConnectError, ReadTimeout))


async def test_another_scheme_goes_to_the_fallback() -> None:
    fallback = Recorder()
    upstream = client(fallback)
    with pytest.raises(ConnectError, match="recorded"):
        await upstream.post("https://gpu3:8443/v1/completions", b"{}")
    assert fallback.posts == [("https://gpu3:8443/v1/completions", b"{}")]
    await upstream.aclose()
    assert fallback.closed
