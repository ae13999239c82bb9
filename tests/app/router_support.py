"""Helpers for the router tests: settings, an in-process router behind httpx, waiting on it."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx

from app.router.service import RouterRuntime, create_app
from app.router.settings import RouterSettings
from tests.app.worker_support import ADMIN_TOKEN, free_port, service_process, wait_ready


def router_settings(redis_url: str, **overrides: Any) -> RouterSettings:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "admin_token": ADMIN_TOKEN,
        "sync_interval_s": 0.02,
        "load_interval_s": 0.05,
    }
    values.update(overrides)
    return RouterSettings(**values)


@contextlib.asynccontextmanager
async def router_client(
    settings: RouterSettings,
) -> AsyncIterator[tuple[httpx.AsyncClient, RouterRuntime]]:
    """The router app inside its lifespan, spoken to through httpx's ASGITransport."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield client, app.state.runtime


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout_s} s")
        await asyncio.sleep(0.01)


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``condition`` (blocking) until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still false after {timeout_s} s"
        time.sleep(0.02)


def sim_worker_args(
    worker_id: str, port: int, redis_url: str, *, num_blocks: int, heartbeat_ttl_s: float
) -> list[str]:
    """``kvmesh worker`` flags for a small, fast sim worker (1 ms steps, free prefill)."""
    return [
        *("--worker-id", worker_id, "--port", str(port), "--redis-url", redis_url),
        *("--num-gpu-blocks", str(num_blocks), "--max-seq-len", "2048"),
        *("--heartbeat-ttl-s", str(heartbeat_ttl_s)),
        *("--sim-step-overhead-ms", "1", "--sim-prefill-us-per-token", "0"),
    ]


@contextlib.contextmanager
def two_workers_and_a_router(
    redis_url: str, *, num_blocks: int, heartbeat_ttl_s: float
) -> Iterator[tuple[str, dict[str, subprocess.Popen[str]]]]:
    """``kvmesh worker`` w0 and w1 and a ``kvmesh router`` as processes, all up and the router
    seeing both; yields the router's base URL and the processes by name (w0, w1, router)."""
    ports = {"w0": free_port(), "w1": free_port()}
    router_port = free_port()
    base = f"http://127.0.0.1:{router_port}"
    router_args = ["--port", str(router_port), "--redis-url", redis_url]
    router_args += ["--load-interval-s", "0.05"]
    with contextlib.ExitStack() as stack:
        procs = {
            worker: stack.enter_context(
                service_process(
                    "worker",
                    sim_worker_args(
                        worker,
                        port,
                        redis_url,
                        num_blocks=num_blocks,
                        heartbeat_ttl_s=heartbeat_ttl_s,
                    ),
                )
            )
            for worker, port in ports.items()
        }
        procs["router"] = stack.enter_context(service_process("router", router_args))
        for worker, port in ports.items():
            wait_ready(f"http://127.0.0.1:{port}", procs[worker])
        wait_ready(base, procs["router"])

        def both_up() -> bool:
            states = [w["state"] for w in httpx.get(f"{base}/workers").json()["workers"]]
            return states == ["up", "up"]

        wait_for(both_up)
        yield base, procs


def index_holds(runtime: RouterRuntime, worker: str, num_blocks: int) -> Callable[[], bool]:
    def check() -> bool:
        per_worker = runtime.index.stats()["per_worker"]
        return per_worker.get(worker, {}).get("blocks", 0) == num_blocks

    return check
