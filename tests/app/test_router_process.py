"""``kvmesh router`` as a real process, with two ``kvmesh worker`` processes and a private Redis:
a prompt sent twice is served from the cache the second time, streams pass through, a client
that leaves has its job cancelled, a worker killed with SIGKILL leaves the rotation within its
heartbeat TTL, and SIGTERM exits cleanly."""

from __future__ import annotations

import signal
import socket
import time
from typing import Any

import httpx
import orjson

from app.core.embedded_redis import EmbeddedRedis
from tests.support.processes import two_workers_and_a_router
from tests.support.wait import wait_for

PROMPT = list(range(300, 400))  # 100 tokens: 6 full blocks of 16
HEARTBEAT_TTL_S = 2.0


def _route(base: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.post(f"{base}/route", json={"prompt": PROMPT}).json()
    return body


def _engine(url: str) -> dict[str, int]:
    counts: dict[str, int] = httpx.get(f"{url}/stats").json()["engine"]
    return counts


def _workers(base: str) -> dict[str, dict[str, Any]]:
    return {w["worker"]: w for w in httpx.get(f"{base}/workers").json()["workers"]}


def test_router_process_routes_to_the_cache_and_survives_a_killed_worker(
    embedded_redis: EmbeddedRedis,
) -> None:
    with two_workers_and_a_router(
        embedded_redis.url, num_blocks=128, heartbeat_ttl_s=HEARTBEAT_TTL_S
    ) as (base, procs, urls):
        router = procs["router"]

        # The same prompt twice: the second lands where the first left its blocks.
        first = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert first.status_code == 200
        holder = first.headers["x-kvmesh-worker"]
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for(lambda: _route(base)["expected_cached_tokens"] == 96)
        second = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert second.headers["x-kvmesh-worker"] == holder
        # The worker reuses the 6 full blocks and 3 tokens of the partial 7th (partial reuse).
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 99

        # Streaming passes through chunk by chunk, with the worker named.
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 3, "stream": True},
        ) as stream:
            assert stream.headers["x-kvmesh-worker"] == holder
            lines = [line for line in stream.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [orjson.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 3

        # A client that leaves a plain completion: the router closes its hop, and the worker
        # cancels the job (each answers it from its protocol).
        engine = _engine(urls[holder])
        body = orjson.dumps({"prompt": PROMPT, "max_tokens": 1_500})
        with socket.create_connection(("127.0.0.1", int(base.rpartition(":")[2]))) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json"
                b"\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_for(lambda: _engine(urls[holder])["submitted"] == engine["submitted"] + 1)
        wait_for(lambda: _engine(urls[holder])["cancelled"] == engine["cancelled"] + 1)
        assert _engine(urls[holder])["finished"] == engine["finished"]
        left = f'kvmesh_router_completions_total{{status="499",worker="{holder}"}} 1.0'
        assert left in httpx.get(f"{base}/metrics").text

        # Kill the holder: the next request still succeeds (retried on the other worker) ...
        procs[holder].send_signal(signal.SIGKILL)
        procs[holder].wait(10)
        killed_at = time.monotonic()
        other = "w1" if holder == "w0" else "w0"
        third = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert third.status_code == 200
        assert third.headers["x-kvmesh-worker"] == other
        # ... and the killed worker leaves the rotation within its heartbeat TTL.
        while _workers(base)[holder]["state"] != "gone":
            assert time.monotonic() - killed_at < HEARTBEAT_TTL_S + 1.5
            time.sleep(0.05)
        decision = httpx.post(f"{base}/route", json={"prompt": PROMPT}).json()
        assert decision["worker"] == other
        assert [c["worker"] for c in decision["costs"]] == [other]
        metrics = httpx.get(f"{base}/metrics").text
        assert "kvmesh_router_retries_total 1.0" in metrics
        # Two answered whole and one streamed by the holder, one by the other.
        for worker, count in ((holder, 3), (other, 1)):
            line = f'kvmesh_router_completions_total{{status="200",worker="{worker}"}} {count}.0'
            assert line in metrics

        router.send_signal(signal.SIGTERM)
        assert router.wait(timeout=15) == 0
