"""Helpers for the worker tests: settings, an in-process worker behind httpx, a real process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

from app.worker.service import WorkerRuntime, create_app
from app.worker.settings import WorkerSettings

ADMIN_TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def worker_settings(redis_url: str, **overrides: Any) -> WorkerSettings:
    """Small, fast defaults: tiny model, 256 GPU blocks of 16 tokens, sim at zero model time."""
    values: dict[str, Any] = {
        "worker_id": "w0",
        "redis_url": redis_url,
        "admin_token": ADMIN_TOKEN,
        "num_gpu_blocks": 256,
        "max_seq_len": 1_024,
        "sim_step_overhead_ms": 0.0,
        "sim_prefill_us_per_token": 0.0,
        "sim_decode_us_per_sequence": 0.0,
        "drain_timeout_s": 2.0,
        "heartbeat_ttl_s": 2.0,
    }
    values.update(overrides)
    return WorkerSettings(**values)


@contextlib.asynccontextmanager
async def worker_client(
    settings: WorkerSettings,
) -> AsyncIterator[tuple[httpx.AsyncClient, WorkerRuntime]]:
    """The worker app inside its lifespan, spoken to through httpx's ASGITransport."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            yield client, app.state.runtime


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def worker_process(
    args: list[str], env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """``kvmesh worker ARGS`` as a real process; killed (SIGKILL) if still running at the end."""
    return service_process("worker", args, env)


@contextlib.contextmanager
def service_process(
    command: str, args: list[str], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``kvmesh COMMAND ARGS`` as a real process; killed (SIGKILL) if still running at the end."""
    script = Path(sys.executable).parent / "kvmesh"
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        [str(script), command, *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def wait_ready(base_url: str, proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"the process exited with {proc.returncode}:\n{output}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{base_url} was not ready within {timeout_s} s")
