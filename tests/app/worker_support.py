"""Helpers for the worker tests: settings, an in-process worker behind httpx, a real process
(``kvmesh worker``; the generic pieces are in ``tests.support``)."""

from __future__ import annotations

import contextlib
import subprocess
from typing import Any

import httpx

from app.worker.app import create_app
from app.worker.backend import SimBackend, prompt_seed
from app.worker.runtime import WorkerRuntime
from app.worker.settings import WorkerSettings
from tests.support.asgi import asgi_client
from tests.support.processes import service_process

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


def worker_client(
    settings: WorkerSettings,
) -> contextlib.AbstractAsyncContextManager[tuple[httpx.AsyncClient, WorkerRuntime]]:
    """The worker app inside its lifespan, spoken to through httpx's ASGITransport."""
    return asgi_client(create_app(settings), "http://worker")


def worker_process(
    args: list[str], env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """``kvmesh worker ARGS`` as a real process; killed (SIGKILL) if still running at the end."""
    return service_process("worker", args, env)


VOCAB = 512  # the tiny model's


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """The sim back-end's tokens, computed here from its definition: f(seed, position)."""
    sim = SimBackend(VOCAB)
    seed = prompt_seed(prompt)
    return [sim.next_token(seed, len(prompt) - 1 + i) for i in range(max_tokens)]


def tree(runtime: WorkerRuntime) -> dict[int, int]:
    """The worker manager's reuse tree: hash -> tier."""
    return {
        block.hash: 0 if block.is_primary else 1
        for wm in runtime.mgr.windows.values()
        for block in wm.tree_blocks()
    }


async def complete(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data
