"""``kvmesh bench router``: routing decisions, in process and through a real ``kvmesh router``.

Workload: ``kvmesh bench index``'s (``app.bench.index.generate``: 16 workers, chat sessions
sharing system prompts, real chained block hashes, msgpack-encoded events; generated in a child
process, as there), and its 4,096-token requests as token lists: half continue a conversation, a
quarter share only a system prompt, a quarter are cold. Each worker reports a fixed load, drawn
once (seeded): 0..32 running sequences, 0..4 waiting, 4,096..32,768 of its 65,536 blocks in use.

In-process part: a ``RouterCore`` (``kv_aware``, 16 tokens per block) over an index built from
the encoded stream as a consumer builds it (``build_streaming``), every worker registered with
its capacity and load. Timed per request, after one untimed pass over all of them:
``decision_*`` = ``core.hashes(tokens)`` + ``core.decide(hashes, len(tokens))``, the whole path
from token list to choice. The break-down, each in its own pass: ``hash_*`` (``core.hashes``),
``match_*`` (``index.find_matches_by_tier``), ``decide_*`` (``core.decide`` on the hashes as
the router service gives them, a list and its uint64 array: the match, then kv_aware in one
compiled call, ``app.router.fleet``), and the path that call replaces (the one other policies,
predictions and exclusions take): ``candidates_*`` (``core.candidates``: the match plus one
``Candidate`` per worker) and ``policy_*`` (``choose`` on those). The chat case (``chat_*``,
``app.bench.chat``): a 4,096-token conversation rendered with a model's chat template,
tokenized, hashed and decided, each stage timed.

HTTP part: a private ``redis-server`` (never ``$REDIS_URL``: a shared Redis would bring its own
workers into the router's view). A child process runs 16 ``EventPublisher``s, one per worker
(``app.bench.fleet``), which register the workers (URL, 16 tokens per block, capacity,
heartbeat), publish their loads and every event of the stream (renumbered per worker from 0, as
each worker's manager numbers its own) and stay alive, heartbeating, until the end. Then
``kvmesh router`` starts; its own consumer builds its index from the streams. Not timed:
waiting until ``/index/stats`` shows the same blocks and block-worker entries as the in-process
index and ``/ready`` answers 200 (``router_catch_up_s``), then warm-up (one request per client
at once, which opens the connections, then ``NUM_WARMUP`` one after the other), then the idle
window (below).

Timed: ``POST /route`` with ``{"prompt_token_ids": [...]}`` (bodies serialised beforehand with
orjson), open loop: request ``i`` is due at ``start + i / rate`` whatever the answers before
it; 1,000 requests/s for 10 s (``--quick``: 200/s for 1 s; ``--rate R`` sets the rate),
cycling over the requests. Each is sent on an idle connection from a pool of ``NUM_CLIENTS``
keep-alive connections, through a minimal HTTP/1.1 client (``app.bench.http_client``; httpx
cost as much CPU per request as the router). Latency (``http_*_ms``) is measured from the
request's due time to its answer parsed, so a client or router that falls behind shows up in
it instead of silently lowering the rate; ``http_send_lag_p99_ms`` is how late requests left
the client (whose garbage collector is off while it drives: a collection stalled it up to
0.3 s). An answer counts as an error unless it is a 200 naming one of the 16 workers.
``http_same_choice``: the fraction of answers that chose the worker the in-process core chose
for the same prompt (the router sees the same index and loads, and ties are broken by a seed
taken from the prompt, so anything below 1.0 means the two views differ).
``http_rate``: answers received / seconds from the first due time to the last answer.
``router_cpu_s`` etc.: CPU seconds of each process and its children over the timed part
(``/proc``; ``KVMESH_PROCESSES=N`` runs N router replicas, ``router_processes``);
``router_idle_cpu_ms_per_s``: the router's CPU rate over ``IDLE_S`` (3 s; ``--quick``: 1 s)
after the warm-up, routing nothing (its sync loop, load reads, stream reads), and
``router_busy_cpu_us_per_request`` the CPU per request less that rate; ``other_cpu_s``:
the rest of the machine meanwhile, ``load_average`` (1 minute) before: a router process is
single-threaded, and the client, Redis and the publishers share the machine with it, so on a
small or busy host the achieved rate and the tail latency measure the host as much as it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import httpx
import orjson
import uvloop

from app.bench.chat import measure_chat
from app.bench.fleet import CAPACITY_BLOCKS, publishers, worker_loads, worker_url
from app.bench.http_client import KeepAliveConnection
from app.bench.index import TOKENS_PER_BLOCK, build_streaming, generate
from app.bench.procfs import busy_us_per_request, replicas, tree_cpu_seconds
from app.bench.worker import _delta, _machine_busy_seconds, kvmesh_process
from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port
from app.router.core import RouterCore
from app.router.policies import RouteRequest, choose
from events.index import PrefixIndex

NUM_EVENTS = 20_000
NUM_EVENTS_QUICK = 1_000
NUM_REQUESTS = 2_000
NUM_REQUESTS_QUICK = 200
RATE = 1_000.0  # requests/s
RATE_QUICK = 200.0
DURATION_S = 10.0
DURATION_QUICK_S = 1.0
IDLE_S = 3.0  # the idle window before the timed part (at most the timed part's length)
NUM_CLIENTS = 32
NUM_WARMUP = 200
HOST = "127.0.0.1"
CATCH_UP_TIMEOUT_S = 180.0
CATCH_UP_POLL_S = 0.25
REQUEST_TIMEOUT_S = 10.0


def make_core(index: PrefixIndex, loads: dict[str, dict[str, int]]) -> RouterCore:
    """A router's core over ``index``, with every worker registered and its load reported."""
    core = RouterCore(index, tokens_per_block=TOKENS_PER_BLOCK, policy="kv_aware")
    for worker, load in loads.items():
        core.upsert_worker(worker, url=worker_url(worker), capacity_blocks=CAPACITY_BLOCKS)
        core.set_load(worker, dict(load))
    return core


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_us(fn: Callable[[Any], object], inputs: Sequence[Any]) -> tuple[float, float]:
    """(p50, p99) in microseconds of ``fn(item)`` over ``inputs``."""
    clock = time.perf_counter_ns
    samples: list[int] = []
    for item in inputs:
        start = clock()
        fn(item)
        samples.append(clock() - start)
    return (
        round(_percentile(samples, 0.5) / 1e3, 2),
        round(_percentile(samples, 0.99) / 1e3, 2),
    )


# -- the in-process part -------------------------------------------------------------------------


def measure_decision(core: RouterCore, requests: list[list[int]]) -> dict[str, Any]:
    hashes = [core.hashes(tokens) for tokens in requests]
    candidates = [core.candidates(h) for h in hashes]
    route_requests = [
        RouteRequest(len(tokens), core.tokens_per_block, h[-1] if h else len(tokens))
        for tokens, h in zip(requests, hashes, strict=True)
    ]

    def decision(tokens: list[int]) -> None:
        core.decide(core.hashes(tokens), len(tokens))

    def policy(k: int) -> None:
        choose(core.policy, route_requests[k], candidates[k], core.weights, core.state)

    for tokens in requests:  # warm-up (the hasher compiles on first use)
        decision(tokens)
    decision_p50, decision_p99 = _time_us(decision, requests)
    hash_p50, hash_p99 = _time_us(core.hashes, requests)
    match_p50, match_p99 = _time_us(core.index.find_matches_by_tier, hashes)
    arrays = [core.hash_array(tokens) for tokens in requests]
    decide_p50, decide_p99 = _time_us(
        lambda k: core.decide(hashes[k], len(requests[k]), hash_array=arrays[k]),
        range(len(requests)),
    )
    candidates_p50, _ = _time_us(core.candidates, hashes)
    policy_p50, policy_p99 = _time_us(policy, range(len(requests)))
    return {
        "decision_p50_us": decision_p50,
        "decision_p99_us": decision_p99,
        "hash_p50_us": hash_p50,
        "hash_p99_us": hash_p99,
        "match_p50_us": match_p50,
        "match_p99_us": match_p99,
        "decide_p50_us": decide_p50,
        "decide_p99_us": decide_p99,
        "candidates_p50_us": candidates_p50,
        "policy_p50_us": policy_p50,
        "policy_p99_us": policy_p99,
    }


# -- the router (a subprocess) -------------------------------------------------------------------


@contextlib.contextmanager
def _router(redis_url: str, port: int, log: IO[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """``kvmesh router`` on ``port``; SIGTERM (then SIGKILL) at the end."""
    flags = ["--host", HOST, "--port", str(port), "--redis-url", redis_url]
    with kvmesh_process(["router", *flags], log) as proc:
        yield proc


def _log_tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read()[-4_000:].decode(errors="replace")


def _wait_caught_up(
    base_url: str, proc: subprocess.Popen[bytes], log: IO[bytes], expected: dict[str, int]
) -> dict[str, Any]:
    """Wait until the router's index holds every block and it is ready; its index stats."""
    deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
    seen: dict[str, Any] = {}
    with httpx.Client(base_url=base_url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the router exited with {proc.returncode}:\n{_log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                # /index/stats sizes the whole index (tens of ms of the router's loop at half a
                # million blocks): asked only once the router says it is ready.
                if client.get("/ready").status_code == 200:
                    seen = orjson.loads(client.get("/index/stats").content)["index"]
                    if all(seen.get(k) == v for k, v in expected.items()):
                        return seen
            time.sleep(CATCH_UP_POLL_S)
    shown = {k: seen.get(k) for k in expected}
    raise RuntimeError(
        f"the router did not catch up within {CATCH_UP_TIMEOUT_S} s: its index has {shown}, "
        f"expected {expected}"
    )


# -- the HTTP clients ----------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What the clients saw during the timed part."""

    seconds: float = 0.0
    ok: int = 0
    same_choice: int = 0
    errors: list[str] = field(default_factory=list)
    num_errors: int = 0
    latency_ms: list[float] = field(default_factory=list)
    send_lag_ms: list[float] = field(default_factory=list)
    client_cpu_s: float = 0.0
    router_cpu_s: float | None = None
    router_idle_cpu_s: float | None = None  # over idle_s before the timed part
    idle_s: float = 0.0
    redis_cpu_s: float | None = None
    publishers_cpu_s: float | None = None
    router_processes: int = 1  # those that serve: one, or the replicas under a parent
    machine_cpu_s: float | None = None


async def _drive(
    base_url: str,
    bodies: list[bytes],
    chosen: list[str],
    rate: float,
    duration_s: float,
    pids: dict[str, int | None],
) -> Outcome:
    host, _, port = base_url.removeprefix("http://").partition(":")
    workers = set(chosen)
    outcome = Outcome()
    async with contextlib.AsyncExitStack() as stack:
        clients = [KeepAliveConnection(host, int(port)) for _ in range(NUM_CLIENTS)]
        for client in clients:
            stack.push_async_callback(client.aclose)
        # Warm-up: one request per client at once (opens the connections), then one by one.
        await asyncio.gather(*(c.post(bodies[i]) for i, c in enumerate(clients)))
        for i in range(NUM_WARMUP):
            await clients[0].post(bodies[i % len(bodies)])

        clock = time.perf_counter
        # The router's idle rate: its timers and Redis reads, with nothing to route.
        idle_cpu, idle_start = tree_cpu_seconds(pids["router"]), clock()
        await asyncio.sleep(min(IDLE_S, duration_s))
        outcome.router_idle_cpu_s = _delta(tree_cpu_seconds(pids["router"]), idle_cpu)
        outcome.idle_s = clock() - idle_start

        idle: asyncio.Queue[KeepAliveConnection] = asyncio.Queue()
        for client in clients:
            idle.put_nowait(client)
        last_answer = 0.0

        async def one(k: int, due: float) -> None:
            nonlocal last_answer
            client = await idle.get()
            sent = clock()
            try:
                answer = await asyncio.wait_for(client.post(bodies[k]), REQUEST_TIMEOUT_S)
                if answer.get("worker") not in workers:
                    raise ValueError(f"unknown worker {answer.get('worker')!r}")
            except Exception as exc:  # counted and shown, whatever it is (none is raised)
                outcome.num_errors += 1
                if len(outcome.errors) < 5:
                    outcome.errors.append(f"{type(exc).__name__}: {exc}")
                return
            finally:
                idle.put_nowait(client)
            done = clock()
            last_answer = max(last_answer, done)
            outcome.ok += 1
            outcome.same_choice += answer["worker"] == chosen[k]
            outcome.latency_ms.append((done - due) * 1e3)
            outcome.send_lag_ms.append((sent - due) * 1e3)

        num_requests = round(rate * duration_s)
        tasks: set[asyncio.Task[None]] = set()  # those not done: the client's heap stays small
        before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        machine_cpu = _machine_busy_seconds()
        client_cpu = time.process_time()
        start = clock()
        for i in range(num_requests):
            due = start + i / rate
            delay = due - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.add(task := asyncio.create_task(one(i % len(bodies), due)))
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        outcome.seconds = (last_answer if outcome.ok else clock()) - start
        outcome.client_cpu_s = time.process_time() - client_cpu
        after = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        outcome.router_processes = replicas(pids["router"])
        machine_after = _machine_busy_seconds()
    spent = {name: _delta(after[name], before[name]) for name in pids}
    outcome.router_cpu_s = spent.get("router")
    outcome.redis_cpu_s = spent.get("redis")
    outcome.publishers_cpu_s = spent.get("publishers")
    outcome.machine_cpu_s = _delta(machine_after, machine_cpu)
    return outcome


def _serve_and_drive(
    server: EmbeddedRedis,
    stream: list[tuple[str, bytes]],
    loads: dict[str, dict[str, int]],
    bodies: list[bytes],
    chosen: list[str],
    expected: dict[str, int],
    rate: float,
    duration_s: float,
) -> tuple[Outcome, dict[str, Any], float, float]:
    """Publishers, then the router; once it has caught up, the timed part. Returns the outcome,
    the router's index stats, the seconds it took to catch up, the load average before."""
    port = free_port()
    base_url = f"http://{HOST}:{port}"
    with (
        publishers(server.url, stream, loads) as fleet,
        tempfile.TemporaryFile() as log,
        _router(server.url, port, log) as router,
    ):
        started = time.monotonic()
        stats = _wait_caught_up(base_url, router, log, expected)
        catch_up_s = time.monotonic() - started
        pids = {"router": router.pid, "redis": server.pid, "publishers": fleet.pid}
        load_average = os.getloadavg()[0]
        gc.collect()
        gc.freeze()  # the bodies are input: the client's collector need not walk them
        gc.disable()  # nor collect while it drives (a 0.3 s stall counted as the router's)
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                outcome = runner.run(_drive(base_url, bodies, chosen, rate, duration_s, pids))
        finally:
            gc.enable()
            gc.unfreeze()
        if router.poll() is not None:
            raise RuntimeError(f"the router exited with {router.returncode}:\n{_log_tail(log)}")
    return outcome, stats, catch_up_s, load_average


def measure_http(
    server: EmbeddedRedis,
    stream: list[tuple[str, bytes]],
    loads: dict[str, dict[str, int]],
    requests: list[list[int]],
    chosen: list[str],
    expected: dict[str, int],
    rate: float,
    duration_s: float,
) -> dict[str, Any]:
    bodies = [orjson.dumps({"prompt_token_ids": tokens}) for tokens in requests]
    httpx_logger = logging.getLogger("httpx")
    httpx_level = httpx_logger.level
    httpx_logger.setLevel(logging.WARNING)  # not a log line per request
    try:
        outcome, stats, catch_up_s, load_average = _serve_and_drive(
            server, stream, loads, bodies, chosen, expected, rate, duration_s
        )
    finally:
        httpx_logger.setLevel(httpx_level)
    if outcome.num_errors:
        print(
            f"kvmesh bench router: {outcome.num_errors} request(s) failed, "
            f"e.g. {outcome.errors[0]}",
            file=sys.stderr,
        )
    ok = outcome.ok
    ours = [outcome.client_cpu_s, outcome.router_cpu_s, outcome.redis_cpu_s]
    ours.append(outcome.publishers_cpu_s)
    other = (
        round(max(outcome.machine_cpu_s - sum(c or 0.0 for c in ours), 0.0), 3)
        if outcome.machine_cpu_s is not None
        else None
    )
    result: dict[str, Any] = {
        "http_offered_rate": rate,
        "http_seconds": round(outcome.seconds, 3),
        "http_requests": ok + outcome.num_errors,
        "http_ok": ok,
        "http_errors": outcome.num_errors,
        "http_error_samples": outcome.errors,
        "http_rate": round(ok / outcome.seconds, 1) if outcome.seconds > 0 else 0.0,
        "http_same_choice": round(outcome.same_choice / ok, 4) if ok else 0.0,
        "router_workers": stats["workers"],
        "router_catch_up_s": round(catch_up_s, 2),
        "router_cpu_s": outcome.router_cpu_s,
        "router_processes": outcome.router_processes,
        "router_cpu_us_per_request": (
            round(outcome.router_cpu_s / ok * 1e6, 1) if outcome.router_cpu_s and ok else None
        ),
        "router_idle_cpu_ms_per_s": (
            round(outcome.router_idle_cpu_s / outcome.idle_s * 1e3, 1)
            if outcome.router_idle_cpu_s is not None and outcome.idle_s > 0
            else None
        ),
        "router_busy_cpu_us_per_request": busy_us_per_request(
            outcome.router_cpu_s, outcome.seconds, ok, outcome.router_idle_cpu_s, outcome.idle_s
        ),
        "client_cpu_s": round(outcome.client_cpu_s, 3),
        "redis_cpu_s": outcome.redis_cpu_s,
        "publishers_cpu_s": outcome.publishers_cpu_s,
        "other_cpu_s": other,
        "cpus": os.cpu_count(),
        "load_average": round(load_average, 2),
    }
    if ok:
        result.update(
            {
                "http_p50_ms": round(_percentile(outcome.latency_ms, 0.5), 3),
                "http_p99_ms": round(_percentile(outcome.latency_ms, 0.99), 3),
                "http_max_ms": round(max(outcome.latency_ms), 3),
                "http_send_lag_p99_ms": round(_percentile(outcome.send_lag_ms, 0.99), 3),
            }
        )
    return result


# -- the whole run -------------------------------------------------------------------------------


def measure(num_events: int, num_requests: int, rate: float, duration_s: float) -> dict[str, Any]:
    # Generated in a child, as `kvmesh bench index` does: this process's heap stays clean.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        stream, num_blocks, request_array = pool.apply(generate, (num_events, num_requests))
    requests: list[list[int]] = request_array.tolist()
    del request_array
    index, _ = build_streaming(stream)
    stats = index.stats()
    loads = worker_loads()
    core = make_core(index, loads)
    gc.collect()
    gc.freeze()
    try:
        decision = measure_decision(core, requests)
        chat = measure_chat(core)
        chosen = [core.decide(core.hashes(tokens), len(tokens)).worker for tokens in requests]
    finally:
        gc.unfreeze()
    expected = {"workers": stats["workers"], "blocks": stats["blocks"]}
    expected["entries"] = stats["entries"]
    with EmbeddedRedis() as server:
        http = measure_http(server, stream, loads, requests, chosen, expected, rate, duration_s)
    return {
        "workers": stats["workers"],
        "events": len(stream),
        "index_blocks": stats["blocks"],
        "index_entries": stats["entries"],
        "stored_blocks": num_blocks,
        "prompt_tokens": len(requests[0]),
        "requests": len(requests),
        "policy": core.policy,
        **decision,
        **chat,
        **http,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    quick = getattr(args, "quick", False)
    rate = getattr(args, "rate", None) or (RATE_QUICK if quick else RATE)  # --rate R
    if quick:
        return measure(NUM_EVENTS_QUICK, NUM_REQUESTS_QUICK, rate, DURATION_QUICK_S)
    return measure(NUM_EVENTS, NUM_REQUESTS, rate, DURATION_S)
