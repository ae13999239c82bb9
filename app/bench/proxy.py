"""``kvmesh bench proxy``: what a ``kvmesh router`` adds to a proxied, non-streamed completion.

Real processes on a private ``redis-server`` (never ``$REDIS_URL``: a shared Redis would bring
its own workers into the router's view): one ``kvmesh worker`` with the sim back-end at zero
model time (all three ``--sim-*`` timings 0; ``kvmesh bench worker``'s shape: tiny model, a
32,000-token vocabulary, 32,768 blocks of 16 tokens, no KV pools), and one ``kvmesh router``
that sees only it. The router's time is then all HTTP, parsing, hashing, the decision and the
hop to the worker.

Workload: ``NUM_PROMPTS`` seeded random prompts of 4,096 token ids, each asking for one token
(``max_tokens`` 1), so that the non-streamed answer's arrival is the client's time to the first
token. Not timed: ``/ready`` of both; every prompt sent once through the router (which caches
them all in the worker, so that every timed request reuses the same 255 blocks whichever way
it comes) and once directly; ``NUM_WARMUP`` requests each way.

Timed, one request at a time (a closed loop, one keep-alive connection each way, the light
client of ``app.bench.http_client``): ``ROUNDS`` rounds of a batch sent straight to the worker
(``POST /v1/completions``) and the same batch through the router, the same bodies both ways
(serialised beforehand). Latency is from the request written to the answer parsed, on the
client's clock; every answer must be a 200 from the worker with one token (else it counts in
``*_errors``). ``added_p50_ms`` = ``proxied_p50_ms`` - ``direct_p50_ms`` (the target: ≤ 1 ms).

CPU time from ``/proc`` (Linux), per process: ``router_cpu_us_per_request`` is the router's CPU
over the proxied batches / proxied requests answered (the target: ≤ 400 µs); it includes the
router's background work (its view's Redis reads, the worker's KV events), which
``router_idle_cpu_s`` measures over the direct batches, when the router routes nothing; at one
request at a time that is a large share. ``router_busy_cpu_us_per_request``: the same less the
idle rate (CPU per second of the direct batches) over the proxied batches' time.
``worker_cpu_us_*``: the worker's CPU per request each way (what the router's extra fields and
its way of sending cost the worker). ``other_cpu_s``: what the rest of the machine used during
the timed part; on a busy host the latencies measure it too, the CPU times much less.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import httpx
import numpy as np
import orjson
import uvloop

from app.bench.http_client import KeepAliveConnection
from app.bench.procfs import busy_us_per_request
from app.bench.worker import (
    WORKER_OPTIONS,
    _cpu_seconds,
    _machine_busy_seconds,
    kvmesh_process,
    worker_flags,
)
from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port

PROMPT_TOKENS = 4_096
VOCAB_SIZE = 32_000
MAX_TOKENS = 1
NUM_PROMPTS = 64
NUM_PROMPTS_QUICK = 8
ROUNDS = 10
ROUNDS_QUICK = 2
BATCH = 100  # requests per batch, each way
BATCH_QUICK = 10
NUM_WARMUP = 100
NUM_WARMUP_QUICK = 5
SEED = 24
HOST = "127.0.0.1"
READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
# The worker of ``kvmesh bench worker``, at zero model time.
PROXY_WORKER_OPTIONS: dict[str, Any] = {
    **WORKER_OPTIONS,
    "max_batch_size": 8,
    "max_queue_len": 64,
}


def make_bodies(num_prompts: int, seed: int = SEED) -> list[bytes]:
    """``{"prompt": [4,096 ids], "max_tokens": 1}``, serialised (seeded)."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, VOCAB_SIZE, size=(num_prompts, PROMPT_TOKENS)).tolist()
    return [orjson.dumps({"prompt": p, "max_tokens": MAX_TOKENS}) for p in prompts]


@dataclass(slots=True)
class Way:
    """What one way (direct or proxied) saw over the timed batches."""

    ok: int = 0
    errors: int = 0
    samples: list[str] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)  # the worker's own kvmesh.ttft_ms
    seconds: float = 0.0
    router_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0


def _check(answer: dict[str, Any], worker_id: str) -> float:
    """The worker's TTFT of a good answer; ValueError for any other."""
    timings = answer["kvmesh"]
    if timings["worker_id"] != worker_id:
        raise ValueError(f"answered by {timings['worker_id']!r}, not {worker_id!r}")
    if len(answer["choices"][0]["token_ids"]) != MAX_TOKENS:
        raise ValueError(f"not {MAX_TOKENS} token(s): {answer['choices'][0]!r}")
    return float(timings["ttft_ms"])


async def _batch(
    connection: KeepAliveConnection,
    bodies: list[bytes],
    way: Way,
    worker_id: str,
    pids: dict[str, int | None],
) -> None:
    router_before = _cpu_seconds(pids["router"]) or 0.0
    worker_before = _cpu_seconds(pids["worker"]) or 0.0
    clock = time.perf_counter
    start = clock()
    for body in bodies:
        sent = clock()
        try:
            answer = await asyncio.wait_for(connection.post(body), REQUEST_TIMEOUT_S)
            ttft = _check(answer, worker_id)
        except (OSError, TimeoutError, ValueError, KeyError, asyncio.IncompleteReadError) as exc:
            way.errors += 1
            if len(way.samples) < 5:
                way.samples.append(f"{type(exc).__name__}: {exc}")
            continue
        way.latency_ms.append((clock() - sent) * 1e3)
        way.ttft_ms.append(ttft)
        way.ok += 1
    way.seconds += clock() - start
    way.router_cpu_s += (_cpu_seconds(pids["router"]) or 0.0) - router_before
    way.worker_cpu_s += (_cpu_seconds(pids["worker"]) or 0.0) - worker_before


async def _drive(
    worker_port: int,
    router_port: int,
    bodies: list[bytes],
    sizes: dict[str, int],
    worker_id: str,
    pids: dict[str, int | None],
) -> tuple[Way, Way, dict[str, float | None]]:
    direct, proxied = Way(), Way()
    worker = KeepAliveConnection(HOST, worker_port, "/v1/completions")
    router = KeepAliveConnection(HOST, router_port, "/v1/completions")
    try:
        for body in bodies:  # caches every prompt in the worker
            _check(await router.post(body), worker_id)
        for i in range(sizes["warmup"]):
            body = bodies[i % len(bodies)]
            _check(await worker.post(body), worker_id)
            _check(await router.post(body), worker_id)
        machine_before = _machine_busy_seconds()
        redis_before = _cpu_seconds(pids["redis"])
        client_before = time.process_time()
        batch = sizes["batch"]
        for r in range(sizes["rounds"]):
            these = [bodies[(r * batch + i) % len(bodies)] for i in range(batch)]
            await _batch(worker, these, direct, worker_id, pids)
            await _batch(router, these, proxied, worker_id, pids)
        redis_after = _cpu_seconds(pids["redis"])
        machine_after = _machine_busy_seconds()
        spent: dict[str, float | None] = {
            "client": time.process_time() - client_before,
            "redis": None if redis_after is None else redis_after - (redis_before or 0.0),
            "machine": (
                None
                if machine_after is None or machine_before is None
                else machine_after - machine_before
            ),
        }
    finally:
        await worker.aclose()
        await router.aclose()
    return direct, proxied, spent


def _wait_ready(base_url: str, procs: dict[str, Any], log: IO[bytes], up: str = "") -> None:
    """Until ``base_url/ready`` answers 200 (naming ``up`` among its workers, where given)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read()[-4_000:].decode(errors="replace")
                raise RuntimeError(f"the {name} exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            answer = httpx.get(f"{base_url}/ready", timeout=1.0)
            if answer.status_code == 200 and up in answer.json().get("workers_up", [up]):
                return
        time.sleep(0.1)
    raise RuntimeError(f"{base_url} was not ready within {READY_TIMEOUT_S} s")


@contextlib.contextmanager
def _services(redis_url: str, worker_id: str) -> Iterator[tuple[int, int, dict[str, int]]]:
    """The worker and the router, both ready: (worker port, router port, their pids)."""
    worker_port, router_port = free_port(), free_port()
    options = {
        **PROXY_WORKER_OPTIONS,
        "worker_id": worker_id,
        "host": HOST,
        "port": worker_port,
        "redis_url": redis_url,
    }
    router_flags = ["--host", HOST, "--port", str(router_port), "--redis-url", redis_url]
    with (
        tempfile.TemporaryFile() as log,
        kvmesh_process(["worker", *worker_flags(options)], log) as worker,
        kvmesh_process(["router", *router_flags], log) as router,
    ):
        procs = {"worker": worker, "router": router}
        _wait_ready(f"http://{HOST}:{worker_port}", procs, log)
        _wait_ready(f"http://{HOST}:{router_port}", procs, log, up=worker_id)
        yield worker_port, router_port, {"worker": worker.pid, "router": router.pid}
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"the {name} exited with {proc.returncode}")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _way(prefix: str, way: Way) -> dict[str, Any]:
    out: dict[str, Any] = {
        f"{prefix}_ok": way.ok,
        f"{prefix}_errors": way.errors,
        f"{prefix}_error_samples": way.samples,
        f"{prefix}_seconds": round(way.seconds, 3),
        f"worker_cpu_us_{prefix}": round(way.worker_cpu_s / way.ok * 1e6, 1) if way.ok else None,
    }
    if way.ok:
        out[f"{prefix}_p50_ms"] = round(_percentile(way.latency_ms, 0.5), 3)
        out[f"{prefix}_p99_ms"] = round(_percentile(way.latency_ms, 0.99), 3)
        out[f"{prefix}_worker_ttft_p50_ms"] = round(_percentile(way.ttft_ms, 0.5), 3)
    return out


def measure(sizes: dict[str, int]) -> dict[str, Any]:
    bodies = make_bodies(sizes["prompts"])
    worker_id = f"bench-{secrets.token_hex(3)}"
    httpx_logger = logging.getLogger("httpx")
    httpx_level = httpx_logger.level
    httpx_logger.setLevel(logging.WARNING)  # not a log line per /ready poll
    gc.collect()
    gc.freeze()  # the bodies are input: the client's collector need not walk them
    try:
        with EmbeddedRedis() as server, _services(server.url, worker_id) as (wport, rport, pids):
            load_average = os.getloadavg()[0]
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                direct, proxied, spent = runner.run(
                    _drive(wport, rport, bodies, sizes, worker_id, {**pids, "redis": server.pid})
                )
    finally:
        gc.unfreeze()
        httpx_logger.setLevel(httpx_level)
    for name, way in (("direct", direct), ("proxied", proxied)):
        if way.errors:
            print(
                f"kvmesh bench proxy: {way.errors} {name} request(s) failed, e.g. {way.samples[0]}",
                file=sys.stderr,
            )
    ours = sum(v or 0.0 for v in (spent["client"], spent["redis"]))
    ours += direct.router_cpu_s + proxied.router_cpu_s + direct.worker_cpu_s + proxied.worker_cpu_s
    machine = spent["machine"]
    router_cpu_s = round(proxied.router_cpu_s, 3)
    result: dict[str, Any] = {
        "requests": sizes["rounds"] * sizes["batch"],
        "rounds": sizes["rounds"],
        "prompt_tokens": PROMPT_TOKENS,
        "max_tokens": MAX_TOKENS,
        "prompts": len(bodies),
        **_way("direct", direct),
        **_way("proxied", proxied),
        "router_cpu_s": router_cpu_s,
        "router_cpu_us_per_request": (
            round(router_cpu_s / proxied.ok * 1e6, 1) if proxied.ok else None
        ),
        "router_idle_cpu_s": round(direct.router_cpu_s, 3),
        "router_busy_cpu_us_per_request": busy_us_per_request(
            proxied.router_cpu_s, proxied.seconds, proxied.ok, direct.router_cpu_s, direct.seconds
        ),
        "client_cpu_s": round(spent["client"] or 0.0, 3),
        "redis_cpu_s": None if spent["redis"] is None else round(spent["redis"], 3),
        "other_cpu_s": None if machine is None else round(max(machine - ours, 0.0), 3),
        "cpus": os.cpu_count(),
        "load_average": round(load_average, 2),
    }
    if direct.ok and proxied.ok:
        result["added_p50_ms"] = round(result["proxied_p50_ms"] - result["direct_p50_ms"], 3)
        result["added_p99_ms"] = round(result["proxied_p99_ms"] - result["direct_p99_ms"], 3)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "quick", False):
        sizes = {"prompts": NUM_PROMPTS_QUICK, "rounds": ROUNDS_QUICK, "batch": BATCH_QUICK}
        sizes["warmup"] = NUM_WARMUP_QUICK
    else:
        sizes = {"prompts": NUM_PROMPTS, "rounds": ROUNDS, "batch": BATCH, "warmup": NUM_WARMUP}
    return measure(sizes)
