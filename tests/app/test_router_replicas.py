"""``kvmesh router --processes 2`` as a real process: two replicas on one port, each its own
router id; SIGTERM to the parent stops them all."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port
from tests.support.processes import service_process
from tests.support.wait import wait_for


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_two_router_processes_serve_one_port_and_stop_together(
    embedded_redis: EmbeddedRedis,
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["--port", str(port), "--redis-url", embedded_redis.url, "--processes", "2"]
    args += ["--router-id", "edge"]
    with service_process("router", args) as proc:
        wait_for(lambda: _health(base), timeout_s=60)
        # Two replicas (and multiprocessing's resource tracker, a child too).
        wait_for(lambda: len(_children(proc.pid)) >= 3, timeout_s=30)
        replicas = _children(proc.pid)

        # Both answer on the one port (a new connection each time), each with its own id.
        seen: set[str] = set()

        def both_answer() -> bool:
            seen.add(httpx.get(f"{base}/index/stats", timeout=5).json()["sharing"]["router_id"])
            return seen == {"edge-0", "edge-1"}

        wait_for(both_answer, timeout_s=60)
        route = httpx.post(f"{base}/route", json={"prompt": [1, 2, 3]}, timeout=5)
        assert route.status_code == 503  # no worker yet: every replica says so the same way
        assert route.json()["error"]["message"] == "no worker is up"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    # The replicas are joined before the parent exits; the resource tracker ends when it reads
    # the parent's end of its pipe close, a moment later (once, in CI, not yet at this line).
    wait_for(lambda: not [pid for pid in replicas if _alive(pid)], timeout_s=10)


def _health(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
