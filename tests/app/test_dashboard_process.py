"""The dashboard's stream from real processes: a worker, a router serving ``/dashboard``, and a
standalone ``kvmesh dashboard`` following the same Redis read-only."""

from __future__ import annotations

import signal
import time
from collections.abc import Generator
from typing import Any

import httpx
import orjson

from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port
from tests.support.processes import service_process, wait_ready

PROMPT = list(range(200, 280))  # 80 tokens: 5 full blocks of 16


def _frames(
    base: str, headers: dict[str, str] | None = None
) -> Generator[tuple[str, dict[str, Any]], None, None]:
    """(event id, frame) for each ``frame`` event of the stream, as they come."""
    with httpx.stream("GET", f"{base}/dashboard/stream", headers=headers, timeout=10) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        for line in stream.iter_lines():
            if line:
                name, _, value = line.partition(": ")
                fields[name] = value
                continue
            if fields.get("event") == "frame":
                yield fields["id"], orjson.loads(fields["data"])
            fields = {}


def test_router_dashboard_stream_and_a_standalone_dashboard(
    embedded_redis: EmbeddedRedis,
) -> None:
    url = embedded_redis.url
    worker_port, router_port, dash_port = free_port(), free_port(), free_port()
    worker_args = [
        *("--worker-id", "w0", "--port", str(worker_port), "--redis-url", url),
        *("--num-gpu-blocks", "128", "--max-seq-len", "2048", "--heartbeat-ttl-s", "2"),
    ]
    router_base = f"http://127.0.0.1:{router_port}"
    dash_base = f"http://127.0.0.1:{dash_port}"
    with (
        service_process("worker", worker_args) as worker,
        service_process("router", ["--port", str(router_port), "--redis-url", url]) as router,
        service_process("dashboard", ["--port", str(dash_port), "--redis-url", url]) as dash,
    ):
        wait_ready(f"http://127.0.0.1:{worker_port}", worker)
        wait_ready(router_base, router)
        wait_ready(dash_base, dash)
        response = httpx.post(
            f"{router_base}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 2, "request_id": "dash-1"},
        )
        assert response.status_code == 200

        deadline = time.monotonic() + 10
        stream = _frames(router_base)
        stored: list[dict[str, Any]] = []
        event_id, frame = "", dict[str, Any]()
        for event_id, frame in stream:  # noqa: B007 (feed items come once; the rest is whole)
            stored += [i for i in frame["feed"]["items"] if i["type"] == "stored"]
            loaded = frame["workers"] and frame["workers"][0]["hit_rate"] is not None
            if stored and frame["decisions"] and loaded:
                break
            assert time.monotonic() < deadline, "no stored event reached the stream"
        stream.close()
        assert stored[0]["worker"] == "w0"
        assert sum(i["blocks"] for i in stored) >= 5
        assert frame["source"] == "router"
        assert int(event_id) == frame["feed"]["last_id"]
        (row,) = frame["workers"]
        assert (row["worker"], row["state"], row["gpu"]["capacity"]) == ("w0", "up", 128)
        assert row["hit_rate"] == 0.0  # one request, nothing reused yet
        (decision,) = frame["decisions"]
        assert (decision["request_id"], decision["worker"], decision["kind"]) == (
            "dash-1",
            "w0",
            "completion",
        )
        prefix = frame["prefixes"]["rows"][0]
        assert (frame["prefixes"]["by"], prefix["count"], prefix["held"]) == (
            "requests",
            1,
            {"w0": 5},
        )
        assert sum(frame["rates"]["series"]["w0"]["stored"]) >= 5

        # Resuming from the last event id sends only what came after it: nothing yet.
        resumed = _frames(router_base, {"Last-Event-ID": event_id})
        _, again = next(resumed)
        resumed.close()
        assert again["feed"]["items"] == []
        assert again["seq"] > frame["seq"]

        # The standalone dashboard sees the same cluster, has no decisions and cannot route.
        deadline = time.monotonic() + 10
        while True:
            state = httpx.get(f"{dash_base}/dashboard/state").json()
            if state["workers"] and state["workers"][0]["state"] == "up":
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (state["source"], state["decisions"]) == ("dashboard", None)
        assert state["prefixes"]["by"] == "stored"
        assert httpx.post(f"{dash_base}/route", json={"prompt": PROMPT}).status_code == 404
        assert httpx.get(f"{dash_base}/policy").status_code == 404
        assert httpx.get(f"{dash_base}/dashboard").status_code in (200, 404)

        for proc in (router, dash):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
