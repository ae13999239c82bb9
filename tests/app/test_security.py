"""Nobody let in: admin tokens on both services, Redis ACL users and TLS, body and prompt limits,
a dashboard that cannot change anything, and no secret in any log line or error body.

Redis here is a private ``redis-server`` locked down as production should be (``redis_secure``):
the default user off, kvmesh's users with the ACL rules docs/reliability.md gives, and TLS with a
CA made for the test. The services run in-process, except in the log test, which greps the
output of real ``kvmesh worker`` and ``kvmesh router`` processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi import FastAPI

from app.core.net import free_port
from app.core.redis import RedisCredentialsError
from app.dashboard.settings import DashboardSettings
from app.services import dashboard_app, router_app
from app.worker.app import create_app as worker_app
from events.keys import DECISIONS_KEY
from events.redis_io import redis_client
from tests.app.redis_secure import ROUTER_RULES, SHARED_RULES, WORKER_RULES, SecureRedis
from tests.app.router_support import router_client, router_settings
from tests.app.worker_support import AUTH, worker_client, worker_settings
from tests.support.processes import sim_worker_args, wait_ready
from tests.support.wait import eventually, wait_for

PROMPT = list(range(100, 200))  # 100 tokens: 6 full blocks of 16
PASSWORD = "redis-pw-Q9x2Lk7v"  # what must never show in a log line or an answer
WRONG = {"Authorization": "Bearer wrong-token"}
NEED_BEARER = "admin calls need 'Authorization: Bearer <token>'"


@contextlib.asynccontextmanager
async def dashboard_client(redis_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """A standalone dashboard (``kvmesh dashboard``) in-process."""
    app = dashboard_app(DashboardSettings.model_validate({"redis_url": redis_url}))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://dashboard") as client:
            yield client, app


def _cached_blocks(frame: dict[str, Any], worker: str) -> int:
    rows = {row["worker"]: row for row in frame["workers"]}
    cached: int = rows[worker]["gpu"]["cached"] if worker in rows else 0
    return cached


async def round_trip(worker_url: str, router_url: str, dashboard_url: str) -> None:
    """A worker serves PROMPT; the router routes it back there with 96 tokens cached, and the
    dashboard shows the worker's 7 blocks (6 full, 1 partial): every Redis path of kvmesh, with
    those URLs."""
    async with (
        worker_client(worker_settings(worker_url)) as (worker, _),
        router_client(router_settings(router_url)) as (router, runtime),
        dashboard_client(dashboard_url) as (dashboard, _),
    ):
        done = await worker.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert done.status_code == 200, done.text
        await eventually(lambda: runtime.readiness()["ready"])
        await eventually(lambda: runtime.index.stats()["per_worker"]["w0"]["blocks"] == 7)
        decision = (await router.post("/route", json={"prompt_token_ids": PROMPT})).json()
        assert (decision["worker"], decision["expected_cached_tokens"]) == ("w0", 96)
        assert decision["fresh"] is True
        # The dashboard has its own consumer: poll its frames for up to 10 s (a loaded CI
        # machine can take seconds to bring up a third consumer and replay the worker's stream).
        deadline = time.monotonic() + 10.0
        frame = (await dashboard.get("/dashboard/state")).json()
        while _cached_blocks(frame, "w0") != 7 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            frame = (await dashboard.get("/dashboard/state")).json()
        assert _cached_blocks(frame, "w0") == 7
        assert (await worker.get("/ready")).json()["checks"]["redis"] is True
        # Fleet admin: the cordon is written to Redis, read back by the sync loop, removed.
        cordoned = await router.post("/workers/w0/cordon", headers=AUTH)
        assert cordoned.status_code == 200, cordoned.text
        await eventually(lambda: runtime.core.workers["w0"].state == "cordoned")
        uncordoned = await router.post("/workers/w0/uncordon", headers=AUTH)
        assert uncordoned.status_code == 200, uncordoned.text
        await eventually(lambda: runtime.core.workers["w0"].state == "up")


# -- admin tokens --------------------------------------------------------------------------------


def _operations(app: FastAPI) -> dict[str, bool]:
    """Every operation of the app's OpenAPI schema: whether it reads the Authorization header
    (the admin check)."""
    return {
        f"{method.upper()} {path}": any(
            p["in"] == "header" and p["name"].lower() == "authorization"
            for p in op.get("parameters", [])
        )
        for path, methods in app.openapi()["paths"].items()
        for method, op in methods.items()
    }


def _admin_routes(app: FastAPI) -> set[str]:
    return {name for name, admin in _operations(app).items() if admin}


def _mutating_routes(app: FastAPI) -> set[str]:
    return {name for name in _operations(app) if not name.startswith(("GET ", "HEAD "))}


def test_every_call_that_changes_state_needs_the_admin_token(redis_url: str) -> None:
    """All mutating routes are admin routes, but the requests themselves (completions, route
    decisions); nothing else takes a body that changes state."""
    worker = worker_app(worker_settings(redis_url))
    router = router_app(router_settings(redis_url))
    dashboard = dashboard_app(DashboardSettings.model_validate({"redis_url": redis_url}))
    assert _mutating_routes(worker) - _admin_routes(worker) == {
        "POST /v1/completions",
        "POST /v1/chat/completions",
    }
    assert _admin_routes(worker) == {
        "POST /cache/clear",
        "POST /cache/offload",
        "POST /blocks/pin",
        "POST /blocks/unpin",
        "POST /requests/{request_id}/cancel",
        "POST /drain",
        "POST /resume",
    }
    assert _mutating_routes(router) - _admin_routes(router) == {
        "POST /route",
        "POST /route/explain",
        "POST /v1/completions",
        "POST /v1/chat/completions",
    }
    assert _admin_routes(router) == {
        "PUT /policy",
        "POST /workers/{worker_id}/cordon",
        "POST /workers/{worker_id}/drain",
        "POST /workers/{worker_id}/uncordon",
    }
    assert _mutating_routes(dashboard) == set()


WORKER_ADMIN_CALLS: list[tuple[str, dict[str, Any] | None]] = [
    ("/cache/clear", None),
    ("/cache/offload", {"max_blocks": 10}),
    ("/blocks/pin", {"block_hashes": "FIRST"}),
    ("/blocks/unpin", {"block_hashes": "FIRST"}),
    ("/requests/live/cancel", None),
    ("/drain", None),
    ("/resume", None),
]


@pytest.mark.parametrize(
    ("headers", "status", "message"),
    [
        ({}, 401, NEED_BEARER),
        ({"Authorization": "Basic dGVzdA=="}, 401, NEED_BEARER),
        ({"Authorization": "Bearer"}, 401, NEED_BEARER),
        (WRONG, 403, "wrong admin token"),
        ({"Authorization": AUTH["Authorization"] + "x"}, 403, "wrong admin token"),
        ({"Authorization": AUTH["Authorization"][:-1]}, 403, "wrong admin token"),
    ],
)
async def test_worker_admin_calls_refuse_a_missing_or_wrong_token_and_change_nothing(
    clean_redis_url: str, headers: dict[str, str], status: int, message: str
) -> None:
    settings = worker_settings(clean_redis_url, sim_step_overhead_ms=5.0)
    async with worker_client(settings) as (client, runtime):
        done = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert done.status_code == 200
        live = asyncio_task(
            client.post(
                "/v1/completions", json={"prompt": [1, 2], "max_tokens": 40, "request_id": "live"}
            )
        )
        await eventually(lambda: "live" in runtime.engine.jobs)
        first = (await client.get("/blocks")).json()["blocks"][0]["hash"]
        before = (await client.get("/blocks")).json()
        for path, body in WORKER_ADMIN_CALLS:
            payload = {"block_hashes": [first]} if body == {"block_hashes": "FIRST"} else body
            response = await client.post(path, json=payload, headers=headers)
            assert response.status_code == status, (path, response.text)
            assert response.json()["error"]["message"] == message
            if status == 401:
                assert response.headers["www-authenticate"] == "Bearer"
        assert "live" in runtime.engine.jobs  # not cancelled
        assert (await client.get("/blocks")).json() == before  # nothing cleared or offloaded
        window = next(iter(runtime.mgr.windows.values()))
        assert not window.pins
        finished = await live
        assert finished.json()["choices"][0]["finish_reason"] == "length"


def asyncio_task(coro: Any) -> Any:
    import asyncio

    return asyncio.ensure_future(coro)


@pytest.mark.parametrize(
    ("token", "headers", "status"),
    [
        (None, AUTH, 403),  # no token configured: admin calls are off, never open
        ("test-admin-token", {}, 401),
        ("test-admin-token", {"Authorization": "Basic x"}, 401),
        ("test-admin-token", WRONG, 403),
        ("test-admin-token", {"Authorization": "Bearer test-admin-tokenx"}, 403),
    ],
)
async def test_router_policy_refuses_a_missing_or_wrong_token(
    clean_redis_url: str, token: str | None, headers: dict[str, str], status: int
) -> None:
    async with router_client(router_settings(clean_redis_url, admin_token=token)) as (
        router,
        runtime,
    ):
        before = (await router.get("/policy")).json()
        update = {"policy": "round_robin", "weights": {"load": 5.0}}
        response = await router.put("/policy", json=update, headers=headers)
        assert response.status_code == status
        assert response.json()["error"]["type"] in ("authentication_error", "permission_error")
        if token is None:
            assert response.json()["error"]["message"] == (
                "admin calls are disabled: the router has no admin token"
            )
        assert (await router.get("/policy")).json() == before
        assert runtime.core.policy == "kv_aware"


# -- Redis ACL users -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["one user", "worker and router users"])
async def test_services_work_with_only_the_documented_acl(layout: str) -> None:
    users = (
        {"kvmesh": (PASSWORD, SHARED_RULES)}
        if layout == "one user"
        else {"kvmesh-worker": (PASSWORD, WORKER_RULES), "kvmesh-router": (PASSWORD, ROUTER_RULES)}
    )
    with SecureRedis(users) as server:
        worker_user = "kvmesh" if layout == "one user" else "kvmesh-worker"
        router_user = "kvmesh" if layout == "one user" else "kvmesh-router"
        await round_trip(server.url(worker_user), server.url(router_user), server.url(router_user))
        # Nothing kvmesh sent was refused: the rules are enough ...
        assert server.denied() == []
        # ... and no more than kvmesh needs.
        with redis.Redis.from_url(server.url(router_user)) as client:
            refused: list[tuple[str, ...]] = [("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*")]
            for command in [*refused, ("GET", "x")]:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
            if layout != "one user":
                # A router cannot write events, snapshots, the registry or a heartbeat.
                for write in (
                    ("XADD", "kvmesh:{w0}:events", "*", "a", "1"),
                    ("SET", "kvmesh:{w0}:snapshot", "x"),
                    ("SET", "kvmesh:{w0}:alive", "1"),
                    ("HSET", "kvmesh:workers", "w9", "{}"),
                    ("DEL", "kvmesh:{w0}:events"),
                ):
                    with pytest.raises(redis.exceptions.NoPermissionError):
                        client.execute_command(*write)
                assert client.set("kvmesh:{w0}:snapshot:request", "1")
        if layout != "one user":
            with (
                redis.Redis.from_url(server.url(worker_user)) as client,
                pytest.raises(redis.exceptions.NoPermissionError),
            ):
                client.execute_command("XREAD", "STREAMS", "kvmesh:{w1}:events", "0")


async def test_a_wrong_or_missing_password_stops_each_service_with_a_clear_message() -> None:
    with SecureRedis({"kvmesh": (PASSWORD, SHARED_RULES)}) as server:
        wrong = server.url("kvmesh", password="not-the-password")
        missing = f"redis://127.0.0.1:{server.port}/0"
        cases = [
            ("worker w0", lambda url: worker_client(worker_settings(url))),
            ("router", lambda url: router_client(router_settings(url))),
            ("dashboard", dashboard_client),
        ]
        for service, client in cases:
            with pytest.raises(RedisCredentialsError) as refused:
                async with client(wrong):
                    pass
            assert str(refused.value) == (
                f"{service}: Redis at 127.0.0.1:{server.port} refused user 'kvmesh' (invalid "
                "username-password pair or user is disabled); check the user and password in "
                "REDIS_URL and the user's ACL"
            )
            with pytest.raises(RedisCredentialsError) as refused:
                async with client(missing):
                    pass
            assert str(refused.value).startswith(
                f"{service}: Redis at 127.0.0.1:{server.port} needs a user and password, and "
                "REDIS_URL gives none (redis://USER:PASSWORD@HOST:PORT/DB); it said: "
            )
        assert "not-the-password" not in str(server.denied())


# -- TLS -----------------------------------------------------------------------------------------


async def test_worker_router_and_dashboard_over_tls_with_a_ca_file() -> None:
    with SecureRedis({"kvmesh": (PASSWORD, SHARED_RULES)}, tls=True) as server:
        url = server.url("kvmesh")
        assert url.startswith("rediss://kvmesh:") and "?ssl_ca_certs=/" in url
        await round_trip(url, url, url)
        assert server.denied() == []
        # Without the CA the server's certificate is refused (nothing falls back to plain text).
        untrusted = redis_client(url.partition("?")[0])
        with pytest.raises(redis.exceptions.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusted.ping()
        await untrusted.aclose()
        plain = redis_client(url.replace("rediss://", "redis://").partition("?")[0])
        with pytest.raises(redis.exceptions.ConnectionError):
            await plain.ping()
        await plain.aclose()


# -- limits --------------------------------------------------------------------------------------


async def _chunks(data: bytes, size: int = 256) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


ROUTER_BODY_PATHS = ["/route", "/route?explain=true", "/route/explain", "/v1/completions"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_bodies_over_the_limit_are_413_on_both_services(
    clean_redis_url: str, chunked: bool
) -> None:
    """Regression: a chunked ``POST /route`` over the limit raised out of the router's fast path
    (a 500 behind uvicorn); ``BodyLimit`` now answers it itself."""
    big = json.dumps({"prompt": list(range(400)), "max_tokens": 1}).encode()
    assert len(big) > 1_024
    headers = {"content-type": "application/json"}
    answers: dict[str, httpx.Response] = {}
    async with (
        worker_client(worker_settings(clean_redis_url, max_body_bytes=1_024)) as (worker, _),
        router_client(router_settings(clean_redis_url, max_body_bytes=1_024)) as (router, _),
    ):
        for name, client, paths in (
            ("worker", worker, ["/v1/completions", "/blocks/pin"]),
            ("router", router, ROUTER_BODY_PATHS),
        ):
            for path in paths:
                content = _chunks(big) if chunked else big
                answers[f"{name} {path}"] = await client.post(
                    path, content=content, headers={**headers, **AUTH}
                )
    for where, response in answers.items():
        assert response.status_code == 413, (where, response.text)
        assert response.json()["error"] == {
            "message": "request body is larger than 1024 bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }


@pytest.mark.parametrize("path", ROUTER_BODY_PATHS)
async def test_router_refuses_a_prompt_over_max_prompt_tokens(
    clean_redis_url: str, path: str
) -> None:
    async with router_client(router_settings(clean_redis_url, max_prompt_tokens=64)) as (
        router,
        _,
    ):
        body: dict[str, Any] = {"prompt": list(range(65))}
        if path == "/v1/completions":
            body["max_tokens"] = 1
        over = await router.post(path, json=body)
        at = await router.post("/route", json={"prompt": list(range(64))})
    assert over.status_code == 400, over.text
    assert over.json()["error"]["param"] == "prompt"
    assert over.json()["error"]["message"] == "prompt: 65 tokens; the router takes at most 64"
    assert at.status_code == 503  # accepted; no worker is up to take it


async def test_worker_refuses_a_prompt_over_its_window(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url, max_seq_len=128)) as (client, rt):
        over = await client.post("/v1/completions", json={"prompt": [1] * 129, "max_tokens": 1})
        assert not rt.engine.jobs
    assert over.status_code == 400, over.text
    assert over.json()["error"]["param"] == "prompt"
    assert over.json()["error"]["message"] == (
        "prompt: 129 tokens; this model's window is 128 tokens (prompt + max_tokens), "
        "so a prompt takes at most 127"
    )


# -- the dashboard is read-only ------------------------------------------------------------------


_DECISIONS = DECISIONS_KEY.encode()


def _redis_keys(url: str) -> dict[bytes, bytes]:
    """Every key with its type, but the ones that change on their own (heartbeat and load)."""
    with redis.Redis.from_url(url) as client:
        return {
            key: client.type(key)
            for key in client.scan_iter("*")
            if not key.endswith((b":alive", b":load"))
        }


@pytest.mark.parametrize("routing", [True, False], ids=["router", "standalone dashboard"])
async def test_the_dashboard_answers_only_get(clean_redis_url: str, routing: bool) -> None:
    if routing:
        app = router_app(router_settings(clean_redis_url))
    else:
        app = dashboard_app(DashboardSettings.model_validate({"redis_url": clean_redis_url}))
    paths = ["/dashboard", "/dashboard/state", "/dashboard/stream", "/dashboard/static/app.js"]
    paths[-1] = "/dashboard/static/dashboard.js"
    async with (
        worker_client(worker_settings(clean_redis_url)) as (worker, _),
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client,
    ):
        view = app.state.runtime.view if routing else app.state.view
        await worker.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        await eventually(lambda: view.index.stats()["per_worker"].get("w0", {}).get("blocks"))
        if routing:  # the router's hello to other routers (app.router.share) is written
            await eventually(lambda: _DECISIONS in _redis_keys(clean_redis_url))
        keys = _redis_keys(clean_redis_url)
        index = view.index.stats()
        for path in paths:
            for method in ("POST", "PUT", "DELETE", "PATCH"):
                body = {"policy": "random"}
                response = await client.request(method, path, json=body, headers=AUTH)
                assert response.status_code == 405, (method, path, response.text)
                assert response.json()["error"]["message"] == "Method Not Allowed"
                assert "POST" not in response.headers.get("allow", "GET")
        assert (await client.get("/dashboard/state")).status_code == 200
        assert app.state.dashboard.hub.clients == 0
        if routing:
            assert app.state.runtime.core.policy == "kv_aware"
        assert view.index.stats() == index
        assert _redis_keys(clean_redis_url) == keys


# -- no secret in a log line or an answer --------------------------------------------------------

TOKEN = "admin-tok-Zr81mPq3"


def _secrets_in(text: str) -> list[str]:
    from urllib.parse import quote

    found = []
    for secret in (TOKEN, PASSWORD, "not-the-password"):
        for form in {secret, quote(secret, safe=""), secret[2:-2]}:
            if form in text:
                found.append(form)
    return found


@contextlib.contextmanager
def _service(
    command: str, args: list[str], env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[str]]:
    """``kvmesh COMMAND ARGS``, its output into ``log`` (a pipe nobody reads would fill)."""
    script = Path(sys.executable).parent / "kvmesh"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(script), command, *args],
            env={**os.environ, **env},
            stdout=out,
            stderr=out,
            text=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)


def _exchanges(worker: str, router: str) -> list[httpx.Response]:
    """Wrong tokens, bad requests and good ones, to both services."""
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    near = [{"Authorization": f"Bearer {TOKEN[:-1]}"}, {"Authorization": f"Basic {TOKEN}"}, {}]
    calls: list[tuple[str, str, dict[str, str], Any]] = [
        *(("POST", f"{worker}/cache/clear", headers, None) for headers in near),
        *(("PUT", f"{router}/policy", headers, {"policy": "random"}) for headers in near),
        ("POST", f"{worker}/blocks/pin", bearer, {"block_hashes": ["x"]}),
        ("POST", f"{worker}/blocks/pin", bearer, {"block_hashes": [12345]}),
        ("PUT", f"{router}/policy", bearer, {"policy": "nope"}),
        ("PUT", f"{router}/policy", bearer, {"weights": {"load": -1}}),
        ("POST", f"{worker}/v1/completions", bearer, {"prompt": [1, 99999], "max_tokens": 1}),
        ("POST", f"{worker}/v1/completions", {}, b"{not json"),
        ("POST", f"{router}/v1/completions", bearer, {"prompt": "text", "max_tokens": 1}),
        ("POST", f"{router}/v1/completions", {}, {"prompt": PROMPT, "max_tokens": 2}),
        ("POST", f"{router}/route", {}, {"prompt": [-1]}),
        ("POST", f"{router}/route", {}, b"\xff\xfe"),
        ("POST", f"{router}/dashboard/state", bearer, None),
        ("GET", f"{router}/nope", bearer, None),
        *(
            ("GET", f"{worker}{path}", bearer, None)
            for path in ("/config", "/stats", "/ready", "/metrics", "/openapi.json", "/events")
        ),
        *(
            ("GET", f"{router}{path}", bearer, None)
            for path in ("/workers", "/index/stats", "/ready", "/metrics", "/dashboard/state")
        ),
    ]
    answers = []
    for method, url, headers, body in calls:
        content = body if isinstance(body, bytes) else None
        payload = None if isinstance(body, bytes) else body
        answers.append(
            httpx.request(method, url, headers=headers, json=payload, content=content, timeout=10)
        )
    return answers


def test_no_secret_in_any_log_line_or_answer(tmp_path: Path) -> None:
    """A worker and a router as processes, at DEBUG, with an admin token and a Redis password
    (both in the environment): wrong tokens, bad requests, a worker given a wrong password, and
    Redis going away; no answer and no line of their output holds either secret."""
    with SecureRedis({"kvmesh": (PASSWORD, SHARED_RULES)}) as server:
        url = server.url("kvmesh")
        env = {"KVMESH_ADMIN_TOKEN": TOKEN, "REDIS_URL": url, "KVMESH_LOG_LEVEL": "DEBUG"}
        ports = {"worker": free_port(), "router": free_port()}
        worker_args = sim_worker_args("w0", ports["worker"], url, num_blocks=128, heartbeat_ttl_s=2)
        worker_args = worker_args[:4] + worker_args[6:]  # no --redis-url: REDIS_URL instead
        assert url not in worker_args
        router_args = ["--port", str(ports["router"]), "--load-interval-s", "0.05"]
        logs = {name: tmp_path / f"{name}.log" for name in ("worker", "router", "refused")}
        worker_base = f"http://127.0.0.1:{ports['worker']}"
        router_base = f"http://127.0.0.1:{ports['router']}"
        with (
            _service("worker", worker_args, env, logs["worker"]) as worker,
            _service("router", router_args, env, logs["router"]) as router,
        ):
            wait_ready(worker_base, worker)
            wait_ready(router_base, router)
            answers = _exchanges(worker_base, router_base)
            statuses = [a.status_code for a in answers]
            assert statuses[:6] == [403, 401, 401, 403, 401, 401]
            assert 200 in statuses and 400 in statuses and 405 in statuses
            for answer in answers:
                assert answer.status_code < 500, (answer.request.url, answer.text)
                text = answer.text + json.dumps(dict(answer.headers))
                assert _secrets_in(text) == [], (answer.request.url, answer.text)

            wrong_env = {**env, "REDIS_URL": server.url("kvmesh", password="not-the-password")}
            refused_args = sim_worker_args("w9", free_port(), "", num_blocks=8, heartbeat_ttl_s=2)
            refused_args = refused_args[:4] + refused_args[6:]
            with _service("worker", refused_args, wrong_env, logs["refused"]) as refused:
                assert refused.wait(timeout=30) != 0

            server.close()  # Redis goes away: both services log what failed
            wait_for(
                lambda: (
                    "Redis" in logs["router"].read_text()[-3000:]
                    and "failed" in logs["worker"].read_text()[-3000:]
                ),
                timeout_s=15,
            )
            for proc in (worker, router):
                proc.send_signal(signal.SIGTERM)
            for proc in (worker, router):
                proc.wait(timeout=20)
    output = {name: path.read_text(errors="replace") for name, path in logs.items()}
    assert "worker w0: ready (registered in Redis)" in output["worker"]
    assert "Redis write failed" in output["worker"] or "Redis is not answering" in output["worker"]
    assert "consumer: Redis read failed" in output["router"]
    assert (
        f"worker w9: Redis at 127.0.0.1:{server.port} refused user 'kvmesh' (invalid "
        "username-password pair or user is disabled)"
    ) in output["refused"]
    for name, text in output.items():
        assert _secrets_in(text) == [], f"{name}: {_secrets_in(text)}"
