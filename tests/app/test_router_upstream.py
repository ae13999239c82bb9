"""The router's client for the hop to a worker (``app.router.upstream``), against a scripted
HTTP server on a loopback port: what it sends, how it reads each kind of answer, when it keeps a
connection, and which error each failure is."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from app.core.net import free_port
from app.router.upstream import (
    ConnectError,
    ConnectTimeout,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    UpstreamResponse,
    WorkerClient,
    _Connection,
)
from tests.app.router_support import router_client, router_settings
from tests.app.worker_support import worker_client, worker_settings
from tests.support.wait import eventually

OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
)
CLOSE = b"<close>"  # at the end of an answer: the server closes the connection after it
OLD = b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


pytestmark = pytest.mark.both_loops  # the client is a protocol on each loop's transports

# The request number on its connection (0, 1, ...) -> what the server writes, or None: it
# closes the connection without answering; "hang": it never answers.
Script = Callable[[int], bytes | str | None]


@dataclass
class Server:
    port: int
    connections: int = 0
    hangups: int = 0  # connections the client closed
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
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    server.hangups += 1
                    raise
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
                writer.write(answer.removesuffix(CLOSE))
                await writer.drain()
                if answer.endswith(CLOSE):
                    break
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
        (lambda n: OK + CLOSE, 2),  # the worker closed the kept connection: a new one
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
            await asyncio.sleep(0.05)  # the worker's close reaches the client
        await upstream.aclose()
    assert server.connections == connections
    assert len(server.requests) == 2  # each request sent once


async def test_a_request_the_worker_may_have_read_is_never_sent_again() -> None:
    # The worker reads the second request on the kept connection, then closes unanswered.
    async with serving(lambda n: OK if n == 0 else None) as server:
        upstream = client()
        url = f"http://127.0.0.1:{server.port}/x"
        await (await upstream.post(url, b"{}")).aread()
        with pytest.raises(RemoteProtocolError, match="closed without an answer"):
            await upstream.post(url, b'{"n":2}')
        await upstream.aclose()
    assert (server.connections, len(server.requests)) == (1, 2)


@pytest.mark.parametrize(
    "answer",
    [
        OK.replace(b"content-length: 11", b"content-length: \xb2"),  # latin-1 "²"
        OK.replace(b"content-length: 11", b"content-length: +11"),
        CHUNKED.replace(b"9\r\ndata: 1", b"-3\r\ndata: 1"),
        CHUNKED.replace(b"9\r\ndata: 1\n\n\r\n", b"0x10\r\ndata: 1\n\ndata: 2\n\n\r\n"),
        CHUNKED.replace(b"9\r\ndata: 1\n\n\r\n", b"1_0\r\ndata: 1\n\ndata: 2\n\n\r\n"),
    ],
)
async def test_a_bad_length_or_chunk_size_is_a_protocol_error(answer: bytes) -> None:
    async with serving(lambda n: answer) as server:
        upstream = client(read_timeout_s=1.0)
        with pytest.raises(RemoteProtocolError, match="bad"):
            response = await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
            await response.aread()
        assert upstream.idle_connections() == 0
        await upstream.aclose()


async def test_an_answer_larger_than_the_pause_threshold_comes_whole_either_way() -> None:
    """The client stops reading a socket past a quarter MiB unread and reads on as the caller
    does: a 3 MiB answer arrives byte for byte, read whole or chunk by chunk."""
    body = bytes(range(256)) * (3 * 4096)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    async with serving(lambda n: head % len(body) + body) as server:
        upstream = client()
        url = f"http://127.0.0.1:{server.port}/x"
        assert await (await upstream.post(url, b"{}")).aread() == body
        answer = await upstream.post(url, b"{}")
        await asyncio.sleep(0.2)  # the whole answer is sent: the client has paused its socket
        chunks = [chunk async for chunk in answer.aiter_raw()]
        assert b"".join(chunks) == body
        assert max(len(chunk) for chunk in chunks) == 64 * 1024
        await upstream.aclose()
    assert server.connections == 1


@pytest.mark.parametrize("end", [b"", b"\r\n\r\n"], ids=["never-ends", "ends-too-late"])
async def test_a_head_longer_than_64_kib_is_a_protocol_error(end: bytes) -> None:
    endless = b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"x" * 70_000 + end
    async with serving(lambda n: endless) as server:
        upstream = client(read_timeout_s=2.0)
        with pytest.raises(RemoteProtocolError, match="a line of the answer is too long"):
            await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
        assert upstream.idle_connections() == 0
        await upstream.aclose()


async def test_idle_connections_of_every_worker_are_swept_and_a_removed_worker_forgotten() -> None:
    async with serving(lambda n: OK) as kept, serving(lambda n: OK) as other:
        upstream = client(keep_alive_s=0.2)
        for port in (kept.port, other.port):
            await (await upstream.post(f"http://127.0.0.1:{port}/x", b"{}")).aread()
        assert upstream.idle_connections() == 2
        await asyncio.sleep(0.5)  # both expire with no post to either: the timer sweeps them
        assert upstream.idle_connections() == 0
        assert (kept.hangups, other.hangups) == (1, 1)
        await upstream.aclose()
        upstream = client()
        url = f"http://127.0.0.1:{kept.port}/v1/completions"
        await (await upstream.post(url, b"{}")).aread()
        await (await upstream.post(f"http://127.0.0.1:{other.port}/x", b"{}")).aread()
        upstream.forget(f"http://127.0.0.1:{kept.port}")
        assert upstream.idle_connections() == 1
        assert list(upstream._addresses) == [f"http://127.0.0.1:{other.port}/x"]
        await asyncio.sleep(0.05)
        assert (kept.hangups, other.hangups) == (2, 1)
        await upstream.aclose()


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


async def test_a_read_timeout_shorter_than_a_millisecond_is_still_a_read_timeout() -> None:
    """uvloop makes a timer of under 0.5 ms a plain handle, with no ``when()``: a read that
    waits twice must still time out as a ``ReadTimeout``, whichever loop runs it."""
    loop = asyncio.get_running_loop()
    connection = _Connection(loop)  # no socket: the bytes are handed to it as the loop would
    reading = loop.create_task(connection.read_until(b"\r\n\r\n", 0.0004))
    loop.call_soon(connection.data_received, b"HTTP/1.1 200 OK\r\n")  # part of a head, at once
    with pytest.raises(ReadTimeout, match=r"no answer within 0\.0004 s"):
        await reading


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
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # the deadline's cancel undone
        # Cancelled from outside before the deadline: a cancellation, not a timeout.
        waiting = asyncio.create_task(upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}"))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    async with serving(lambda n: b"SSH-2.0-OpenSSH\r\n\r\n") as server:
        with pytest.raises(RemoteProtocolError, match=r"not an HTTP/1\.1 answer"):
            await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
    truncated = OK[:-3]
    async with serving(lambda n: truncated) as server:
        answer = await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
        with pytest.raises(ReadTimeout):  # the rest of the body never comes
            await answer.aread()
    async with serving(lambda n: truncated + CLOSE) as server:
        answer = await upstream.post(f"http://127.0.0.1:{server.port}/x", b"{}")
        with pytest.raises(RemoteProtocolError, match="closed in the middle of its answer"):
            await answer.aread()
    assert upstream.idle_connections() == 0  # neither was kept
    await upstream.aclose()


class Failing:
    """An upstream whose every post fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.posts = 0

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        self.posts += 1
        raise self.error

    def forget(self, url: str) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def test_the_proxy_answers_each_upstream_error_with_a_502_and_no_flight_left(
    clean_redis_url: str,
) -> None:
    async with (
        worker_client(worker_settings(clean_redis_url, worker_id="w0")),
        worker_client(worker_settings(clean_redis_url, worker_id="w1")),
        router_client(router_settings(clean_redis_url)) as (router, runtime),
    ):
        await eventually(lambda: len(runtime.core.workers) == 2 and runtime.readiness()["ready"])
        real = runtime.upstream
        errors: list[Exception] = [
            ConnectError("x"),
            ConnectTimeout("x"),
            ReadTimeout("x"),
            ReadError("x"),
            RemoteProtocolError("x"),
            httpx.ConnectError("x"),
        ]
        for exc in errors:
            runtime.upstream = failing = Failing(exc)
            response = await router.post(
                "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}
            )
            assert response.status_code == 502, exc
            assert response.json()["error"]["type"] == "upstream_error"
            name = type(exc).__name__
            assert response.json()["error"]["message"].count(f": {name}") == 2
            assert failing.posts == 2
            assert runtime.core.inflight == {}
        # Anything else is the router's own 500, but its flight is finished all the same.
        runtime.upstream = Failing(ValueError("not an upstream error"))
        with pytest.raises(ValueError, match="not an upstream error"):
            await router.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert runtime.core.inflight == {}
        metrics = (await router.get("/metrics")).text
        assert 'kvmesh_router_completions_total{status="502",worker=""} 6.0' in metrics
        runtime.upstream = real


class _Broken:
    """A streamed 200 that fails after its first chunk, as a worker that dies mid-answer."""

    status_code = 200

    def __init__(self) -> None:
        self.headers = {"content-type": "text/event-stream"}
        self.closed = False

    async def aread(self) -> bytes:
        raise AssertionError("a stream is relayed, not read whole")

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        yield b'data: {"n": 1}\n\n'
        raise ReadError("connection reset")

    async def aclose(self) -> None:
        self.closed = True


class BreaksMidStream:
    """An upstream whose every post answers ``_Broken``."""

    def __init__(self) -> None:
        self.answers: list[_Broken] = []

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        self.answers.append(_Broken())
        return self.answers[-1]

    def forget(self, url: str) -> None:
        return None

    async def aclose(self) -> None:
        return None


async def test_a_worker_failing_mid_stream_ends_the_stream_with_an_error_event(
    clean_redis_url: str,
) -> None:
    """The client gets what came, then one SSE event with an OpenAI error body (the status is
    sent already); the flight ends and the completion counts as a 502."""
    async with (
        worker_client(worker_settings(clean_redis_url, worker_id="w0")),
        router_client(router_settings(clean_redis_url)) as (router, runtime),
    ):
        await eventually(lambda: len(runtime.core.workers) == 1 and runtime.readiness()["ready"])
        runtime.upstream = upstream = BreaksMidStream()
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
        async with router.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["x-kvmesh-worker"] == "w0"
            received = b"".join([chunk async for chunk in response.aiter_raw()])
        error = {
            "error": {
                "message": "the worker failed mid-stream",
                "type": "upstream_error",
                "param": None,
                "code": None,
            }
        }
        assert received == b'data: {"n": 1}\n\n' + b"data: " + orjson.dumps(error) + b"\n\n"
        assert [answer.closed for answer in upstream.answers] == [True]
        assert runtime.core.inflight == {}
        metrics = (await router.get("/metrics")).text
        assert 'kvmesh_router_completions_total{status="502",worker="w0"} 1.0' in metrics


class Forgetful:
    """An upstream that records the URLs it is told to forget."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        raise ConnectError("not used")

    def forget(self, url: str) -> None:
        self.forgotten.append(url)

    async def aclose(self) -> None:
        return None


async def test_a_worker_that_leaves_has_its_connections_forgotten(clean_redis_url: str) -> None:
    """A worker gone from the view (it stopped and left the registry) leaves the router's
    workers, and the client drops its kept connections (none left in CLOSE_WAIT); a worker
    that stays is not touched."""
    settings = worker_settings(clean_redis_url, worker_id="w1", advertise_url="http://w1:9")
    async with (
        worker_client(worker_settings(clean_redis_url, worker_id="w0")),
        router_client(router_settings(clean_redis_url)) as (_, runtime),
    ):
        await eventually(lambda: "w0" in runtime.core.workers)
        real, runtime.upstream = runtime.upstream, (forgetful := Forgetful())
        try:
            async with worker_client(settings):
                await eventually(lambda: "w1" in runtime.core.workers)
                assert runtime.core.workers["w1"].url == "http://w1:9"
                assert forgetful.forgotten == []
            await eventually(lambda: "w1" not in runtime.core.workers)
            assert forgetful.forgotten == ["http://w1:9"]
            assert list(runtime.core.workers) == ["w0"]
        finally:
            runtime.upstream = real


async def test_another_scheme_goes_to_the_fallback() -> None:
    fallback = Recorder()
    upstream = client(fallback)
    with pytest.raises(ConnectError, match="recorded"):
        await upstream.post("https://gpu3:8443/v1/completions", b"{}")
    assert fallback.posts == [("https://gpu3:8443/v1/completions", b"{}")]
    await upstream.aclose()
    assert fallback.closed
