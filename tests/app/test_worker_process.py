"""``kvmesh worker`` as a real process: HTTP, Redis, client disconnects and SIGTERM."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import orjson
import redis

from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port
from events import keys
from tests.app.worker_support import ADMIN_TOKEN, expected_output, worker_process
from tests.support.processes import wait_ready


def _args(redis_url: str, port: int, *extra: str) -> list[str]:
    return [
        *("--worker-id", "wp", "--port", str(port), "--redis-url", redis_url),
        *("--num-gpu-blocks", "64", "--max-seq-len", "2048", "--heartbeat-ttl-s", "2"),
        *extra,
    ]


def test_worker_process_serves_publishes_and_stops_on_sigterm(clean_redis_url: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # Slow steps, so that requests are in flight when the test acts.
    args = _args(clean_redis_url, port, "--sim-step-overhead-ms", "20", "--drain-timeout-s", "5")
    env = {"KVMESH_ADMIN_TOKEN": ADMIN_TOKEN, "KVMESH_SIM_PREFILL_US_PER_TOKEN": "0"}
    client = redis.Redis.from_url(clean_redis_url)
    with worker_process(args, env) as proc:
        wait_ready(base, proc)
        prompt = list(range(40))
        data = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 3}).json()
        assert data["choices"][0]["token_ids"] == expected_output(prompt, 3)
        entry = orjson.loads(client.hget(keys.WORKERS_KEY, "wp") or b"{}")
        assert entry["url"] == base
        assert client.xlen(keys.events_key("wp")) > 0

        # A client that goes away mid-stream cancels its request and frees its blocks.
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            json={"prompt": prompt, "max_tokens": 500, "stream": True},
        ) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/stats").json()["engine"]["cancelled"] != 1:
            assert time.monotonic() < deadline, "the disconnect did not cancel the request"
            time.sleep(0.05)
        stats = httpx.get(f"{base}/stats").json()
        assert stats["kv_cache"]["free_num_blocks"] == 64
        assert stats["engine"]["running"] == 0

        # SIGTERM: the request in flight finishes, new ones get 503, then a clean exit.
        results: dict[str, httpx.Response] = {}

        def long_request() -> None:
            results["in_flight"] = httpx.post(
                f"{base}/v1/completions", json={"prompt": [5, 6], "max_tokens": 30}, timeout=30
            )

        thread = threading.Thread(target=long_request)
        thread.start()
        while httpx.get(f"{base}/stats").json()["engine"]["running"] != 1:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        refused = None
        while refused is None:
            response = httpx.post(f"{base}/v1/completions", json={"prompt": [1], "max_tokens": 1})
            if response.status_code == 503:
                refused = response
        thread.join(30)
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read() if proc.stdout else ""
    assert refused.headers["retry-after"] == "5"
    assert refused.json()["error"]["message"] == "the worker is shutting down"
    assert results["in_flight"].status_code == 200
    assert results["in_flight"].json()["choices"][0]["finish_reason"] == "length"
    assert client.hget(keys.WORKERS_KEY, "wp") is None
    assert client.exists(keys.alive_key("wp")) == 0
    assert "worker wp: SIGTERM received" in output
    assert "worker wp: stopped" in output
    client.close()


def test_worker_process_with_an_embedded_redis() -> None:
    """No Redis URL at all: the worker starts (and stops) a private redis-server."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"REDIS_URL": "", "KVMESH_REDIS_URL": ""}
    with worker_process(["--worker-id", "solo", "--port", str(port)], env) as proc:
        wait_ready(base, proc)
        assert httpx.get(f"{base}/ready").json()["checks"]["redis"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        output = proc.stdout.read() if proc.stdout else ""
    assert "started a private redis-server" in output


def test_a_worker_whose_redis_does_not_answer_says_so_until_it_does() -> None:
    """Nothing listens at the URL: the worker serves, but says it is not ready (in its log and
    on /ready: no router can see it), registers once Redis answers, and a SIGTERM while Redis
    is away does not wait out the flush timeouts (it took 10 s)."""
    port, redis_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    with worker_process(_args(redis_url, port)) as proc:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the worker did not start"
            try:
                health = httpx.get(f"{base}/health", timeout=1.0)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert health.status_code == 200
        ready = httpx.get(f"{base}/ready")
        assert ready.status_code == 503
        assert ready.json()["checks"] == {"engine": True, "redis": False, "admitting": True}
        with EmbeddedRedis(port=redis_port) as server:
            wait_ready(base, proc)
            client = redis.Redis.from_url(server.url)
            while client.hget(keys.WORKERS_KEY, "wp") is None:  # at its next heartbeat
                assert time.monotonic() < deadline, "the worker did not register"
                time.sleep(0.05)
            assert orjson.loads(client.hget(keys.WORKERS_KEY, "wp") or b"{}")["url"] == base
            client.close()
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        stopped_after_s = time.monotonic() - stopping
        output = proc.stdout.read() if proc.stdout else ""
    assert stopped_after_s < 5.0
    assert (
        f"worker wp: not ready: Redis at {redis_url} does not answer, so no router can see "
        "this worker; retrying in the background (GET /ready is 503 until it registers)"
    ) in output
    assert "publisher wp: registered in Redis" in output
    assert "worker wp: ready (registered in Redis)" not in output
