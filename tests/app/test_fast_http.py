"""``app.core.fast_http`` itself, under a real uvicorn server on a loopback port, as
``app.core.http.uvicorn_config`` runs every service: pipelined requests on one keep-alive
socket are answered in order whichever path takes each (the fast route's, the ASGI app's: the
test app's differ, to tell them apart; one behind an answer still pending goes the ASGI
app's way, as documented), a fast route that raises hands its request to the ASGI app
instead of failing the connection, and an answer given later (an awaitable) is written when
it comes, is a 500 that closes the connection if it fails, and is dropped if the client has
gone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import orjson
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from app.core.fast_http import RawAnswer
from app.core.http import uvicorn_config
from app.core.net import free_port
from tests.support.wait import eventually


def _route(
    headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes | Coroutine[Any, Any, RawAnswer] | None:
    if body == b"boom":
        raise RuntimeError("the fast route failed")
    fields = orjson.loads(body)
    if "later" in fields:
        return _later(fields)
    if fields.get("fast"):
        return orjson.dumps({"path": "fast", "n": fields["n"]})
    return None  # anything but the plain case: the ASGI app answers


ANSWERED: list[float] = []  # the delays of the later answers given, in order
CANCELLED: list[float] = []  # those of the later answers cancelled


async def _later(fields: dict[str, Any]) -> RawAnswer:
    try:
        await asyncio.sleep(fields["later"])
    except asyncio.CancelledError:
        CANCELLED.append(fields["later"])
        raise
    if fields.get("fail"):
        raise RuntimeError("the answer failed")
    ANSWERED.append(fields["later"])
    return 201, [(b"content-type", b"application/json")], orjson.dumps({"path": "later"})


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/route")
    async def route(request: Request) -> JSONResponse:
        body = await request.body()
        if body.startswith(b'{"sleep":'):
            await asyncio.sleep(orjson.loads(body)["sleep"])
        answer = {"path": "asgi", "body": body.decode()}
        if "x-probe" in request.headers:  # the headers parsed before the fast route gave up
            answer["probe"] = request.headers["x-probe"]
        return JSONResponse(answer, status_code=202)

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    app.state.fast_routes = {b"/route": _route}
    app.state.fast_max_body_bytes = 1024
    return app


@contextlib.asynccontextmanager
async def _serving(
    keep_alive_s: float | None = None,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    app = _app()
    port = free_port()
    config = uvicorn_config(app, "127.0.0.1", port, "warning")
    if keep_alive_s is not None:
        config.timeout_keep_alive = keep_alive_s  # type: ignore[assignment]  # a float works
    assert isinstance(config.http, type) and config.http.__name__ == "FastHttpToolsProtocol"
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            yield reader, writer
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def _post(body: bytes, headers: bytes = b"") -> bytes:
    return (
        b"POST /route HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (headers, len(body), body)
    )


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(
            int(line.partition(":")[2])
            for line in lines
            if line.lower().startswith("content-length:")
        )
        return int(lines[0].split(" ")[1]), await reader.readexactly(length)


def _logged_once(caplog: pytest.LogCaptureFixture, failure: str) -> None:
    """``app.core.fast_http`` logged one failure, with the exception that says ``failure``."""
    failures = [r for r in caplog.records if r.name == "app.core.fast_http"]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert failure in str(failures[0].exc_info[1])


async def test_pipelined_requests_are_answered_in_order_on_either_path() -> None:
    async with _serving() as (reader, writer):
        writer.write(
            _post(b'{"fast": true, "n": 1}')
            + _post(b'{"fast": false}')
            + b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n"
        )
        answers = [await _answer(reader) for _ in range(3)]
        # Once those are answered the connection's next route is the fast path's again.
        writer.write(_post(b'{"fast": true, "n": 2}'))
        answers.append(await _answer(reader))
    assert answers == [
        (200, b'{"path":"fast","n":1}'),
        (202, b'{"path":"asgi","body":"{\\"fast\\": false}"}'),
        (200, b'{"ok":true}'),
        (200, b'{"path":"fast","n":2}'),
    ]


async def test_a_body_sent_in_several_reads_reaches_either_path_whole() -> None:
    async with _serving() as (reader, writer):
        answers = []
        for body in (b'{"fast": true, "n": 12345}', b'{"fast": false, "pad": "xyz"}'):
            request = _post(body)
            cut = len(request) - len(body)
            # The head, then the body in three pieces, each sent (and read) on its own.
            for piece in (request[:cut], body[:5], body[5:9], body[9:]):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.02)
            answers.append(await _answer(reader))
    assert answers == [
        (200, b'{"path":"fast","n":12345}'),
        (202, b'{"path":"asgi","body":"{\\"fast\\": false, \\"pad\\": \\"xyz\\"}"}'),
    ]


async def test_the_keep_alive_timeout_counts_from_the_last_answer_on_either_path() -> None:
    """One timer per connection (``app.core.http_protocol``), armed by the first answer: it
    closes a connection idle for the whole timeout since its last answer, never one that has a
    request, and not at the first answer's timeout."""
    async with _serving(keep_alive_s=1.0) as (reader, writer):
        loop = asyncio.get_running_loop()
        answers = []
        # Every 0.4 s, each within the timeout of the answer before; the last comes past the
        # first answer's timeout.
        for body in (b'{"fast": true, "n": 1}', b'{"fast": false}', b'{"fast": true, "n": 2}'):
            writer.write(_post(body))
            answers.append(await _answer(reader))
            await asyncio.sleep(0.4)
        writer.write(_post(b'{"later": 1.6}'))  # longer than the timeout: a busy connection
        answers.append(await _answer(reader))
        last = loop.time()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        idle = loop.time() - last
    assert answers == [
        (200, b'{"path":"fast","n":1}'),
        (202, b'{"path":"asgi","body":"{\\"fast\\": false}"}'),
        (200, b'{"path":"fast","n":2}'),
        (201, b'{"path":"later"}'),
    ]
    assert 0.8 < idle < 3.0, idle


async def test_a_stray_line_end_between_requests_does_not_keep_the_connection_open() -> None:
    """A read is not a request: an empty line after an answer (which HTTP lets a client send)
    leaves the connection idle, and the keep-alive timeout closes it."""
    async with _serving(keep_alive_s=0.3) as (reader, writer):
        writer.write(_post(b'{"fast": true, "n": 7}'))
        assert await _answer(reader) == (200, b'{"path":"fast","n":7}')
        writer.write(b"\r\n")
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server


async def test_a_request_in_the_same_read_as_an_answer_keeps_the_connection_busy() -> None:
    """The fast route answers the first at once, which leaves the connection idle; the second,
    read with it, is the ASGI app's and takes longer than the keep-alive timeout: its start
    marks the connection busy again, and it is answered."""
    async with _serving(keep_alive_s=0.3) as (reader, writer):
        writer.write(_post(b'{"fast": true, "n": 6}') + _post(b'{"sleep": 1.0}'))
        answers = [await _answer(reader) for _ in range(2)]
    assert answers == [
        (200, b'{"path":"fast","n":6}'),
        (202, b'{"path":"asgi","body":"{\\"sleep\\": 1.0}"}'),
    ]


async def test_a_fast_route_that_raises_is_logged_and_the_asgi_app_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="app.core.fast_http"):
        async with _serving() as (reader, writer):
            writer.write(_post(b"boom"))
            answers = [await _answer(reader)]
            writer.write(_post(b'{"fast": true, "n": 3}'))  # the same connection, still open
            answers.append(await _answer(reader))
    assert answers == [(202, b'{"path":"asgi","body":"boom"}'), (200, b'{"path":"fast","n":3}')]
    _logged_once(caplog, "the fast route failed")


async def test_the_asgi_app_gets_the_headers_the_fast_route_saw() -> None:
    async with _serving() as (reader, writer):
        writer.write(_post(b'{"fast": false}', b"x-probe: 7\r\n"))
        answers = [await _answer(reader)]
        writer.write(_post(b'{"fast": true, "n": 4}', b"x-probe: 8\r\n"))
        answers.append(await _answer(reader))
    assert answers == [
        (202, b'{"path":"asgi","body":"{\\"fast\\": false}","probe":"7"}'),
        (200, b'{"path":"fast","n":4}'),
    ]


async def test_an_answer_given_later_keeps_the_connections_order() -> None:
    async with _serving() as (reader, writer):
        # The first waits; the two behind it wait in uvicorn's queue, and the ASGI app answers
        # them (as for any request queued behind one still being answered).
        writer.write(_post(b'{"later": 0.05}') + _post(b'{"fast": false}') + _post(b'{"later": 0}'))
        answers = [await _answer(reader) for _ in range(3)]
        writer.write(_post(b'{"fast": true, "n": 5}'))
        answers.append(await _answer(reader))
    assert answers == [
        (201, b'{"path":"later"}'),
        (202, b'{"path":"asgi","body":"{\\"fast\\": false}"}'),
        (202, b'{"path":"asgi","body":"{\\"later\\": 0}"}'),  # queued: the ASGI app's
        (200, b'{"path":"fast","n":5}'),
    ]


async def test_an_answer_that_fails_later_is_a_500_and_the_connection_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="app.core.fast_http"):
        async with _serving() as (reader, writer):
            writer.write(_post(b'{"later": 0, "fail": true}'))
            answer = await _answer(reader)
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
    assert answer == (500, b"Internal Server Error")
    _logged_once(caplog, "the answer failed")


async def test_a_client_gone_before_the_answer_cancels_it_and_the_server_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The answer of a client that left is no longer wanted: its coroutine is cancelled (a
    worker's job with it), nothing is written or logged, and the server answers the next."""
    ANSWERED.clear()
    CANCELLED.clear()
    with caplog.at_level(logging.WARNING):
        async with _serving() as (reader, writer):
            host, port = writer.get_extra_info("peername")[:2]
            _, gone = await asyncio.open_connection(host, port)
            gone.write(_post(b'{"later": 5.0}'))
            await gone.drain()
            await asyncio.sleep(0.1)  # the server has it
            gone.close()
            await eventually(lambda: CANCELLED == [5.0])
            writer.write(_post(b'{"later": 0}'))
            assert await _answer(reader) == (201, b'{"path":"later"}')
    assert (ANSWERED, CANCELLED) == ([0], [5.0])
    assert [r.getMessage() for r in caplog.records] == []  # nothing written to a closed socket


async def test_an_answer_given_later_has_the_servers_headers_and_one_length() -> None:
    async with _serving() as (reader, writer):
        writer.write(_post(b'{"later": 0}'))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        body = await reader.readexactly(16)
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0] == "HTTP/1.1 201 Created"
    names = [line.partition(":")[0] for line in lines[1:] if line]
    assert names == ["content-type", "date", "server", "content-length"]
    assert "content-length: 16" in lines and body == b'{"path":"later"}'
