"""``kvmesh bench worker``: one worker process over HTTP against its bare ``KVCacheManager``.

The workload is ``kvmesh bench manager``'s (``make_prompts``, seed 3): 2,000 prompts of 4,096
tokens whose first 2,048 are one of 10 shared prefixes, the rest random; each asks for 16 tokens.

Service part: ``kvmesh worker`` runs as a subprocess with the sim back-end at zero model time
(all three ``--sim-*`` timings 0), so what is measured is kvmesh's own overhead: HTTP, request
validation, the engine loop, the manager, publishing the KV events to Redis (``$REDIS_URL``, else
a private ``redis-server`` for the run). Tiny model shape with a 32,000-token vocabulary, 32,768
GPU blocks of 16 tokens (64 live sequences of 4,112 tokens take 16,448; the rest is cache), no
KV pools, ``--max-batch-size 64``, ``--max-queue-len 256``, ``--max-tokens-per-step 16384`` (the
64 decodes plus seven uncached prompt halves of 2,048 tokens per step). 64 asyncio clients
(uvloop) post the requests, each on its own keep-alive connection
(``app.bench.http_client.KeepAliveConnection``: httpx cost the client about 0.8 ms of CPU per
request, as much as the worker under test, and on two cores the client's share is taken from
the worker), each taking the next prompt when its previous answer is in; bodies are serialised
with orjson beforehand, so the client's JSON encoding is not charged. Every answer must be a
200 with 16 tokens and finish reason ``length``; failures are counted (``failed``), never
retried. ``--quick``: 100 requests from 16 clients.

Before the clock starts (not timed): ``/ready``, then warm-up requests: one per shared prefix,
one after the other, then one from every client at once (which opens the connections); their
suffixes are fresh, so the 10 prefixes are cached when the timed part starts and every timed
request reuses exactly its 2,048-token prefix (``hit_rate`` 0.5, a few tokens more where a
random suffix block happens to match a cached one partially).

Timed: from the first request sent to the last answer read, on the client's clock. Reported:
``requests_per_s``; ``ttft_p50_ms``/``ttft_p99_ms`` from the server's ``kvmesh.ttft_ms``
(arrival in the engine to the first token); ``latency_p50_ms``/``latency_p99_ms`` on the
client (request sent to answer parsed); ``hit_rate`` = reused / (reused + computed) prompt
tokens, from the deltas of ``/stats`` ``engine.reused_prompt_tokens`` and
``engine.computed_prompt_tokens`` over the timed part (``response_hit_rate``: the same from the
answers' ``cached_tokens``); CPU seconds of the worker, the client and the embedded Redis over
the timed part, and ``other_cpu_s``, what the rest of the machine used meanwhile (from
``/proc``, Linux): on a shared 2-core host, a run with ``other_cpu_s`` above a few tenths of a
second measured the neighbours too.

Manager part (``manager_only_requests_per_s``), in the same run, before the worker starts: the
same prompts straight into a ``KVCacheManager`` built by the worker's own ``build_manager`` from
the same settings (events on), after the same warm-up prompts (which also compile the hasher).
64 requests are live at once and advance in lock-step as in the engine: a request is admitted
with ``add_sequence``, its prompt completed (``store_context_blocks``) and its first token
appended (``add_new_token`` + ``store_new_block``); then 15 steps of ``add_token``,
``add_new_token``, ``store_new_block``; then ``remove_sequence`` with store-for-reuse. The events
are drained with ``take_events()`` after each admission, each decode and each removal (and
dropped: no encoding, no Redis), and the manager's ``refresh_blocks`` runs once per step, as the
engine does. Timed: all of it, building each ``LlmRequest`` included; the token lists are hidden
from the garbage collector (``gc.freeze``) as in ``kvmesh bench manager``, and the collector runs
as in the worker (``app.core.serving.settle_heap``: a young generation of 20,000 allocations, not
Python's 700, which made the manager part ~9% slower than the same manager in the worker).

``service_efficiency`` = ``requests_per_s`` / ``manager_only_requests_per_s``.
``service_cpu_us_per_request`` = ``worker_cpu_us_per_request`` - ``manager_only_cpu_us_per_request``
(the manager part's CPU time): what the service adds per request over the bare manager, in CPU
time, which a busy machine disturbs less than it disturbs the rates.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np
import orjson
import uvloop

from app.bench import bench_redis
from app.bench.http_client import KeepAliveConnection
from app.bench.manager import PREFIX_TOKENS, SEED, TOKENS_PER_REQUEST, VOCAB_SIZE, make_prompts
from app.core.embedded_redis import death_signal_preexec
from app.core.net import free_port
from app.core.serving import settle_heap
from cache import KVCacheManager, LlmRequest, RequestState

NUM_REQUESTS = 2_000
NUM_REQUESTS_QUICK = 100
CONCURRENCY = 64
CONCURRENCY_QUICK = 16
MAX_TOKENS = 16
HOST = "127.0.0.1"
READY_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0

# The worker's settings (each one a `kvmesh worker` flag); the manager part builds its
# KVCacheManager from the same values with the worker's own `build_manager`.
WORKER_OPTIONS: dict[str, Any] = {
    "engine": "sim",
    "model": "tiny",
    "vocab_size": VOCAB_SIZE,
    "num_gpu_blocks": 32_768,
    "num_host_blocks": 0,
    "allocate_pools": False,
    "max_batch_size": CONCURRENCY,
    "max_tokens_per_step": 16_384,
    "max_queue_len": 256,
    "sim_step_overhead_ms": 0.0,
    "sim_prefill_us_per_token": 0.0,
    "sim_decode_us_per_sequence": 0.0,
    "drain_timeout_s": 5.0,
}


def worker_flags(options: dict[str, Any]) -> list[str]:
    """``{"num_gpu_blocks": 8}`` -> ``["--num-gpu-blocks", "8"]``; booleans as ``--[no-]x``."""
    flags: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def warmup_prompts(prompts: list[list[int]], count: int, seed: int = SEED + 1) -> list[list[int]]:
    """One prompt per distinct prefix of ``prompts``, then ``count`` more cycling over them;
    every suffix fresh (another seed), so no timed request can reuse a warm-up's suffix."""
    prefixes = list({tuple(p[:PREFIX_TOKENS]): None for p in prompts})
    total = len(prefixes) + count
    rng = np.random.default_rng(seed)
    suffixes: list[list[int]] = rng.integers(
        0, VOCAB_SIZE, size=(total, TOKENS_PER_REQUEST - PREFIX_TOKENS)
    ).tolist()
    return [list(prefixes[i % len(prefixes)]) + suffixes[i] for i in range(total)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process (Linux ``/proc``); None where unavailable."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float | None:
    """CPU time all processes have used since boot, all cores together (Linux ``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else round(after - before, 3)


# -- the manager part ----------------------------------------------------------------------------


def make_manager() -> KVCacheManager:
    """A manager exactly as the benchmarked worker builds its own."""
    from app.worker.runtime import build_manager
    from app.worker.settings import WorkerSettings

    return build_manager(WorkerSettings(worker_id="bench-manager-only", **WORKER_OPTIONS))


def _token(rid: int, index: int) -> int:
    return (rid * 7_919 + index * 104_729) % VOCAB_SIZE


def replay(
    mgr: KVCacheManager, prompts: list[list[int]], first_rid: int, live_max: int
) -> dict[str, int]:
    """The prompts through ``mgr`` as the engine drives it (see the module docstring)."""
    live: deque[tuple[int, LlmRequest]] = deque()
    queue = iter(enumerate(prompts, start=first_rid))
    events = reused = computed = 0
    exhausted = False
    while live or not exhausted:
        # One step: decodes first (one token each), then admissions, as in the engine.
        for _ in range(len(live)):
            rid, request = live.popleft()
            mgr.add_token(rid)
            request.add_new_token(_token(rid, len(request.tokens) - request.prompt_len))
            mgr.store_new_block(request)
            events += len(mgr.take_events())
            if len(request.tokens) - request.prompt_len >= MAX_TOKENS:
                mgr.remove_sequence(rid, request)
                events += len(mgr.take_events())
            else:
                live.append((rid, request))
        while len(live) < live_max and not exhausted:
            item = next(queue, None)
            if item is None:
                exhausted = True
                break
            rid, tokens = item
            request = LlmRequest(rid, tokens, max_new_tokens=MAX_TOKENS)
            cached = mgr.add_sequence(request)
            reused += cached
            computed += request.prompt_len - cached
            request.context_current_position = request.prompt_len
            request.is_first_context_chunk = False
            mgr.store_context_blocks(request)
            request.state = RequestState.GENERATION_IN_PROGRESS
            request.add_new_token(_token(rid, 0))
            mgr.store_new_block(request)
            events += len(mgr.take_events())
            live.append((rid, request))
        mgr.refresh_blocks()
    return {"events": events, "reused": reused, "computed": computed}


def measure_manager(
    prompts: list[list[int]], warmup: list[list[int]], live_max: int
) -> dict[str, Any]:
    mgr = make_manager()
    mgr.take_events()  # `created` belongs to construction
    replay(mgr, warmup, 1, live_max)  # also compiles the hasher (numba), not timed
    thresholds = gc.get_threshold()
    try:
        settle_heap()  # collect, freeze, and the worker's young generation
        cpu = time.process_time()
        start = time.perf_counter()
        counters = replay(mgr, prompts, 1 + len(warmup), live_max)
        seconds = time.perf_counter() - start
        cpu = time.process_time() - cpu
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    if mgr.num_dropped_events:
        raise RuntimeError(f"the manager dropped {mgr.num_dropped_events} events")
    prompt_tokens = counters["reused"] + counters["computed"]
    return {
        "manager_only_requests_per_s": round(len(prompts) / seconds, 1),
        "manager_only_us_per_request": round(seconds / len(prompts) * 1e6, 1),
        "manager_only_cpu_us_per_request": round(cpu / len(prompts) * 1e6, 1),
        "manager_only_hit_rate": round(counters["reused"] / prompt_tokens, 6),
        "manager_only_events": counters["events"],
    }


# -- the service part ----------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What the clients saw during the timed part."""

    seconds: float = 0.0
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    client_cpu_s: float = 0.0
    worker_cpu_s: float | None = None
    redis_cpu_s: float | None = None
    machine_cpu_s: float | None = None
    load_average: float = 0.0  # 1-minute load average when the timed part starts
    stats_before: dict[str, Any] = field(default_factory=dict)
    stats_after: dict[str, Any] = field(default_factory=dict)


def _other_cpu(outcome: Outcome) -> float | None:
    """CPU time the rest of the machine used during the timed part (noise on a shared host)."""
    if outcome.machine_cpu_s is None or outcome.worker_cpu_s is None:
        return None
    ours = outcome.worker_cpu_s + outcome.client_cpu_s + (outcome.redis_cpu_s or 0.0)
    return round(max(outcome.machine_cpu_s - ours, 0.0), 3)


def _check(body: dict[str, Any]) -> dict[str, Any]:
    """A good answer's body (the client checked the 200); ValueError with the reason otherwise."""
    choice = body["choices"][0]
    if len(choice["token_ids"]) != MAX_TOKENS or choice["finish_reason"] != "length":
        raise ValueError(
            f"{len(choice['token_ids'])} tokens, finish_reason {choice['finish_reason']!r}"
        )
    return body


async def _post(connection: KeepAliveConnection, body: bytes) -> dict[str, Any]:
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        return await connection.post(body)


async def _stats(client: httpx.AsyncClient) -> dict[str, Any]:
    stats: dict[str, Any] = orjson.loads((await client.get("/stats")).content)
    return stats


async def _drive(
    port: int,
    bodies: list[bytes],
    warmup: list[bytes],
    num_sequential: int,
    concurrency: int,
    worker_pid: int,
    redis_pid: int | None,
) -> Outcome:
    outcome = Outcome()
    connections = [KeepAliveConnection(HOST, port, "/v1/completions") for _ in range(concurrency)]
    async with contextlib.AsyncExitStack() as stack:
        for connection in connections:
            stack.push_async_callback(connection.aclose)
        admin = await stack.enter_async_context(
            httpx.AsyncClient(base_url=f"http://{HOST}:{port}", timeout=REQUEST_TIMEOUT_S)
        )
        # Warm-up: the prefixes one after the other, then one request from every client at
        # once, which opens the connections.
        for body in warmup[:num_sequential]:
            _check(await _post(connections[0], body))
        burst = warmup[num_sequential:]
        answers = await asyncio.gather(
            *(_post(connections[i % concurrency], body) for i, body in enumerate(burst))
        )
        for answer in answers:
            _check(answer)
        outcome.stats_before = await _stats(admin)

        pending = iter(bodies)

        async def one_client(connection: KeepAliveConnection) -> None:
            for body in pending:  # a shared iterator: each client takes the next body
                sent = time.perf_counter()
                try:
                    answer = _check(await _post(connection, body))
                except (OSError, EOFError, TimeoutError, ValueError, KeyError, IndexError) as exc:
                    outcome.failed += 1
                    if len(outcome.errors) < 5:
                        outcome.errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                outcome.latency_ms.append((time.perf_counter() - sent) * 1e3)
                timings = answer["kvmesh"]
                outcome.ttft_ms.append(timings["ttft_ms"])
                outcome.queue_ms.append(timings["queue_ms"])
                outcome.e2e_ms.append(timings["e2e_ms"])
                usage = answer["usage"]
                outcome.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
                outcome.prompt_tokens += usage["prompt_tokens"]
                outcome.ok += 1

        outcome.load_average = os.getloadavg()[0]
        worker_cpu = _cpu_seconds(worker_pid)
        redis_cpu = _cpu_seconds(redis_pid)
        machine_cpu = _machine_busy_seconds()
        client_cpu = time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(one_client(connection) for connection in connections))
        outcome.seconds = time.perf_counter() - start
        outcome.client_cpu_s = time.process_time() - client_cpu
        outcome.worker_cpu_s = _delta(_cpu_seconds(worker_pid), worker_cpu)
        outcome.redis_cpu_s = _delta(_cpu_seconds(redis_pid), redis_cpu)
        outcome.machine_cpu_s = _delta(_machine_busy_seconds(), machine_cpu)
        outcome.stats_after = await _stats(admin)
    return outcome


@contextlib.contextmanager
def _worker(redis_url: str, port: int, log: IO[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """``kvmesh worker`` with the benchmark's settings; SIGTERM (then SIGKILL) at the end."""
    options = {
        **WORKER_OPTIONS,
        "worker_id": f"bench-{secrets.token_hex(3)}",
        "host": HOST,
        "port": port,
        "redis_url": redis_url,
    }
    with kvmesh_process(["worker", *worker_flags(options)], log) as proc:
        yield proc


@contextlib.contextmanager
def kvmesh_process(
    args: list[str], log: IO[bytes], tree: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``kvmesh ARGS`` logging to ``log`` at WARNING; SIGTERM (then SIGKILL) at the end, and
    SIGTERM from Linux if this process dies first (killed, it runs no ``finally``).
    ``tree``: another kvmesh checkout's, run there (``python -m app``) by this Python."""
    script = Path(sys.executable).parent / "kvmesh"
    use_script = script.exists() and tree is None
    command = [str(script)] if use_script else [sys.executable, "-m", "app"]
    env = {**os.environ, "KVMESH_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [*command, *args],
        cwd=tree,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        preexec_fn=death_signal_preexec(),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(base_url: str, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read()[-4_000:].decode(errors="replace")
            raise RuntimeError(f"the worker exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/ready", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the worker at {base_url} was not ready within {READY_TIMEOUT_S} s")


def measure_service(
    redis_url: str,
    redis_pid: int | None,
    prompts: list[list[int]],
    warmup: list[list[int]],
    num_sequential: int,
    concurrency: int,
) -> dict[str, Any]:
    bodies = [orjson.dumps({"prompt": p, "max_tokens": MAX_TOKENS}) for p in prompts]
    warmup_bodies = [orjson.dumps({"prompt": p, "max_tokens": MAX_TOKENS}) for p in warmup]
    port = free_port()
    base_url = f"http://{HOST}:{port}"
    httpx_logger = logging.getLogger("httpx")
    httpx_level = httpx_logger.level
    httpx_logger.setLevel(logging.WARNING)  # not a log line per request
    gc.collect()
    gc.freeze()  # the token lists are input: the client's collector need not walk them
    try:
        with tempfile.TemporaryFile() as log, _worker(redis_url, port, log) as proc:
            _wait_ready(base_url, proc, log)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                outcome = runner.run(
                    _drive(
                        port,
                        bodies,
                        warmup_bodies,
                        num_sequential,
                        concurrency,
                        proc.pid,
                        redis_pid,
                    )
                )
    finally:
        gc.unfreeze()
        httpx_logger.setLevel(httpx_level)
    before, after = outcome.stats_before["engine"], outcome.stats_after["engine"]
    reused = after["reused_prompt_tokens"] - before["reused_prompt_tokens"]
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    events_before, events_after = outcome.stats_before["events"], outcome.stats_after["events"]
    if outcome.failed:
        print(
            f"kvmesh bench worker: {outcome.failed} request(s) failed, e.g. {outcome.errors[0]}",
            file=sys.stderr,
        )
    seconds = outcome.seconds
    ok = outcome.ok
    result: dict[str, Any] = {
        "requests": len(prompts),
        "ok": ok,
        "failed": outcome.failed,
        "errors": outcome.errors,
        "concurrency": concurrency,
        "seconds": round(seconds, 3),
        "requests_per_s": round(ok / seconds, 1),
        "hit_rate": round(reused / (reused + computed), 6) if reused + computed else 0.0,
        "reused_prompt_tokens": reused,
        "computed_prompt_tokens": computed,
        "engine_steps": after["steps"] - before["steps"],
        "events_published": events_after["events"] - events_before["events"],
        "events_dropped": events_after["dropped"] - events_before["dropped"],
        "stream_entries": events_after["entries"] - events_before["entries"],
        "preemptions": after["preemptions"] - before["preemptions"],
        "client_cpu_s": round(outcome.client_cpu_s, 3),
        "worker_cpu_s": outcome.worker_cpu_s,
        "redis_cpu_s": outcome.redis_cpu_s,
        "other_cpu_s": _other_cpu(outcome),
        "worker_cpu_us_per_request": (
            round(outcome.worker_cpu_s / ok * 1e6, 1) if outcome.worker_cpu_s and ok else None
        ),
        "warmup_requests": len(warmup),
        "load_average": round(outcome.load_average, 2),
    }
    if ok:
        result.update(
            {
                "response_hit_rate": round(outcome.cached_tokens / outcome.prompt_tokens, 6),
                "ttft_p50_ms": round(_percentile(outcome.ttft_ms, 0.5), 3),
                "ttft_p99_ms": round(_percentile(outcome.ttft_ms, 0.99), 3),
                "queue_p50_ms": round(_percentile(outcome.queue_ms, 0.5), 3),
                "e2e_p50_ms": round(_percentile(outcome.e2e_ms, 0.5), 3),
                "e2e_p99_ms": round(_percentile(outcome.e2e_ms, 0.99), 3),
                "latency_p50_ms": round(_percentile(outcome.latency_ms, 0.5), 3),
                "latency_p99_ms": round(_percentile(outcome.latency_ms, 0.99), 3),
            }
        )
    return result


def measure(
    redis_url: str, redis_pid: int | None, *, num_requests: int, concurrency: int
) -> dict[str, Any]:
    prompts = make_prompts(num_requests)
    warmup = warmup_prompts(prompts, concurrency)
    num_sequential = len(warmup) - concurrency
    manager = measure_manager(prompts, warmup, concurrency)
    service = measure_service(redis_url, redis_pid, prompts, warmup, num_sequential, concurrency)
    efficiency = service["requests_per_s"] / manager["manager_only_requests_per_s"]
    worker_cpu = service["worker_cpu_us_per_request"]
    overhead = worker_cpu - manager["manager_only_cpu_us_per_request"] if worker_cpu else None
    return {
        **service,
        **manager,
        "service_efficiency": round(efficiency, 3),
        "service_cpu_us_per_request": round(overhead, 1) if overhead is not None else None,
        "max_tokens": MAX_TOKENS,
        "max_tokens_per_step": WORKER_OPTIONS["max_tokens_per_step"],
        "num_gpu_blocks": WORKER_OPTIONS["num_gpu_blocks"],
        "embedded_redis": redis_pid is not None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(getattr(args, "quick", False))
    sizes = {
        "num_requests": NUM_REQUESTS_QUICK if quick else NUM_REQUESTS,
        "concurrency": CONCURRENCY_QUICK if quick else CONCURRENCY,
    }
    with bench_redis() as (url, server):
        return measure(url, server.pid if server is not None else None, **sizes)
