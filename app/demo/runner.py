"""``kvmesh demo``: the whole system on one machine, and the comparison it is for.

1. Redis: ``REDIS_URL`` if set, else a private ``redis-server`` (``app.core.embedded_redis``).
2. A router with the dashboard (``kvmesh router``, its admin token made up for the run); its
   dashboard URL is printed as soon as it answers.
3. For each policy (``kv_aware``, then ``round_robin``): a fresh set of worker processes
   (``kvmesh worker``, sim back-end, CPU pools; new ids, so empty caches), the router switched
   to the policy (``PUT /policy``), and the workload replayed through the router over HTTP at
   real time, scaled by ``--speed``, each request streamed so that the client measures its own
   time to first token; then the workers are stopped (SIGTERM: they drain and unregister).
4. A table comparing the policies: prefix hit ratio (from each response's
   ``usage.prompt_tokens_details.cached_tokens``), TTFT p50/p99, load imbalance (as in
   ``kvmesh replay``: per 60 s of trace time, the busiest worker's uncached prompt tokens over
   the mean) and failed requests.
5. The last cluster keeps serving until Ctrl-C, or until ``--duration`` seconds after start.

``--duration`` bounds the whole run, as one expects of ``--duration 5``: once the first workers
are up, each policy replays only the requests that arrive within its share of the time left
(``fit_to_time``: the second set of workers takes as long to start as the first, plus a few
seconds to wrap up), and at least the first request, so a short run still compares something
and ends about when asked (starting the processes alone takes 10 to 20 s). Without it,
the whole workload, then serve until Ctrl-C.

Every child logs to its own file in a temporary folder. The folder is deleted when the demo
ends cleanly and kept, and its path printed last, when anything failed: an exception, Ctrl-C
or SIGTERM, or a child that exited with a non-zero status (then ``DemoFailed``).

The workload: ``conversations.jsonl`` beside this module, 192 requests of 48 multi-turn
conversations from the Mooncake conversation trace (Apache-2.0; ``README.md`` here says how it
was cut), its token ids derived from the trace's block ids as ``kvmesh replay`` does. Outputs
are capped at ``--max-output-tokens`` so the demo takes a minute, not half an hour.

Every child runs in its own session, so Ctrl-C reaches the demo only, which then stops each
child (SIGTERM, then SIGKILL after a grace period) and its Redis before it exits; SIGTERM to the
demo does the same. Nothing is left running, and no port stays taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import webbrowser
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import httpx
import numpy as np
import orjson

from app.core.embedded_redis import EmbeddedRedis, death_signal_preexec
from app.core.net import free_port, port_is_free
from app.replay.report import load_imbalance
from app.replay.trace import TokenSource, TraceRequest, load_trace

__all__ = [
    "DEMO_TRACE",
    "DemoError",
    "DemoFailed",
    "DemoOptions",
    "PhaseResult",
    "fit_to_time",
    "run_demo",
]

DEMO_TRACE = Path(__file__).resolve().parent / "conversations.jsonl"
POLICIES = ("kv_aware", "round_robin")
IMBALANCE_WINDOW_S = 60.0  # of trace time, as in kvmesh replay
_READY_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 10.0
# What a --duration run keeps besides the replays, as measured on the 2-core development
# machine: stopping the first workers, then the router and Redis at the end (a second or two
# each); and after each replay's last request, the answers still in flight (seconds when the
# workers are saturated, as they are there: four workers, the router and the client on 2 cores).
_WRAP_UP_S = 3.0
_TAIL_S = 3.0


class DemoError(Exception):
    """The demo cannot start as asked (the message says why)."""


class DemoFailed(Exception):
    """Something failed while the demo ran: a child exited, or did not come up in time (the
    message says which; the logs are kept)."""


@dataclass(slots=True)
class DemoOptions:
    workers: int = 4
    duration_s: float | None = None
    trace: Path = DEMO_TRACE
    requests: int | None = None
    port: int = 8000
    browser: bool = True
    speed: float = 85.0
    blocks_per_worker: int = 4_096
    max_output_tokens: int = 32
    redis_url: str | None = None
    progress: bool = True


@dataclass(slots=True)
class RequestResult:
    arrival_s: float  # trace time
    worker: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None


@dataclass(slots=True)
class PhaseResult:
    policy: str
    results: list[RequestResult] = field(default_factory=list)

    def summary(self, workers: list[str]) -> dict[str, Any]:
        ok = [r for r in self.results if r.error is None]
        prompt = sum(r.prompt_tokens for r in ok)
        ttfts = np.array([r.ttft_s for r in ok if r.ttft_s is not None], dtype=np.float64)
        return {
            "hit_ratio": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
            "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts.size else None,
            "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts.size else None,
            "load_imbalance": self.imbalance(workers),
            "requests": len(self.results),
            "failed": len(self.results) - len(ok),
        }

    def imbalance(self, workers: list[str]) -> float:
        ok = [r for r in self.results if r.error is None and r.worker in workers]
        if not ok:
            return 1.0
        windows = int(max(r.arrival_s for r in ok) // IMBALANCE_WINDOW_S) + 1
        load = np.zeros((windows, len(workers)), dtype=np.int64)
        largest = np.zeros(windows, dtype=np.int64)  # one request's prefill cannot be split
        column = {w: i for i, w in enumerate(workers)}
        for r in ok:
            window = int(r.arrival_s // IMBALANCE_WINDOW_S)
            computed = r.prompt_tokens - r.cached_tokens
            load[window, column[r.worker]] += computed
            largest[window] = max(largest[window], computed)
        return load_imbalance(load, largest)


# -- processes ---------------------------------------------------------------------------------


class Processes:
    """Child ``kvmesh`` processes, each in its own session, logging to one file each."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}
        self.failures: list[str] = []  # "<name> exited with status <n>", for every non-zero exit

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> int:
        """Start ``kvmesh ARGS`` as ``name``; its pid."""
        log = (self.log_dir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # Ctrl-C reaches the demo, which stops us in order
            preexec_fn=death_signal_preexec(),  # and a demo killed by SIGKILL leaves no orphan
        )
        self.procs[name] = (proc, log)
        return proc.pid

    def check(self, name: str) -> None:
        proc, _ = self.procs[name]
        if proc.poll() is not None:
            tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2_000:]
            raise DemoFailed(f"{name} exited with status {proc.returncode}:\n{tail}")

    def stop(self, names: list[str]) -> None:
        """SIGTERM to each, then wait; SIGKILL what is still running after the grace period."""
        for name in names:
            proc, _ = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for name in names:
            proc, log = self.procs.pop(name)
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            if proc.returncode != 0:  # workers and the router exit 0 on SIGTERM
                self.failures.append(f"{name} exited with status {proc.returncode}")

    def stop_all(self) -> None:
        self.stop(list(self.procs))


def _wait_until(check: Any, what: str, procs: Processes, names: list[str]) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while True:
        for name in names:
            procs.check(name)
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return
        if time.monotonic() > deadline:
            raise DemoFailed(f"{what} did not happen within {_READY_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


# -- the workload ------------------------------------------------------------------------------


def fit_to_time(
    trace: list[TraceRequest], *, speed: float, left_s: float, startup_s: float
) -> list[TraceRequest]:
    """The requests each policy replays to end within ``left_s`` from now, the first set of
    workers being up and having taken ``startup_s`` to start: those arriving (at ``speed``)
    within an equal share of what is left once the second set has started as long, the run
    wrapped up and each replay's last answers come in; at least the first request."""
    window_s = (left_s - startup_s - _WRAP_UP_S) / len(POLICIES) - _TAIL_S
    fitted = [r for r in trace if r.timestamp_ms / 1000 / speed <= window_s]
    return fitted or trace[:1]


async def drive(
    base_url: str,
    trace: list[TraceRequest],
    tokens: TokenSource,
    *,
    speed: float,
    max_output_tokens: int,
    progress: bool,
) -> list[RequestResult]:
    """Send every request through the router at its (scaled) trace time; stream each answer."""
    bar = _progress_bar(len(trace)) if progress else None
    results = [RequestResult(r.timestamp_ms / 1000) for r in trace]
    limits = httpx.Limits(max_connections=len(trace), max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=300.0, limits=limits) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for request, result in zip(trace, results, strict=True):
            delay = request.timestamp_ms / 1000 / speed - (loop.time() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            body = {
                "prompt": tokens.token_list(request),
                "max_tokens": max(1, min(request.output_length, max_output_tokens)),
                "stream": True,
            }
            tasks.append(asyncio.create_task(_one(client, body, result, bar)))
        await asyncio.gather(*tasks)
    if bar is not None:
        bar.close()
    return results


async def _one(
    client: httpx.AsyncClient, body: dict[str, Any], result: RequestResult, bar: Any
) -> None:
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            result.worker = response.headers.get("x-kvmesh-worker", "")
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if result.ttft_s is None and chunk["choices"][0]["token_ids"]:
                    result.ttft_s = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage is not None:
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            result.e2e_s = time.perf_counter() - start
            if not result.prompt_tokens:
                result.error = "the stream ended without usage"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if bar is not None:
            bar.update(1)


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, unit="req", file=sys.stderr, leave=False, disable=None)


# -- the demo ----------------------------------------------------------------------------------


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"{'policy':<12} {'hit ratio':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'imbalance':>9} {'requests':>8} {'failed':>6}"
    ]
    for policy, s in summaries.items():
        p50 = f"{s['ttft_p50_s'] * 1e3:.0f} ms" if s["ttft_p50_s"] is not None else "-"
        p99 = f"{s['ttft_p99_s'] * 1e3:.0f} ms" if s["ttft_p99_s"] is not None else "-"
        lines.append(
            f"{policy:<12} {s['hit_ratio']:>9.3f} {p50:>9} {p99:>9} "
            f"{s['load_imbalance']:>9.2f} {s['requests']:>8} {s['failed']:>6}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def _terminate_on_sigterm() -> Iterator[None]:
    """SIGTERM becomes SIGINT, so that both take the same way out: a KeyboardInterrupt, or
    inside ``asyncio.run`` its own SIGINT handler, which cancels the main task and raises
    KeyboardInterrupt once the tasks are done. (Raising KeyboardInterrupt from this handler
    inside the event loop left a task holding it, logged at exit as "never retrieved".)"""

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, handler)
    # A shell starts a background job with SIGINT ignored, and Python then leaves it ignored:
    # SIGTERM (and Ctrl-C) would do nothing. The demo's way out needs SIGINT's own handler.
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_demo(options: DemoOptions, out: IO[str] = sys.stdout) -> dict[str, dict[str, Any]]:
    """Run the demo (see the module docstring); returns the summary per policy."""
    started = time.monotonic()
    deadline = None if options.duration_s is None else started + options.duration_s
    if not port_is_free(options.port):
        raise DemoError(f"port {options.port} is in use; choose another with --port")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    trace = load_trace(options.trace, limit=options.requests)

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    log_dir = Path(tempfile.mkdtemp(prefix="kvmesh-demo-"))
    procs = Processes(log_dir)
    clean = False
    try:
        with _terminate_on_sigterm():
            summaries = _run(options, trace, procs, deadline, say)
        clean = True
    finally:
        # The children are stopped by now (their exit statuses recorded), Redis too.
        if clean and not procs.failures:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            say(f"kvmesh demo: logs kept in {log_dir}")
    if procs.failures:
        raise DemoFailed("; ".join(procs.failures))
    return summaries


def _run(
    options: DemoOptions,
    trace: list[TraceRequest],
    procs: Processes,
    deadline: float | None,
    say: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    tokens = TokenSource(seed=0)
    longest = max(r.input_length for r in trace) + options.max_output_tokens
    max_seq_len = -(-longest // 16) * 16
    admin_token = secrets.token_urlsafe(16)
    summaries: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        redis_url = options.redis_url
        if redis_url is None:
            redis = stack.enter_context(EmbeddedRedis())
            redis_url = redis.url
        stack.callback(procs.stop_all)  # before Redis stops: workers flush on the way out
        base = f"http://127.0.0.1:{options.port}"
        pid = procs.start(
            "router",
            ["router", "--port", str(options.port), "--redis-url", redis_url],
            env={"KVMESH_ADMIN_TOKEN": admin_token},
        )
        say(f"  router: pid {pid}")
        _wait_until(
            lambda: httpx.get(f"{base}/health").status_code == 200, "the router", procs, ["router"]
        )
        say(
            f"kvmesh demo: dashboard at {base}/dashboard (logs in {procs.log_dir}, deleted at "
            "exit unless something fails)"
        )
        if options.browser:
            with contextlib.suppress(Exception):
                webbrowser.open(f"{base}/dashboard")
        auth = {"Authorization": f"Bearer {admin_token}"}
        workers: list[str] = []
        replayed = trace
        for phase, policy in enumerate(POLICIES):
            if workers:
                procs.stop(workers)
            starting = time.monotonic()
            workers = [f"{policy.replace('_', '-')}-{i}" for i in range(options.workers)]
            for worker in workers:
                port = free_port()
                pid = procs.start(
                    worker,
                    [
                        *("worker", "--worker-id", worker, "--port", str(port)),
                        *("--redis-url", redis_url, "--max-seq-len", str(max_seq_len)),
                        *("--num-gpu-blocks", str(options.blocks_per_worker)),
                        *("--heartbeat-ttl-s", "2"),
                    ],
                )
                say(f"  {worker}: pid {pid}, port {port}")
            response = httpx.put(f"{base}/policy", json={"policy": policy}, headers=auth)
            response.raise_for_status()

            def cluster_is(expected: list[str]) -> bool:
                seen = httpx.get(f"{base}/workers").json()["workers"]
                up = sorted(w["worker"] for w in seen if w["state"] == "up")
                return up == sorted(expected)

            _wait_until(
                lambda expected=workers: cluster_is(expected),
                f"{options.workers} workers up behind the router",
                procs,
                ["router", *workers],
            )
            if phase == 0 and deadline is not None:
                # Decided once, so that both policies replay the same requests.
                now = time.monotonic()
                replayed = fit_to_time(
                    trace, speed=options.speed, left_s=deadline - now, startup_s=now - starting
                )
                if len(replayed) < len(trace):
                    say(
                        f"  --duration {options.duration_s:g}: each policy replays the first "
                        f"{len(replayed)} of {len(trace)} requests, to end in time"
                    )
            say(
                f"[{phase + 1}/{len(POLICIES)}] {policy}: {len(replayed)} "
                f"request{'s' if len(replayed) != 1 else ''} through {options.workers} fresh "
                "workers ..."
            )
            results = asyncio.run(
                drive(
                    base,
                    replayed,
                    tokens,
                    speed=options.speed,
                    max_output_tokens=options.max_output_tokens,
                    progress=options.progress,
                )
            )
            phase_result = PhaseResult(policy, results)
            summaries[policy] = phase_result.summary(workers)
            for result in results:
                if result.error is not None:
                    say(f"  failed: {result.error}")
        say("")
        say(format_table(summaries))
        say("")
        try:  # before the line that invites the Ctrl-C
            if deadline is None:
                say(f"serving at {base} (dashboard: {base}/dashboard); Ctrl-C to stop")
            elif deadline > time.monotonic():
                say(f"serving at {base} for {deadline - time.monotonic():.0f} s more")
            while deadline is None or time.monotonic() < deadline:
                for name in list(procs.procs):
                    procs.check(name)
                left = math.inf if deadline is None else deadline - time.monotonic()
                time.sleep(min(0.5, max(left, 0.0)))
        except KeyboardInterrupt:
            # Ctrl-C while serving is how a demo without --duration ends: nothing failed.
            say("kvmesh demo: stopped")
    return summaries
