"""``kvmesh`` services as real processes: started, waited for, stopped (SIGKILL if left)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from app.core.net import free_port
from tests.support.wait import wait_for

__all__ = ["service_process", "sim_worker_args", "two_workers_and_a_router", "wait_ready"]


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
    """Until ``GET /ready`` is 200; fail at once, with its output, if the process exits."""
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


def sim_worker_args(
    worker_id: str,
    port: int,
    redis_url: str,
    *,
    num_blocks: int,
    heartbeat_ttl_s: float,
    step_ms: float = 1.0,
) -> list[str]:
    """``kvmesh worker`` flags for a small, fast sim worker (``step_ms`` steps, free prefill)."""
    return [
        *("--worker-id", worker_id, "--port", str(port), "--redis-url", redis_url),
        *("--num-gpu-blocks", str(num_blocks), "--max-seq-len", "2048"),
        *("--heartbeat-ttl-s", str(heartbeat_ttl_s)),
        *("--sim-step-overhead-ms", f"{step_ms:g}", "--sim-prefill-us-per-token", "0"),
    ]


@contextlib.contextmanager
def two_workers_and_a_router(
    redis_url: str,
    *,
    num_blocks: int,
    heartbeat_ttl_s: float,
    step_ms: float = 1.0,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, dict[str, subprocess.Popen[str]], dict[str, str]]]:
    """``kvmesh worker`` w0 and w1 and a ``kvmesh router`` as processes, all up and the router
    seeing both; yields the router's base URL, the processes by name (w0, w1, router) and the
    workers' base URLs."""
    urls = {worker: f"http://127.0.0.1:{free_port()}" for worker in ("w0", "w1")}
    base = f"http://127.0.0.1:{free_port()}"
    router_args = ["--port", base.rpartition(":")[2], "--redis-url", redis_url]
    router_args += ["--load-interval-s", "0.05"]
    with contextlib.ExitStack() as stack:
        procs = {
            worker: stack.enter_context(
                service_process(
                    "worker",
                    sim_worker_args(
                        worker,
                        int(url.rpartition(":")[2]),
                        redis_url,
                        num_blocks=num_blocks,
                        heartbeat_ttl_s=heartbeat_ttl_s,
                        step_ms=step_ms,
                    ),
                    env,
                )
            )
            for worker, url in urls.items()
        }
        procs["router"] = stack.enter_context(service_process("router", router_args, env))
        for worker, url in urls.items():
            wait_ready(url, procs[worker])
        wait_ready(base, procs["router"])

        def both_up() -> bool:
            states = [w["state"] for w in httpx.get(f"{base}/workers").json()["workers"]]
            return states == ["up", "up"]

        wait_for(both_up)
        yield base, procs, urls
