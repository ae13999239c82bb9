"""The fast path of ``POST /v1/completions`` answers exactly as the FastAPI route: the same
status, body and headers for good and bad input, whichever of the two takes the request."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import orjson
import pytest

import app.worker.fast_path as fast_path
from app.core.http_protocol import OneWriteHttpToolsProtocol
from app.worker.app import create_app, server_config
from app.worker.engine import Job
from app.worker.runtime import WorkerRuntime
from app.worker.settings import ModelShape
from tests.app.worker_support import expected_output, worker_settings
from tests.support.asgi import asgi_client, served
from tests.support.wait import eventually

JSON = {"content-type": "application/json"}
LONG = list(range(40))

# (body, content type, query, whether the fast path answers it)
CASES: list[tuple[Any, str, str, bool]] = [
    ({"prompt": [1, 2, 3], "max_tokens": 2, "request_id": "a"}, "application/json", "", True),
    (
        {
            "prompt": LONG,
            "max_tokens": 3,
            "request_id": "b",
            "priority": 5,
            "lora_task_id": 7,
            "cache_salt": "salt",
            "model": "tiny",
            "temperature": 0.5,
            "stream": False,
            "retention": None,
        },
        "application/json",
        "",
        True,
    ),
    # Bools among the ids (read as their ints), then after the whitespace case another key
    # named prompt, the prompt twice, a nested or escaped key: the route's, answered alike.
    (
        {"prompt": [1, True, False, 3], "max_tokens": 1, "request_id": "c"},
        "application/json",
        "",
        False,
    ),
    ({"prompt": LONG, "max_tokens": 2}, "application/vnd.api+json; charset=utf-8", "", True),
    (b'{"max_tokens": 1, "prompt": [ 7 ,\n 8 ], "request_id": "i"}', "application/json", "", True),
    ({"prompt_token_ids": [5], "prompt": [1, 2], "max_tokens": 1}, "application/json", "", False),
    (b'{"prompt": [9], "prompt": [2, 3], "max_tokens": 1}', "application/json", "", False),
    ({"meta": {"prompt": [9]}, "prompt": [4, 6], "max_tokens": 1}, "application/json", "", False),
    (b'{"pr\\u006fmpt": [4, 5], "max_tokens": 1}', "application/json", "", False),
    # What the schema coerces or refuses goes to the route.
    ({"prompt": [1, 2.0], "max_tokens": 1, "request_id": "d"}, "application/json", "", False),
    ({"prompt": [1, "2"], "max_tokens": 1, "request_id": "e"}, "application/json", "", False),
    ({"prompt": [1], "max_tokens": "2", "request_id": "f"}, "application/json", "", False),
    ({"prompt": [1], "max_tokens": True, "request_id": "g"}, "application/json", "", False),
    ({"prompt": [1], "max_tokens": 1, "request_id": "h"}, "application/json", "x=1", False),
    (
        {"prompt": LONG, "retention": {"ranges": [{"start": 0, "priority": 80}]}, "max_tokens": 1},
        "application/json",
        "",
        False,
    ),
    ({"prompt": [1, 2.5]}, "application/json", "", False),
    (b'{"prompt": [1, 02]}', "application/json", "", False),
    ({"prompt": []}, "application/json", "", False),
    ({"prompt": [512]}, "application/json", "", False),
    ({"prompt": [3, -1]}, "application/json", "", False),
    ({"prompt": [1, 2**40]}, "application/json", "", False),
    ({"prompt": [1] * 1_024}, "application/json", "", False),
    ({"prompt": [1] * 1_000, "max_tokens": 100}, "application/json", "", False),
    ({"prompt": [1], "max_tokens": 0}, "application/json", "", False),
    ({"prompt": [1], "priority": 2_000_000}, "application/json", "", False),
    ({"prompt": [1], "request_id": ""}, "application/json", "", False),
    ({"prompt": [1], "request_id": "x" * 129}, "application/json", "", False),
    ({"prompt": [1], "lora_task_id": -1}, "application/json", "", False),
    ({"prompt": [1], "cache_salt": ""}, "application/json", "", False),
    ({"prompt": [1], "stream": None}, "application/json", "", False),
    ({"prompt": [1], "model": 3}, "application/json", "", False),
    ({"prompt": [[1, 2]]}, "application/json", "", False),
    ({"prompt": "some text"}, "application/json", "", False),
    ({"max_tokens": 2}, "application/json", "", False),
    ([1, 2], "application/json", "", False),
    (b"{not json", "application/json", "", False),
    ({"prompt": [1]}, "text/plain", "", False),
    ({"prompt": [1]}, "", "", False),
]


def _raw(body: Any) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


def _normalised(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without what differs between two runs: the time, and a generated id."""
    answer = dict(answer)
    answer.pop("created", None)
    if str(answer.get("id", "")).startswith("cmpl-"):
        answer["id"] = "cmpl-*"
        answer["kvmesh"] = {**answer["kvmesh"], "request_id": "cmpl-*"}
    return answer


def _record_fast_path(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the fast path took each request, in order (``plain_job`` recorded)."""
    taken: list[bool] = []
    plain_job = fast_path.plain_job

    def recording(runtime: WorkerRuntime, body: bytes, shape: ModelShape) -> Job | None:
        job = plain_job(runtime, body, shape)
        taken.append(job is not None)
        return job

    monkeypatch.setattr(fast_path, "plain_job", recording)
    return taken


async def _answers(
    redis_url: str, use_fast_path: bool, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[int, dict[str, Any], dict[str, str], bool]]:
    """Each case's status, body, headers, and whether the fast path took it."""
    taken = _record_fast_path(monkeypatch)
    settings = worker_settings(redis_url, virtual_clock=True)
    results = []
    async with asgi_client(create_app(settings, fast_path=use_fast_path), "http://worker") as (
        client,
        _,
    ):
        for body, content_type, query, _fast in CASES:
            taken.clear()
            headers = {"content-type": content_type} if content_type else {}
            response = await client.post(
                "/v1/completions" + ("?" + query if query else ""),
                content=_raw(body),
                headers=headers,
            )
            kept = {
                name: response.headers[name]
                for name in ("content-type", "content-length", "retry-after")
                if name in response.headers
            }
            if "created" in response.json():  # its digits may differ in number
                kept.pop("content-length")
            results.append(
                (response.status_code, _normalised(response.json()), kept, taken == [True])
            )
    return results


async def test_the_fast_path_and_the_route_answer_alike(
    clean_redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast = await _answers(clean_redis_url, True, monkeypatch)
    route = await _answers(clean_redis_url, False, monkeypatch)
    for case, with_fast, without in zip(CASES, fast, route, strict=True):
        assert with_fast[:3] == without[:3], case
    assert [taken for *_, taken in fast] == [fast for *_, fast in CASES]
    assert not any(taken for *_, taken in route)
    statuses = [status for status, *_ in fast]
    assert statuses == [200] * 15 + [400] * (len(CASES) - 15)
    first, second, with_bools = (body for _, body, *_ in fast[:3])
    assert first["choices"][0]["token_ids"] == expected_output([1, 2, 3], 2)
    assert second["usage"]["prompt_tokens"] == 40
    assert with_bools["usage"]["prompt_tokens"] == 4
    scanned, other_key, twice, nested, escaped = (body for _, body, *_ in fast[4:9])
    assert scanned["choices"][0]["token_ids"] == expected_output([7, 8], 1)
    assert other_key["choices"][0]["token_ids"] == expected_output([1, 2], 1)
    assert twice["choices"][0]["token_ids"] == expected_output([2, 3], 1)
    assert nested["choices"][0]["token_ids"] == expected_output([4, 6], 1)
    assert escaped["choices"][0]["token_ids"] == expected_output([4, 5], 1)
    vocabulary = fast[18][1]["error"]
    assert vocabulary == {
        "message": "prompt: token id 512 at index 0 is outside the vocabulary 0..511",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }


@pytest.mark.parametrize(
    ("overrides", "drain", "status", "message", "retry_after"),
    [
        ({"max_queue_len": 0}, False, 429, "the queue is full (0 of 0 waiting)", "1"),
        ({}, True, 503, "the worker is draining (an operator asked for it)", "5"),
    ],
)
async def test_the_engine_refuses_alike_on_both_paths(
    clean_redis_url: str,
    overrides: dict[str, Any],
    drain: bool,
    status: int,
    message: str,
    retry_after: str,
) -> None:
    answers = []
    for path in ("protocol", "front", "route"):  # the server's protocol, the ASGI front, FastAPI
        settings = worker_settings(clean_redis_url, **overrides)
        app = create_app(settings, fast_path=path != "route")
        async with contextlib.AsyncExitStack() as stack:
            if path == "protocol":
                url = await stack.enter_async_context(served(app))
                client = await stack.enter_async_context(httpx.AsyncClient(base_url=url))
                runtime = app.state.runtime
            else:
                client, runtime = await stack.enter_async_context(asgi_client(app, "http://w"))
            if drain:
                runtime.admin_drain()
            response = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        answers.append((response.status_code, response.json(), response.headers["retry-after"]))
    assert answers[0] == answers[1] == answers[2]
    assert answers[0] == (
        status,
        {
            "error": {
                "message": message,
                "type": "rate_limit_error" if status == 429 else "unavailable_error",
                "param": None,
                "code": None,
            }
        },
        retry_after,
    )


async def test_the_front_leaves_streamed_expecting_and_oversized_bodies_to_the_framework(
    clean_redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = _record_fast_path(monkeypatch)
    body = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 2})

    async def chunks() -> Any:
        yield body

    settings = worker_settings(clean_redis_url, max_body_bytes=len(body))
    async with asgi_client(create_app(settings), "http://worker") as (client, _):
        plain = await client.post("/v1/completions", content=body, headers=JSON)
        streamed = await client.post("/v1/completions", content=chunks(), headers=JSON)
        expecting = await client.post(
            "/v1/completions", content=body, headers={**JSON, "expect": "100-continue"}
        )
        too_large = await client.post("/v1/completions", content=body + b" ", headers=JSON)
    assert taken == [True]  # only the plain one reached the fast path's checks
    answers = [r.json() for r in (plain, streamed, expecting)]
    assert {r.status_code for r in (plain, streamed, expecting)} == {200}
    assert [a["choices"][0]["token_ids"] for a in answers] == [expected_output([1, 2, 3], 2)] * 3
    assert (too_large.status_code, too_large.json()["error"]["message"]) == (
        413,
        f"request body is larger than {len(body)} bytes",
    )


async def test_the_servers_protocol_answers_completions_as_the_route_does(
    clean_redis_url: str,
) -> None:
    """A real server answers plain completions from its protocol (``fast_routes``): every
    case, the same status, body and headers as the FastAPI route, and only the plain ones
    taken there."""
    served_app = create_app(worker_settings(clean_redis_url, virtual_clock=True))
    route_app = create_app(worker_settings(clean_redis_url, virtual_clock=True), fast_path=False)
    taken: list[bool] = []
    completion = served_app.state.fast_routes[b"/v1/completions"]

    def counted(headers: list[tuple[bytes, bytes]], body: bytes) -> Any:
        answer = completion(headers, body)
        taken.append(answer is not None)
        return answer

    served_app.state.fast_routes = {b"/v1/completions": counted}
    async with (
        served(served_app) as url,
        httpx.AsyncClient(base_url=url) as real,
        asgi_client(route_app, "http://worker") as (routed, _),
    ):
        for body, content_type, query, fast in CASES:
            taken.clear()
            answers = []
            for client in (real, routed):
                response = await client.post(
                    "/v1/completions" + ("?" + query if query else ""),
                    content=_raw(body),
                    headers={"content-type": content_type} if content_type else {},
                )
                kept = {
                    name: response.headers[name]
                    for name in ("content-type", "retry-after")
                    if name in response.headers
                }
                assert response.headers["content-length"] == str(len(response.content))
                answers.append((response.status_code, _normalised(response.json()), kept))
            assert answers[0] == answers[1], body
            assert taken == ([fast] if not query else []), body


async def test_a_client_gone_cancels_its_job_on_the_protocols_path(clean_redis_url: str) -> None:
    settings = worker_settings(clean_redis_url, sim_decode_us_per_sequence=50_000.0)
    app = create_app(settings)
    async with served(app) as url:
        host, _, port = url.removeprefix("http://").partition(":")
        runtime: WorkerRuntime = app.state.runtime
        _, writer = await asyncio.open_connection(host, int(port))
        body = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 200, "request_id": "gone"})
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        engine = runtime.engine
        await eventually(lambda: [job.job_id for job in engine.running] == ["gone"])
        writer.close()
        await eventually(lambda: engine.stats.cancelled == 1)
        assert (engine.running, engine.jobs, engine.stats.finished) == ([], {}, 0)


def test_kvmesh_worker_runs_the_protocol_with_the_fast_route(clean_redis_url: str) -> None:
    """What ``kvmesh worker`` serves with: the protocol holding the plain completions route
    (a plain one-write protocol where the fast path is off)."""
    settings = worker_settings(clean_redis_url)
    fast = server_config(create_app(settings), settings).http
    plain = server_config(create_app(settings, fast_path=False), settings).http
    assert isinstance(fast, type) and fast.__name__ == "FastHttpToolsProtocol"
    assert set(fast.routes) == {b"/v1/completions"}  # type: ignore[attr-defined]
    assert plain is OneWriteHttpToolsProtocol
