"""Property-based fuzz of the router's HTTP API, driven by the router's own OpenAPI schema.

One router and two workers (``w0``, ``w1``) run in-process for the whole module, on a private
Redis, the workers publishing real events; the router's proxy reaches them through an httpx
transport that dispatches on the worker's advertised host, so completions go all the way to a
worker's engine and back. Each Hypothesis example resets the routing policy, then sends one to
five requests at once, each built from its operation's schema with the worker fuzz's value
strategies (``tests/app/test_worker_fuzz.py``): schema-valid or arbitrary JSON bodies, raw bytes,
wrong content types, query values of every kind, with the admin token, without it or a wrong
one; and stray requests (wrong methods, unknown paths).

The property: no request gets a 5xx or raises out of the app or hangs, and every 4xx is
OpenAI's error shape. ``GET /dashboard/stream`` never ends, so it is left to its own tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.core.embedded_redis import EmbeddedRedis
from app.router.runtime import RouterRuntime
from app.router.upstream import HttpxUpstream
from app.services import router_app
from app.worker.app import create_app as worker_app
from tests.app.router_support import router_settings
from tests.app.worker_support import ADMIN_TOKEN, AUTH, worker_settings
from tests.support.openapi import (
    CONTENT_TYPES,
    RAW_BODIES,
    SchemaValues,
    check_error_shape,
    completion_hints,
    json_values,
    mostly,
    operations,
    strings,
)

REQUEST_TIMEOUT_S = 10.0
SKIPPED = {"GET /dashboard/stream", "GET /openapi.json"}
WRONG_AUTH = [
    "Bearer wrong-token",
    f"Bearer {ADMIN_TOKEN}x",
    f"Basic {ADMIN_TOKEN}",
    ADMIN_TOKEN,
    "Bearer ",
    "",
]


class Dispatch(httpx.AsyncBaseTransport):
    """The router's proxy transport: ``http://<worker>.fuzz`` to that worker's app."""

    def __init__(self, apps: dict[str, Any]) -> None:
        self.transports = {host: httpx.ASGITransport(app=app) for host, app in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.transports[request.url.host].handle_async_request(request)


@dataclass
class Cluster:
    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient
    runtime: RouterRuntime
    openapi: dict[str, Any]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two workers and a router, alive for the module on a loop of their own: each example runs
    on it with ``run_until_complete`` (the workers' heartbeats outlast the pauses between)."""
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()

    async def start(url: str) -> Cluster:
        apps = {}
        for worker in ("w0", "w1"):
            settings = worker_settings(
                url, worker_id=worker, advertise_url=f"http://{worker}.fuzz", heartbeat_ttl_s=60.0
            )
            app = worker_app(settings)
            await stack.enter_async_context(app.router.lifespan_context(app))
            apps[f"{worker}.fuzz"] = app
        router = router_app(router_settings(url, max_prompt_tokens=4_096))
        await stack.enter_async_context(router.router.lifespan_context(router))
        runtime: RouterRuntime = router.state.runtime
        await runtime.http.aclose()
        runtime.http = httpx.AsyncClient(transport=Dispatch(apps), timeout=REQUEST_TIMEOUT_S)
        runtime.upstream = HttpxUpstream(runtime.http)
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://router")
        )
        async with asyncio.timeout(15):
            while not runtime.readiness()["ready"] or len(runtime.core.workers) < 2:
                await asyncio.sleep(0.02)
        openapi = (await client.get("/openapi.json")).json()
        return Cluster(loop, client, runtime, openapi)

    with EmbeddedRedis() as server:
        try:
            yield loop.run_until_complete(start(server.url))
        finally:
            loop.run_until_complete(stack.aclose())
            loop.close()


@dataclass
class Sent:
    method: str
    path: str
    params: list[tuple[str, str | int | float | bool | None]]
    headers: dict[str, str]
    content: bytes | None

    def __str__(self) -> str:
        body = None if self.content is None else self.content[:600]
        return f"{self.method} {self.path} params={self.params} headers={self.headers} {body!r}"


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = value if isinstance(value, str) else json.dumps(value)
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def requests(openapi: dict[str, Any]) -> st.SearchStrategy[Sent]:
    values = SchemaValues(openapi.get("components", {}).get("schemas", {}), completion_hints())
    ops = [op for op in operations(openapi) if op.name not in SKIPPED]

    def build(op: Any) -> st.SearchStrategy[Sent]:
        body_schema = json.loads(op.body_schema) if op.body_schema else None
        queries = [(name, values.valid(json.loads(schema))) for name, schema in op.query_params]

        @st.composite
        def draw_one(draw: st.DrawFn) -> Sent:
            params: list[tuple[str, str | int | float | bool | None]] = []
            for name, strategy in queries:
                for _ in range(draw(st.sampled_from([1, 1, 0, 2]))):
                    params.append((name, _text(draw(mostly(strategy, strings(), 7)))))
            headers = {"content-type": "application/json"}
            mode = draw(st.integers(0, 19))
            content: bytes | None
            if body_schema is not None and mode < 14:
                strict = mode < 9
                body = draw(values.valid(body_schema, strict=strict))
                content = json.dumps(body, allow_nan=False).encode()
            elif mode < 16:
                content = json.dumps(draw(json_values()), allow_nan=False).encode()
            elif mode < 17:
                content, headers = None, {}
            else:
                content = draw(st.one_of(st.sampled_from(RAW_BODIES), st.binary(max_size=40)))
            if content is not None and draw(st.integers(0, 9)) == 0:
                kind = draw(st.sampled_from(CONTENT_TYPES))
                headers = {"content-type": kind} if kind is not None else {}
            good = st.just(AUTH["Authorization"])
            auth = draw(mostly(good, st.one_of(st.none(), st.sampled_from(WRONG_AUTH)), 6))
            if auth is not None:
                headers["authorization"] = auth
            return Sent(op.method, op.path, params, headers, content)

        return draw_one()

    stray = st.builds(
        Sent,
        method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
        path=st.sampled_from(
            [op.path for op in ops] + ["/", "/v1", "/v1/chat/completions", "/dashboard/x"]
        ),
        params=st.just([]),
        headers=st.just({"content-type": "application/json"}),
        content=st.one_of(st.none(), st.sampled_from([b"{}", b'{"prompt": [1]}'])),
    )
    weights = {"POST /route": 4, "POST /v1/completions": 4, "PUT /policy": 2}
    choices = [stray] + [build(op) for op in ops for _ in range(weights.get(op.name, 1))]
    return st.sampled_from(choices).flatmap(lambda strategy: strategy)


async def exchange(cluster: Cluster, sent: Sent) -> None:
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            response = await cluster.client.request(
                sent.method, sent.path, params=sent.params, headers=sent.headers,
                content=sent.content,
            )  # fmt: skip
    except TimeoutError:
        raise AssertionError(f"hang: no answer in {REQUEST_TIMEOUT_S} s to {sent}") from None
    except Exception as exc:  # raised out of the app: a 500 behind a real server
        trace = "".join(traceback.format_exception(exc))
        raise AssertionError(f"5xx (the app raised) for {sent}:\n{trace}") from exc
    context = f"{sent}\n-> {response.status_code} {response.text[:1000]}"
    assert response.status_code < 500, f"5xx: {context}"
    if response.status_code >= 400:
        check_error_shape(response, context)


async def run_example(cluster: Cluster, batch: list[Sent]) -> None:
    core = cluster.runtime.core
    settings = cluster.runtime.settings
    core.policy, core.weights = settings.policy, settings.weights()
    results = await asyncio.gather(*(exchange(cluster, s) for s in batch), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    assert not core.inflight, f"requests left in flight: {list(core.inflight)}"


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzz_router_api_from_openapi(cluster: Cluster, data: st.DataObject) -> None:
    batch = data.draw(st.lists(requests(cluster.openapi), min_size=1, max_size=5), label="batch")
    cluster.loop.run_until_complete(run_example(cluster, batch))
