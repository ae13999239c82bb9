"""The fast path (``app.router.fast_path``, ``app.core.token_json``) against the FastAPI
routes: the same status and body for good and bad input, and which bodies it takes at all."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from app.core.http import front_of
from app.core.token_json import _scan_plain, parse_token_body
from app.router.fast_path import completion_answer, fast_routes, route_answer
from app.router.runtime import RouterRuntime
from app.services import router_app
from events.publisher import EventPublisher
from events.redis_io import redis_client
from events.snapshot import Snapshot
from tests.app.router_support import router_settings
from tests.support.asgi import served
from tests.support.json_server import JsonServer
from tests.support.wait import eventually

P = list(range(100, 140))
J = {"content-type": "application/json"}


def test_token_bodies_are_parsed_exactly() -> None:
    parsed = parse_token_body(b' { "model" : "m", "prompt" :[ 1 ,2,\n4294967295 ] , "x": [1]}')
    assert parsed is not None
    assert (parsed.key, parsed.words.tolist(), parsed.fields) == (
        "prompt",
        [1, 2, 4294967295],
        {"model": "m", "x": [1]},
    )
    assert parsed.words.dtype == np.uint32
    body = orjson.dumps({"prompt_token_ids": P})
    parsed = parse_token_body(body)
    assert parsed is not None and body[parsed.start : parsed.end] == orjson.dumps(P)
    for bad in (
        b'{"prompt": []}',
        b'{"prompt": [1, -1]}',
        b'{"prompt": [4294967296]}',
        b'{"prompt": [1.5]}',
        b'{"prompt": [01]}',
        b'{"prompt": [1e3]}',
        b'{"prompt": [1,]}',
        b'{"prompt": [1], }',
        b'{, "prompt": [1]}',
        b'{"prompt": [1]} x',
        b'{"prompt": [1], "prompt": [2]}',
        b'{"prompt_token_ids": [1], "prompt": [2]}',
        b'{"a": "\\"prompt\\": [1]"}',
        b'{"a": {"prompt": [1]}}',
        b'{"prompt": "text"}',
        b'[{"prompt": [1]}]',
    ):
        assert parse_token_body(bad) is None, bad


def test_long_arrays_are_read_as_orjson_reads_them() -> None:
    """Arrays long enough for the word-at-a-time reading: every id width, both spacings, a
    fault anywhere in them, and random bodies, each against ``orjson.loads``."""
    ids = [0, 7, 10, 99, 100, 4_321, 54_321, 654_321, 7_654_321, 87_654_321, 987_654_321]
    ids += [1_000_000_000, 4_294_967_295]  # 10 digits: the byte loop's
    for spacing in (b",", b", ", b" ,\n "):
        body = b'{"prompt": [' + spacing.join(b"%d" % t for t in ids * 3) + b"]}"
        parsed = parse_token_body(body)
        assert parsed is not None and parsed.words.tolist() == ids * 3, spacing
        assert parsed.end == len(body) - 1
    good = b",".join(b"%d" % t for t in ids[:9])  # words to the fault (the byte loop then)
    for fault in (b"01", b"00", b"0123456", b"4294967296", b"12345678901", b"-1", b"1.5", b"2e3"):
        for body in (
            b'{"prompt": [' + good + b"," + fault + b"," + good + b"]}",
            b'{"prompt": [' + good + b"," + fault + b'], "pad": "' + b"x" * 16 + b'"}',
        ):
            assert parse_token_body(body) is None, body
    for fault in (b"1,]", b"1,,2", b"1 2", b"1]]"):
        assert parse_token_body(b'{"prompt": [' + good + b"," + fault + b"}") is None, fault

    rng = np.random.default_rng(7)
    for _ in range(200):
        widths = rng.integers(1, 11, rng.integers(1, 60))
        tokens = [
            int(rng.integers(10 ** (w - 1) if w > 1 else 0, min(10**w, 1 << 32))) for w in widths
        ]
        spaces = [b"," + b" " * int(rng.integers(0, 2) * rng.integers(0, 3)) for _ in tokens]
        text = b"".join(b"%d%s" % (t, s) for t, s in zip(tokens, spaces, strict=True))[:-1]
        body = b'{"prompt_token_ids": [' + text.rstrip(b", ") + b'], "model": null}'
        parsed = parse_token_body(body)
        assert (
            parsed is not None and parsed.words.tolist() == orjson.loads(body)["prompt_token_ids"]
        )


def test_the_plain_scan_reads_as_orjson_reads_and_leaves_the_rest_to_the_byte_loop() -> None:
    """``_scan_plain`` (ids of 1-8 digits, one separator throughout) reads the usual body
    whole; anything else goes to ``_scan``. Long arrays of both spacings, ending in the body's
    last bytes or not, with a byte changed anywhere in the array (among the 64-byte groups or
    in the last bytes) or not: each parses as ``orjson.loads`` reads it, or not at all."""
    rng = np.random.default_rng(11)
    for case in range(400):
        widths = rng.integers(1, 9, rng.integers(20, 200))
        tokens = [int(rng.integers(10 ** (w - 1) if w > 1 else 0, 10**w)) for w in widths]
        array = (b", " if case % 2 else b",").join(b"%d" % t for t in tokens)
        head = b'{"prompt": ['
        body = bytearray(head + array + (b"]}" if case % 3 == 0 else b'], "max_tokens": 1}'))
        if case % 4 == 0:  # as it was made: the plain scan reads it all
            close = body.index(b"]")
            size = (close - len(head)) // 2 + 2
            out, commas = np.empty(size, np.uint32), np.empty(size, np.int64)
            words = np.ndarray((len(body) - 7,), np.uint64, bytes(body), strides=(1,))
            buf = np.frombuffer(bytes(body), np.uint8)
            count = _scan_plain(buf, words, len(head), close, case % 2 == 1, out, commas)
            assert out[:count].tolist() == tokens
        else:
            at = len(head) + int(rng.integers(0, len(array)))
            body[at] = int(rng.choice(list(b"0123456789, ]-.x")))
        parsed = parse_token_body(bytes(body))
        try:
            expected = orjson.loads(bytes(body))["prompt"]
        except orjson.JSONDecodeError:
            expected = None
        if expected and all(type(t) is int and 0 <= t < 1 << 32 for t in expected):
            assert parsed is not None and parsed.words.tolist() == expected, bytes(body)
        else:
            assert parsed is None, bytes(body)


def _echo(path: str, body: Any) -> tuple[int, Any]:
    return 200, {"path": path, "keys": sorted(body), "num_tokens": len(body.get("prompt", []))}


async def _publisher(redis: Any, url: str) -> EventPublisher:
    publisher = EventPublisher(
        redis,
        "w0",
        snapshot_source=lambda: Snapshot([], -1),
        registry_entry={"url": url, "tokens_per_block": 16, "capacity": [4096, 0]},
        load_source=lambda: {"active_sequences": 0, "waiting_requests": 0},
    )
    await publisher.start()
    return publisher


ROUTE_CASES: list[tuple[bytes, bool]] = [  # (body, whether the fast path answers it)
    (orjson.dumps({"prompt_token_ids": P}), True),
    (orjson.dumps({"prompt": P, "cache_salt": "s", "lora_task_id": 3}), True),
    (orjson.dumps({"model": None, "user": "u", "prompt": P}), True),
    (b'{ "prompt" : [ 1 , 2 ,3 ] }', True),
    (b"{not json", False),
    (b"[]", False),
    (b'{"prompt": []}', False),
    (b'{"prompt": [1, -1]}', False),
    (b'{"prompt": [1, 4294967296]}', False),
    (b'{"prompt": [1.5]}', False),
    (b'{"prompt": [true]}', False),
    (b'{"prompt": [1], "prompt": [2]}', False),
    (b'{"prompt": [1], "cache_salt": ""}', False),
    (b'{"prompt": [1], "lora_task_id": -1}', False),
    (b'{"prompt": [1], "model": "any"}', True),  # workers that name no model serve any
    (b'{"prompt": [1], "extra": 1}', False),
    (b'{"prompt": [1],}', False),
    (b'{"prompt": [1]} x', False),
    (b'{"prompt": "some text"}', False),
    (b'{"prompt_token_ids": [1], "prompt": [2]}', False),
]

COMPLETION_CASES: list[tuple[bytes, bool]] = [
    (orjson.dumps({"prompt": P, "max_tokens": 2, "request_id": "r1"}), True),
    (orjson.dumps({"prompt": P, "temperature": 0.5, "request_id": "r2"}), True),
    (orjson.dumps({"prompt": P, "user": "u", "logprobs": None, "request_id": "r3"}), True),
    (orjson.dumps({"prompt": P, "max_tokens": 0}), False),
    (orjson.dumps({"prompt": P, "max_tokens": True}), False),
    (orjson.dumps({"prompt": P, "max_tokens": 2.0}), False),
    (orjson.dumps({"prompt": P, "stream": "yes"}), False),
    (orjson.dumps({"prompt": P, "request_id": ""}), False),
    (orjson.dumps({"prompt_token_ids": P}), False),
    (orjson.dumps({"prompt": P, "routing": {"policy": "round_robin"}, "request_id": "r4"}), False),
    (b'{"prompt": [1, 2], "max_tokens": 1,}', False),
]


@pytest.mark.parametrize("path", ["/route", "/v1/completions"])
async def test_the_fast_path_and_the_framework_answer_alike(
    clean_redis_url: str, path: str
) -> None:
    with JsonServer(_echo).running() as engine:
        redis = redis_client(clean_redis_url)
        publisher = await _publisher(redis, engine.url)
        app = router_app(router_settings(clean_redis_url))
        try:
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=front_of(app)), base_url="http://r"
                ) as fast,
                httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://r"
                ) as full,
            ):
                runtime = app.state.runtime
                await eventually(lambda: runtime.readiness()["ready"])
                cases = ROUTE_CASES if path == "/route" else COMPLETION_CASES
                for body, taken in cases:
                    if path == "/route":
                        assert (route_answer(runtime, body, None) is not None) == taken, body
                    answers = [await c.post(path, content=body, headers=J) for c in (fast, full)]
                    statuses = [a.status_code for a in answers]
                    assert statuses[0] == statuses[1], (body, statuses)
                    assert statuses[0] == 200 if taken else True  # pydantic takes [true] as [1]
                    bodies = [a.json() for a in answers]
                    for one in bodies:
                        one.pop("decision_us", None)
                    assert bodies[0] == bodies[1], body
                    if statuses[0] != 200:
                        assert 400 <= statuses[0] < 500
                        assert bodies[0]["error"]["message"]
                    if path == "/v1/completions" and statuses[0] == 200:
                        assert answers[0].headers["x-kvmesh-worker"] == "w0"
                        sent = [dict(b) for _, b in engine.requests[-2:]]
                        ids = [one.pop("request_id") for one in sent]
                        assert sent[0] == sent[1]  # the worker got the same body both ways
                        assert ids[0] == ids[1] if b"request_id" in body else ids[0] != ids[1]
        finally:
            await publisher.aclose()
            await redis.aclose()


async def _pipelined(url: str, bodies: list[bytes]) -> list[tuple[int, Any]]:
    """``bodies`` POSTed to /v1/completions at once on one connection; (status, JSON) each."""
    host, _, port = url.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"".join(
                b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json"
                b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                for body in bodies
            )
        )
        answers = []
        for _ in bodies:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            answers.append((int(head[9:12]), orjson.loads(await reader.readexactly(length))))
        return answers
    finally:
        writer.close()


async def test_the_servers_protocol_answers_completions_as_the_framework_does(
    clean_redis_url: str,
) -> None:
    """A real server answers plain completions from its protocol (``fast_routes``): the same
    status, body and worker header as the FastAPI route, pipelined requests in order, and the
    503 of a worker gone."""
    routes = fast_routes(router_app(router_settings(clean_redis_url)), 1 << 20)
    assert set(routes) == {b"/route", b"/v1/completions"}
    engine_running = JsonServer(_echo).running()
    engine = engine_running.__enter__()
    redis = redis_client(clean_redis_url)
    publisher = await _publisher(redis, engine.url)
    served_app, full_app = (router_app(router_settings(clean_redis_url)) for _ in range(2))
    # Which bodies the protocol's route took: the three paths answer alike by design, so the
    # test must see that the one under test answered.
    took: list[bytes] = []
    completion_route = served_app.state.fast_routes[b"/v1/completions"]

    def counted(headers: list[tuple[bytes, bytes]], body: bytes) -> Any:
        answer = completion_route(headers, body)
        if answer is not None:
            took.append(body)
        return answer

    served_app.state.fast_routes = {**served_app.state.fast_routes, b"/v1/completions": counted}
    try:
        async with (
            served(served_app) as url,
            full_app.router.lifespan_context(full_app),
            httpx.AsyncClient(base_url=url) as real,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=full_app), base_url="http://r"
            ) as full,
        ):
            runtimes: list[RouterRuntime] = [served_app.state.runtime, full_app.state.runtime]
            await eventually(lambda: all(r.readiness()["ready"] for r in runtimes))

            async def both(body: bytes) -> list[httpx.Response]:
                return [
                    await c.post("/v1/completions", content=body, headers=J) for c in (real, full)
                ]

            for body, taken in COMPLETION_CASES:
                answers = await both(body)
                assert answers[0].status_code == answers[1].status_code, body
                assert answers[0].json() == answers[1].json(), body
                assert (took[-1:] == [body]) == taken, body
                if taken:  # (not taken may still be a 200: pydantic reads true as 1)
                    assert answers[0].status_code == 200, body
                    assert answers[0].headers["x-kvmesh-worker"] == "w0"
                    assert answers[1].headers["x-kvmesh-worker"] == "w0"
                    assert answers[0].headers["content-type"] == "application/json"
                    assert answers[0].headers["content-length"] == str(len(answers[0].content))
            # Pipelined: in order, whichever path answers each (the second is not plain).
            bodies = [
                orjson.dumps({"prompt": P[:3], "max_tokens": 1}),
                orjson.dumps({"prompt": P[:5], "max_tokens": 0}),
                orjson.dumps({"prompt": P[:7], "max_tokens": 1}),
            ]
            took.clear()
            pipelined = await _pipelined(url, bodies)
            assert [(status, answer.get("num_tokens")) for status, answer in pipelined] == [
                (200, 3),
                (400, None),
                (200, 7),
            ]
            assert took == bodies[:1]  # the ones behind it waited, and the ASGI app answered
            assert pipelined[1][1] == (await both(bodies[1]))[1].json()
            engine_running.__exit__(None, None, None)  # the worker goes away
            gone = await both(orjson.dumps({"prompt": P, "request_id": "gone"}))
            # Refused, and no other worker to try: a 503 to come back later, both ways.
            assert [a.status_code for a in gone] == [503, 503]
            assert gone[0].json() == gone[1].json()
            assert gone[0].headers["retry-after"] == gone[1].headers["retry-after"] == "1"
            assert gone[0].json()["error"] == {
                "message": "no worker is left",
                "type": "unavailable_error",
                "param": None,
                "code": None,
            }
    finally:
        engine_running.__exit__(None, None, None)
        await publisher.aclose()
        await redis.aclose()


async def test_a_request_id_taken_between_the_check_and_the_flight_is_refused(
    clean_redis_url: str,
) -> None:
    """The protocol runs a completion's answer an iteration after its checks: two bodies with
    one id, both checked before either runs, get one answer and one 400, as the app gives."""
    with JsonServer(_echo).running() as engine:
        redis = redis_client(clean_redis_url)
        publisher = await _publisher(redis, engine.url)
        app = router_app(router_settings(clean_redis_url))
        try:
            async with app.router.lifespan_context(app):
                runtime = app.state.runtime
                await eventually(lambda: runtime.readiness()["ready"])
                body = orjson.dumps({"prompt": P, "request_id": "twice"})
                first, second = (completion_answer(runtime, body, None) for _ in range(2))
                assert first is not None and second is not None  # both checked, neither begun
                answers = await asyncio.gather(first, second)
                assert [a.status_code for a in answers] == [200, 400]
                assert orjson.loads(bytes(answers[1].body)) == {
                    "error": {
                        "message": "request_id: 'twice' is already in flight",
                        "type": "invalid_request_error",
                        "param": "request_id",
                        "code": None,
                    }
                }
                assert "twice" not in runtime.core.inflight  # the first's flight ended
        finally:
            await publisher.aclose()
            await redis.aclose()
