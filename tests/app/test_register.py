"""Engines that publish no KV events: ``kvmesh register`` (a real process) puts a plain
OpenAI-compatible server (a small FastAPI app in the test, on a real port) in the registry, and
a real ``kvmesh router`` places each conversation's next turn on the server it sent the last one
to, marked ``approximate``. The router's approximate prefix tree: what it sent, for its TTL,
within the worker's capacity (least recently sent dropped first, a chain's leaves before its
root)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port
from app.ingest.settings import RegisterSettings
from app.router.core import RouterCore
from events.index import PrefixIndex
from tests.support.processes import service_process, wait_ready
from tests.support.wait import wait_for

DEMO_MODEL = Path(__file__).resolve().parents[2] / "app" / "demo" / "chat-model"


class Engine:
    """An OpenAI-compatible server without KV events, in a thread; records what it got."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: list[dict[str, Any]] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.received.append(body)
            message = {"role": "assistant", "content": f"answer from {name}"}
            return {
                "id": f"chatcmpl-{name}-{len(self.received)}",
                "object": "chat.completion",
                "created": 1,
                "model": body.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[Engine]:
        self.thread.start()
        wait_for(lambda: self.server.started)
        try:
            yield self
        finally:
            self.server.should_exit = True
            self.thread.join(timeout=10)


def test_a_server_without_events_is_routed_by_what_was_sent(
    embedded_redis: EmbeddedRedis,
) -> None:
    redis_url = embedded_redis.url
    base = f"http://127.0.0.1:{free_port()}"
    engines = {name: Engine(name) for name in ("e0", "e1")}
    with contextlib.ExitStack() as stack:
        for engine in engines.values():
            stack.enter_context(engine.running())
        registered = {
            name: stack.enter_context(
                service_process(
                    "register",
                    [
                        *("--url", engine.url, "--worker-id", name, "--redis-url", redis_url),
                        *("--served-model-name", "m", "--block-size", "16"),
                        *("--capacity-blocks", "1000"),
                    ],
                )
            )
            for name, engine in engines.items()
        }
        router_args = ["--port", base.rpartition(":")[2], "--redis-url", redis_url]
        router_args += ["--model", f"m={DEMO_MODEL}", "--load-interval-s", "0.05"]
        router = stack.enter_context(service_process("router", router_args))
        wait_ready(base, router)

        def workers() -> dict[str, dict[str, Any]]:
            return {w["worker"]: w for w in httpx.get(f"{base}/workers").json()["workers"]}

        wait_for(
            lambda: sorted(w for w, e in workers().items() if e["state"] == "up") == ["e0", "e1"]
        )
        listed = workers()
        assert [(listed[w]["approximate"], listed[w]["model"]) for w in ("e0", "e1")] == [
            (True, "m"),
            (True, "m"),
        ]

        chat = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a short story about a dragon in the mountain."},
        ]
        first = httpx.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": chat})
        assert first.status_code == 200, first.text
        chosen = first.headers["x-kvmesh-worker"]
        other = "e1" if chosen == "e0" else "e0"
        assert first.json()["choices"][0]["message"]["content"] == f"answer from {chosen}"

        turn2 = [*chat, first.json()["choices"][0]["message"], {"role": "user", "content": "Then?"}]
        explained = httpx.post(
            f"{base}/route/explain", json={"model": "m", "messages": turn2}
        ).json()
        by_worker = {w["worker"]: w for w in explained["workers"]}
        assert explained["worker"] == chosen
        assert by_worker[chosen]["approximate"] is True
        assert by_worker[chosen]["index_blocks"] == 0  # no events: only what was sent
        assert by_worker[chosen]["predicted_blocks"] >= 2
        assert by_worker[other]["matched_blocks"] == 0

        second = httpx.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": turn2})
        assert second.headers["x-kvmesh-worker"] == chosen
        # The engine got the client's body as sent: it tokenizes the prompt itself.
        assert engines[chosen].received == [
            {"model": "m", "messages": chat},
            {"model": "m", "messages": turn2},
        ]
        assert engines[other].received == []

        # A clean stop unregisters: the router stops routing to it.
        registered[other].send_signal(signal.SIGTERM)
        assert registered[other].wait(timeout=10) == 0
        wait_for(lambda: other not in workers())


def test_the_approximate_tree_keeps_what_was_sent_within_capacity_and_ttl() -> None:
    now = [100.0]
    core = RouterCore(PrefixIndex(), tokens_per_block=4, approx_ttl_s=60.0, clock=lambda: now[0])
    core.upsert_worker("a", url="http://a", capacity_blocks=5, approximate=True)
    core.upsert_worker("x", url="http://x", capacity_blocks=100)
    first, second = list(range(12)), list(range(100, 112))  # 3 blocks each
    h1, h2 = core.hashes(first), core.hashes(second)

    decision = core.decide(h1, 12, exclude=("x",))
    core.begin("r1", decision, h1, 12)
    core.finish("r1")
    assert [c.matched_blocks for c in core.candidates(h1)] == [3, 0]
    # Past the exact workers' 2 s prediction, the approximate worker still holds it.
    now[0] += 30.0
    assert core.candidates(h1)[0].matched_blocks == 3
    # Over its capacity (5 blocks), the least recently sent go first, leaves before roots: h1's
    # last block, so h1 still matches its first two.
    core.begin("r2", core.decide(h2, 12, exclude=("x",)), h2, 12)
    assert core.num_predicted("a") == 5
    assert [c.matched_blocks for c in core.candidates(h2)] == [3, 0]
    assert core.candidates(h1)[0].matched_blocks == 2
    # After the TTL, nothing is left.
    now[0] += 61.0
    assert core.candidates(h2)[0].matched_blocks == 0
    assert core.num_predicted("a") == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": "gpu3:8000"}, "--url must be an http:// or https:// URL, got 'gpu3:8000'"),
        ({"block_size": 0}, "--block-size must be positive, got 0"),
        ({"capacity_blocks": -1}, "--capacity-blocks must be positive, got -1"),
        ({"served_model_name": ""}, "--served-model-name must not be empty"),
    ],
)
def test_bad_register_settings_name_the_flag(options: dict[str, Any], message: str) -> None:
    from app.ingest.errors import IngestSettingsError

    values: dict[str, Any] = {"redis_url": "redis://localhost:6379/0", "worker_id": "e0"}
    values["url"] = "http://gpu3:8000"
    with pytest.raises(IngestSettingsError) as caught:
        RegisterSettings(**{**values, **options})
    assert str(caught.value) == message


def test_register_without_redis_is_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.cli import main

    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("KVMESH_REDIS_URL", raising=False)
    assert main(["register", "--url", "http://a:1", "--worker-id", "e0"]) == 2
    assert capsys.readouterr().err == "kvmesh register: give --redis-url or set REDIS_URL\n"
