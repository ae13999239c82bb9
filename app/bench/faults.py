"""``kvmesh bench faults``: kvmesh under faults and load, with real processes; the figures of
``docs/reliability.md``.

Each scenario is a function that sets its cluster up, injects its fault, measures and tears
everything down; ``tests/e2e/test_faults.py`` runs the same functions with small numbers and
asserts their outcomes exactly, ``run`` with larger numbers and prints them. Every scenario has
its own private ``redis-server`` (``EmbeddedRedis``; never ``$REDIS_URL``: a shared Redis would
bring other workers into the routers' view).

* ``kill_worker_under_load``: ``kvmesh router`` and N sim ``kvmesh worker`` processes, an
  open-loop client (``/v1/completions``, a share streaming); one worker is killed with SIGKILL
  mid-run. Measured: when the router's ``/workers`` stops listing it as routable and when
  ``/index/stats`` no longer holds its blocks (both from the kill), what became of the requests
  in flight at the kill (completed elsewhere after a retry, or failed with a clear status:
  a 502 in OpenAI's error shape, or an error event ending the stream), that no request was sent
  to it afterwards and that none hung.
* ``redis_restart_under_load``: the same cluster plus an in-process observer (a second router's
  ``RouterRuntime``, whose index can be read exactly); Redis is killed, stays away
  ``outage_s``, and comes back *empty* while the client keeps sending. Measured: requests
  completed/rejected/failed during the run, the time from the restart until the routing router
  is ready with every worker up and the observer has every worker synchronised again
  (``recovered_s``), and, once the load has stopped, that the observer's index equals every
  worker's reuse tree (``GET /blocks``: hash and tier) exactly and the routing router's
  ``/index/stats`` has the same block counts per worker and tier.
* ``router_restart``: W publishers (a child process, one ``EventPublisher`` per worker, as in
  ``kvmesh bench router``) publish B synthetic stored blocks each (random 64-bit hashes, chains
  of 64 blocks from the root, every fourth chain on the host tier), then stay alive. A
  ``kvmesh router`` starts cold (snapshots taken at the publishers' start, so the index is
  rebuilt from the streams); then every publisher writes a fresh snapshot (as a worker does
  when a consumer asks for one), the router is killed with SIGKILL and started again (rebuilt
  from the snapshots, the stream entries they cover skipped). Time to ready: from the process'
  start until ``/ready`` answers 200 and ``/index/stats`` holds every worker's blocks per tier.
  Last, an in-process ``RouterRuntime`` is started the same way and its index compared, block
  by block and tier by tier, with what was published.
* ``publisher_cut_off``: one publisher's Redis user is switched off (``ACL SETUSER ... off``
  and its connections killed: Redis keeps its data, the other clients carry on) while it keeps
  publishing, until its buffer (``max_buffer_blocks``) overflows; then it is switched on again.
  What it holds is what it published, so its snapshot covers the dropped events. Measured: the
  events dropped, that the stream's ``dropped`` counts add up to them (the count reaches the
  consumer), that an in-process router resynchronised that worker once for it, and that its
  index then equals what was published, exactly. ``tests/events/test_publisher_consumer.py``
  (``test_drop_path_snapshot_and_resync_while_redis_refuses_the_worker``) checks the same path
  with a real ``KVCacheManager`` and a bare consumer.
* ``load``: ``kvmesh router`` and 4 workers, R requests at a stated rate (open loop), a share
  streaming; the RSS (``VmRSS`` of ``/proc/<pid>/status``) of every process sampled every
  100 ms. Every request must complete or be rejected with a clear status; latency p50/p99 of
  the completed ones, from their due time.
* ``publishers_into_consumer``: 8 ``EventPublisher`` at full speed (batches pre-recorded from
  real ``KVCacheManager`` workloads: ``app.bench.events.record``) into one ``EventConsumer`` in
  its own process, which samples its RSS every 50 ms. Lag: for each entry applied, the time
  from the ``publish()`` of its oldest batch to its events being in the index.

Outcomes of a request (``Outcome.kind``): ``completed`` (200 with choices, or a stream ending
in ``[DONE]``), ``rejected`` (429 or 503 in OpenAI's error shape: try again later), ``failed``
(502 in that shape, or a stream ending in an error event: the client is told), ``unclear``
(anything else: a timeout, a dropped connection, a 500, a stream cut without a word). Only
``unclear`` is a defect.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np
import orjson
import redis.asyncio as aioredis

from app.bench.events import Recording, record
from app.bench.worker import kvmesh_process
from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port
from app.router.service import RouterRuntime
from app.router.settings import RouterSettings
from cache import KVCacheEvent, StoredBlock, StoredData
from events import keys
from events.consumer import EventConsumer
from events.envelope import Envelope, decode_envelope
from events.publisher import EventPublisher, PublisherConfig
from events.snapshot import Snapshot

HOST = "127.0.0.1"
TOKENS_PER_BLOCK = 16
VOCAB = 512  # the tiny model's
READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 30.0
POLL_S = 0.02
MAX_IN_FLIGHT = 64  # requests the client has open at once
CHAIN_BLOCKS = 64
SEED = 12  # issue #12

# -- processes and their memory ----------------------------------------------------------------


def rss_kib(pid: int | None) -> int | None:
    """Resident memory of a process in KiB (``VmRSS``), None when it is gone."""
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


class RssSampler:
    """Samples the RSS of named processes every ``interval_s`` in a thread: first and max."""

    def __init__(self, pids: dict[str, int | None], interval_s: float = 0.1) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.first_kib: dict[str, int] = {}
        self.max_kib: dict[str, int] = {}
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-rss", daemon=True)

    def __enter__(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            kib = rss_kib(pid)
            if kib is None:
                continue
            self.first_kib.setdefault(name, kib)
            self.max_kib[name] = max(self.max_kib.get(name, 0), kib)
        self.num_samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def max_mib(self) -> dict[str, float]:
        return {name: round(kib / 1024, 1) for name, kib in sorted(self.max_kib.items())}

    def first_mib(self) -> dict[str, float]:
        return {name: round(kib / 1024, 1) for name, kib in sorted(self.first_kib.items())}


@dataclass(slots=True)
class Cluster:
    """``kvmesh worker`` processes and (optionally) a ``kvmesh router`` on one Redis."""

    redis_url: str
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    worker_urls: dict[str, str] = field(default_factory=dict)
    router: subprocess.Popen[bytes] | None = None
    router_url: str = ""

    def pids(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {w: p.pid for w, p in self.workers.items()}
        if self.router is not None:
            out["router"] = self.router.pid
        return out


def worker_flags(
    worker_id: str,
    port: int,
    redis_url: str,
    *,
    num_gpu_blocks: int,
    num_host_blocks: int,
    heartbeat_ttl_s: float,
    step_ms: float,
) -> list[str]:
    """``kvmesh worker`` for a sim worker: ``step_ms`` a step, prefill and decode free."""
    return [
        *("worker", "--worker-id", worker_id, "--host", HOST, "--port", str(port)),
        *("--redis-url", redis_url, "--max-seq-len", "2048"),
        *("--num-gpu-blocks", str(num_gpu_blocks), "--num-host-blocks", str(num_host_blocks)),
        *("--heartbeat-ttl-s", str(heartbeat_ttl_s), "--sim-step-overhead-ms", str(step_ms)),
        *("--sim-prefill-us-per-token", "0", "--sim-decode-us-per-sequence", "0"),
    ]


def _log_tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read()[-4_000:].decode(errors="replace")


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: IO[bytes]) -> float:
    """Poll ``url/ready`` until 200; the seconds it took (RuntimeError if it exits or stalls)."""
    start = time.monotonic()
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() - start < READY_TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode}:\n{_log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/ready").status_code == 200:
                    return time.monotonic() - start
            time.sleep(POLL_S)
    raise RuntimeError(f"{url} was not ready within {READY_TIMEOUT_S} s:\n{_log_tail(log)}")


@contextlib.contextmanager
def cluster(
    redis_url: str,
    num_workers: int,
    log: IO[bytes],
    *,
    router: bool = True,
    num_gpu_blocks: int = 256,
    num_host_blocks: int = 64,
    heartbeat_ttl_s: float = 2.0,
    step_ms: float = 2.0,
) -> Iterator[Cluster]:
    """Start the workers (at once) and the router; yield once every worker is routed to."""
    out = Cluster(redis_url)
    with contextlib.ExitStack() as stack:
        for i in range(num_workers):
            worker_id, port = f"w{i}", free_port()
            flags = worker_flags(
                worker_id,
                port,
                redis_url,
                num_gpu_blocks=num_gpu_blocks,
                num_host_blocks=num_host_blocks,
                heartbeat_ttl_s=heartbeat_ttl_s,
                step_ms=step_ms,
            )
            out.workers[worker_id] = stack.enter_context(kvmesh_process(flags, log))
            out.worker_urls[worker_id] = f"http://{HOST}:{port}"
        for worker_id, proc in out.workers.items():
            wait_ready(out.worker_urls[worker_id], proc, log)
        if router:
            port = free_port()
            flags = ["router", "--host", HOST, "--port", str(port), "--redis-url", redis_url]
            flags += ["--load-interval-s", "0.05", "--sync-interval-s", "0.02"]
            out.router = stack.enter_context(kvmesh_process(flags, log))
            out.router_url = f"http://{HOST}:{port}"
            wait_ready(out.router_url, out.router, log)
            wait_until(lambda: routable(out.router_url) == set(out.workers), READY_TIMEOUT_S)
        yield out


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str = "condition") -> float:
    """Poll ``condition()`` until true; the seconds it took (TimeoutError after ``timeout_s``)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: still false after {timeout_s} s")
        time.sleep(POLL_S)
    return time.monotonic() - start


def worker_states(router_url: str) -> dict[str, str]:
    """The router's ``/workers``: worker -> state (``up``, ``stale``, ``draining``: routed to,
    stale ones only when nothing fresher is there; ``gone``: not routed to)."""
    try:
        workers = httpx.get(f"{router_url}/workers", timeout=2.0).json()["workers"]
    except (httpx.HTTPError, ValueError):
        return {}
    return {w["worker"]: w["state"] for w in workers}


def routable(router_url: str) -> set[str]:
    """Workers the router lists as up with fresh data."""
    return {w for w, state in worker_states(router_url).items() if state == "up"}


def index_counts(router_url: str) -> dict[str, dict[str, int]]:
    """The router's ``/index/stats`` blocks per worker and tier."""
    body = httpx.get(f"{router_url}/index/stats", timeout=10.0).json()
    per_worker: dict[str, dict[str, int]] = body["index"]["per_worker"]
    return per_worker


def counts_of(tree: dict[int, int]) -> dict[str, int]:
    """Blocks per tier of a hash -> tier map, as ``/index/stats`` writes them."""
    host = sum(tree.values())
    return {"blocks": len(tree), "gpu": len(tree) - host, "host": host}


async def worker_tree(client: httpx.AsyncClient, worker_url: str) -> dict[int, int]:
    """A worker's reuse tree from ``GET /blocks``: hash -> tier (0 GPU, 1 host)."""
    tree: dict[int, int] = {}
    offset = 0
    while True:
        page = (await client.get(f"{worker_url}/blocks", params={"offset": offset})).json()
        tree.update((b["hash"], b["level"]) for b in page["blocks"])
        offset += len(page["blocks"])
        if not page["blocks"] or offset >= page["total"]:
            return tree


# -- the client: an open loop of completions ---------------------------------------------------


@dataclass(slots=True)
class Outcome:
    index: int
    stream: bool
    due: float  # time.monotonic() when it was due
    ended: float = 0.0
    status: int | None = None
    worker: str | None = None
    kind: str = "unclear"  # completed | rejected | failed | unclear
    detail: str = ""


def make_prompts(num: int, seed: int, *, num_documents: int = 16) -> list[list[int]]:
    """Prompts sharing one of ``num_documents`` openings of 8 blocks, plus a 2-block tail."""
    rng = np.random.default_rng(seed)
    documents = rng.integers(0, VOCAB, size=(num_documents, 8 * TOKENS_PER_BLOCK)).tolist()
    tails = rng.integers(0, VOCAB, size=(num, 2 * TOKENS_PER_BLOCK)).tolist()
    picks = rng.integers(0, num_documents, size=num).tolist()
    return [documents[d] + tail for d, tail in zip(picks, tails, strict=True)]


def _error_of(content: bytes) -> str | None:
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("type") if isinstance(error, dict) else None


async def _send(
    client: httpx.AsyncClient, outcome: Outcome, prompt: list[int], max_tokens: int
) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": outcome.stream}
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with client.stream("POST", "/v1/completions", json=body) as response:
                outcome.status = response.status_code
                outcome.worker = response.headers.get("x-kvmesh-worker")
                if not (outcome.stream and response.status_code == 200):
                    content = await response.aread()
                    error = _error_of(content)
                    if response.status_code == 200 and b'"choices"' in content:
                        outcome.kind = "completed"
                    elif response.status_code in (429, 503) and error:
                        outcome.kind, outcome.detail = "rejected", error
                    elif response.status_code == 502 and error:
                        outcome.kind, outcome.detail = "failed", error
                    else:
                        outcome.detail = f"HTTP {response.status_code}: {content[:120]!r}"
                    return
                last = b""
                error = None
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    last = line.encode()
                    if line.startswith('data: {"error"'):
                        error = _error_of(last.removeprefix(b"data: "))
                if error:
                    outcome.kind, outcome.detail = "failed", f"stream: {error}"
                elif last == b"data: [DONE]":
                    outcome.kind = "completed"
                else:
                    outcome.detail = f"stream cut without an error event after {last[:80]!r}"
    except TimeoutError:
        outcome.detail = f"no answer within {REQUEST_TIMEOUT_S} s"
    except httpx.HTTPError as exc:
        outcome.detail = f"{type(exc).__name__}: {exc}"
    finally:
        outcome.ended = time.monotonic()


async def drive(
    base_url: str,
    prompts: Sequence[list[int]],
    *,
    rate: float,
    stream_share: float,
    max_tokens: int,
    seed: int = SEED,
) -> list[Outcome]:
    """Request ``i`` is due at ``start + i / rate`` whatever became of those before it."""
    rng = random.Random(seed)
    # httpx's pool scans every queued request for each one it assigns: thousands queued in it
    # cost the client more CPU than the router. Requests past MAX_IN_FLIGHT wait here instead,
    # and their latency still counts from their due time.
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=MAX_IN_FLIGHT)

    async def one(outcome: Outcome, prompt: list[int]) -> None:
        async with slots:
            await _send(client, outcome, prompt, max_tokens)

    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        outcomes: list[Outcome] = []
        tasks: list[asyncio.Task[None]] = []
        start = time.monotonic()
        for i, prompt in enumerate(prompts):
            due = start + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(i, rng.random() < stream_share, due)
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(one(outcome, prompt)))
        await asyncio.gather(*tasks)
    return outcomes


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts per kind, latency of the completed (from their due time), unclear samples."""
    kinds = {"completed": 0, "rejected": 0, "failed": 0, "unclear": 0}
    for outcome in outcomes:
        kinds[outcome.kind] += 1
    latency = [(o.ended - o.due) * 1e3 for o in outcomes if o.kind == "completed"]
    return {
        "requests": len(outcomes),
        "streaming": sum(o.stream for o in outcomes),
        **kinds,
        "unclear_samples": [o.detail for o in outcomes if o.kind == "unclear"][:5],
        "p50_ms": round(_percentile(latency, 0.5), 2),
        "p99_ms": round(_percentile(latency, 0.99), 2),
        "max_ms": round(max(latency, default=0.0), 2),
    }


def _statuses(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """How many requests got each HTTP status ("none": no answer at all)."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        key = "none" if outcome.status is None else str(outcome.status)
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _metric(router_url: str, name: str) -> float:
    for line in httpx.get(f"{router_url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


# -- kill -9 of a worker under load ------------------------------------------------------------


def kill_worker_under_load(
    *,
    num_workers: int = 3,
    num_requests: int = 300,
    rate: float = 50.0,
    kill_at: float = 0.4,
    heartbeat_ttl_s: float = 2.0,
    stream_share: float = 0.5,
    max_tokens: int = 32,
    step_ms: float = 5.0,
) -> dict[str, Any]:
    """See the module docstring. ``kill_at``: the fraction of the run after which to kill."""
    victim = "w0"
    prompts = make_prompts(num_requests, SEED)
    with (
        EmbeddedRedis() as server,
        tempfile.TemporaryFile() as log,
        cluster(
            server.url, num_workers, log, heartbeat_ttl_s=heartbeat_ttl_s, step_ms=step_ms
        ) as c,
    ):
        assert c.router is not None
        marks: dict[str, float] = {}
        errors: list[BaseException] = []

        def inject() -> None:
            try:
                kill_and_watch()
            except BaseException as exc:  # re-raised in the main thread
                errors.append(exc)

        def kill_and_watch() -> None:
            time.sleep(num_requests / rate * kill_at)
            blocks_before = index_counts(c.router_url).get(victim, {}).get("blocks", 0)
            marks["blocks_before"] = blocks_before
            c.workers[victim].send_signal(signal.SIGKILL)
            marks["killed"] = time.monotonic()
            c.workers[victim].wait()
            wait_until(lambda: victim not in routable(c.router_url), 30.0, "marked stale")
            marks["stale"] = time.monotonic()
            wait_until(
                lambda: worker_states(c.router_url).get(victim, "gone") == "gone",
                30.0,
                "out of rotation",
            )
            marks["gone"] = time.monotonic()
            wait_until(lambda: victim not in index_counts(c.router_url), 30.0, "out of index")
            marks["unindexed"] = time.monotonic()

        injector = threading.Thread(target=inject, name="kvmesh-kill")
        injector.start()
        outcomes = asyncio.run(
            drive(
                c.router_url,
                prompts,
                rate=rate,
                stream_share=stream_share,
                max_tokens=max_tokens,
            )
        )
        injector.join()
        if errors:
            raise errors[0]
        retries = _metric(c.router_url, "kvmesh_router_retries_total")
        survivors = set(c.workers) - {victim}
        left = routable(c.router_url)
    killed = marks["killed"]
    in_flight = [o for o in outcomes if o.due < killed < o.ended]
    after = [o for o in outcomes if o.due > marks["gone"]]
    return {
        "workers": num_workers,
        "rate": rate,
        "heartbeat_ttl_s": heartbeat_ttl_s,
        "victim_blocks_before": int(marks["blocks_before"]),
        "stale_after_s": round(marks["stale"] - killed, 3),
        "gone_after_s": round(marks["gone"] - killed, 3),
        "unindexed_after_s": round(marks["unindexed"] - killed, 3),
        "in_flight_at_kill": len(in_flight),
        "in_flight_completed": sum(o.kind == "completed" for o in in_flight),
        "in_flight_failed": sum(o.kind == "failed" for o in in_flight),
        "in_flight_failed_streams": sum(o.kind == "failed" and o.stream for o in in_flight),
        "router_retries": int(retries),
        "sent_to_victim_after_gone": sum(o.worker == victim for o in after),
        "routable_at_end": sorted(left),
        "survivors": sorted(survivors),
        **summarize(outcomes),
    }


# -- Redis killed and restarted (empty) under load ---------------------------------------------


async def _exact(
    observer: RouterRuntime, router_url: str, worker_urls: dict[str, str]
) -> tuple[bool, dict[str, dict[str, int]]]:
    """Observer's index == every worker's tree; the routing router's counts == the trees'."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        trees = {w: await worker_tree(client, url) for w, url in worker_urls.items()}
        counts = (await client.get(f"{router_url}/index/stats")).json()["index"]["per_worker"]
    index = observer.index
    exact = all(
        w in index.workers() and index.worker_blocks(w) == tree for w, tree in trees.items()
    ) and all(counts.get(w) == counts_of(tree) for w, tree in trees.items())
    return exact, {w: counts_of(tree) for w, tree in trees.items()}


def _observer_settings(redis_url: str) -> RouterSettings:
    values: dict[str, Any] = {"sync_interval_s": 0.02, "load_interval_s": 0.05}
    return RouterSettings(redis_url=redis_url, **values)


async def _redis_restart(
    server: EmbeddedRedis,
    c: Cluster,
    prompts: list[list[int]],
    *,
    rate: float,
    restart_at: float,
    outage_s: float,
    stream_share: float,
    max_tokens: int,
) -> dict[str, Any]:
    observer = await RouterRuntime.start(_observer_settings(server.url))
    try:
        workers = set(c.workers)

        async def observer_synced() -> None:
            while any(observer.consumer.last_seq(w) is None for w in workers):
                await asyncio.sleep(POLL_S)

        await asyncio.wait_for(observer_synced(), READY_TIMEOUT_S)
        load = asyncio.create_task(
            drive(
                c.router_url, prompts, rate=rate, stream_share=stream_share, max_tokens=max_tokens
            )
        )
        await asyncio.sleep(len(prompts) / rate * restart_at)
        killed = time.monotonic()
        server.kill()  # a crash, no persistence: streams, snapshots, registry, heartbeats gone
        await asyncio.sleep(outage_s)
        await asyncio.to_thread(server.start)
        restarted = time.monotonic()
        # Each worker's first /ready once Redis answers again: 200, not a dead pooled connection.
        async with httpx.AsyncClient(timeout=5.0) as client:
            ready_after_restart = {
                w: (await client.get(f"{url}/ready")).status_code
                for w, url in sorted(c.worker_urls.items())
            }

        async def recovered() -> None:
            async with httpx.AsyncClient(base_url=c.router_url, timeout=2.0) as client:
                while True:
                    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                        ready = (await client.get("/ready")).status_code == 200
                        states = (await client.get("/workers")).json()["workers"]
                        up = {w["worker"] for w in states if w["state"] == "up" and w["synced"]}
                        synced = all(observer.consumer.last_seq(w) is not None for w in workers)
                        if ready and up == workers and synced:
                            return
                    await asyncio.sleep(POLL_S)

        await asyncio.wait_for(recovered(), SETTLE_TIMEOUT_S)
        recovered_at = time.monotonic()
        outcomes = await load
        load_end = time.monotonic()
        exact = False
        counts: dict[str, dict[str, int]] = {}
        while time.monotonic() - load_end < SETTLE_TIMEOUT_S:
            exact, counts = await _exact(observer, c.router_url, c.worker_urls)
            if exact:
                break
            await asyncio.sleep(0.1)
        settled = time.monotonic()
        observer_stats = observer.consumer.stats()
    finally:
        await observer.aclose()
    async with httpx.AsyncClient(timeout=5.0) as client:
        publisher = {
            w: (await client.get(f"{url}/stats")).json()["events"]
            for w, url in c.worker_urls.items()
        }
        router_stats = (await client.get(f"{c.router_url}/index/stats")).json()["consumer"]
    outage = [o for o in outcomes if o.due < recovered_at and o.ended > killed]
    return {
        "outage_s": round(restarted - killed, 3),
        "recovered_s": round(recovered_at - restarted, 3),
        "settled_after_load_s": round(settled - load_end, 3),
        "index_exact": exact,
        "blocks": counts,
        "outage_requests": len(outage),
        "outage_completed": sum(o.kind == "completed" for o in outage),
        "outage_rejected": sum(o.kind == "rejected" for o in outage),
        "outage_failed": sum(o.kind == "failed" for o in outage),
        "statuses": _statuses(outcomes),
        "worker_ready_after_restart": ready_after_restart,
        "publisher_dropped": sum(p["dropped"] for p in publisher.values()),
        "publisher_errors": sum(p["errors"] for p in publisher.values()),
        "publisher_snapshots": sum(p["snapshots"] for p in publisher.values()),
        "observer_redis_restarts": observer_stats["redis_restarts"],
        "observer_resyncs": observer_stats["resyncs"],
        "observer_resync_reasons": observer_stats["resync_reasons"],
        "observer_malformed": observer_stats["malformed"],
        "router_redis_restarts": router_stats["redis_restarts"],
        "router_resyncs": router_stats["resyncs"],
        **summarize(outcomes),
    }


def redis_restart_under_load(
    *,
    num_workers: int = 3,
    num_requests: int = 300,
    rate: float = 50.0,
    restart_at: float = 0.3,
    outage_s: float = 0.5,
    stream_share: float = 0.25,
    max_tokens: int = 8,
    heartbeat_ttl_s: float = 2.0,
) -> dict[str, Any]:
    """See the module docstring. ``restart_at``: fraction of the run before the kill."""
    prompts = make_prompts(num_requests, SEED + 1)
    with (
        EmbeddedRedis() as server,
        tempfile.TemporaryFile() as log,
        cluster(server.url, num_workers, log, heartbeat_ttl_s=heartbeat_ttl_s) as c,
    ):
        result = asyncio.run(
            _redis_restart(
                server,
                c,
                prompts,
                rate=rate,
                restart_at=restart_at,
                outage_s=outage_s,
                stream_share=stream_share,
                max_tokens=max_tokens,
            )
        )
    return {"workers": num_workers, "rate": rate, "heartbeat_ttl_s": heartbeat_ttl_s, **result}


# -- synthetic stored blocks (router restart, publisher cut off) -------------------------------


def synthetic_events(worker_index: int, num_blocks: int) -> list[KVCacheEvent]:
    """``num_blocks`` stored blocks in chains of ``CHAIN_BLOCKS`` from the root, one event per
    chain, every fourth chain on the host tier; seeded by the worker's index."""
    rng = np.random.default_rng(SEED * 1_000 + worker_index)
    hashes: list[int] = rng.integers(0, 2**63, size=num_blocks, dtype=np.int64).tolist()
    events: list[KVCacheEvent] = []
    for k, start in enumerate(range(0, num_blocks, CHAIN_BLOCKS)):
        level = 1 if k % 4 == 3 else 0
        chain = hashes[start : start + CHAIN_BLOCKS]
        blocks = [StoredBlock(h, (), cache_level=level) for h in chain]
        events.append(KVCacheEvent(len(events), StoredData(None, blocks), 4_096))
    return events


def synthetic_tree(worker_index: int, num_blocks: int) -> dict[int, int]:
    """What ``synthetic_events`` stores: hash -> tier."""
    rng = np.random.default_rng(SEED * 1_000 + worker_index)
    hashes: list[int] = rng.integers(0, 2**63, size=num_blocks, dtype=np.int64).tolist()
    return {h: 1 if (i // CHAIN_BLOCKS) % 4 == 3 else 0 for i, h in enumerate(hashes)}


def _snapshot_of(published: list[KVCacheEvent]) -> Any:
    # What the worker holds is what it published (stored blocks only, nothing evicted).
    def take() -> Snapshot:
        return Snapshot(list(published), published[-1].event_id if published else -1)

    return take


def _publisher_main(
    redis_url: str,
    num_workers: int,
    num_blocks: int,
    ready: EventType,
    snapshot: EventType,
    snapshotted: EventType,
    stop: EventType,
) -> None:
    """Child process: publish every worker's blocks, heartbeat; snapshot when asked; stop."""
    parent_pid = os.getppid()

    async def main() -> None:
        published: dict[str, list[KVCacheEvent]] = {f"w{i}": [] for i in range(num_workers)}
        publishers = [
            EventPublisher(
                redis_url,
                worker,
                snapshot_source=_snapshot_of(mine),
                registry_entry={
                    "url": f"http://{worker}.invalid:8000",
                    "tokens_per_block": TOKENS_PER_BLOCK,
                    "capacity": [2 * num_blocks, 0],
                },
                load_source=lambda: {"active_sequences": 0, "waiting_requests": 0},
            )
            for worker, mine in published.items()
        ]

        def wait(event: EventType) -> bool:
            while not event.wait(0.5):
                if stop.is_set() or os.getppid() != parent_pid:
                    return False
            return True

        try:
            for i, publisher in enumerate(publishers):
                await publisher.start()
                mine = published[publisher.worker_id]
                for event in synthetic_events(i, num_blocks):
                    mine.append(event)
                    publisher.publish([event])
                await asyncio.sleep(0)
            await asyncio.gather(*(p.flush(READY_TIMEOUT_S) for p in publishers))
            ready.set()
            if await asyncio.to_thread(wait, snapshot):
                for publisher in publishers:
                    publisher.request_snapshot()
                await asyncio.gather(*(p.flush(READY_TIMEOUT_S) for p in publishers))
                snapshotted.set()
                await asyncio.to_thread(wait, stop)
        finally:
            await asyncio.gather(*(p.aclose() for p in publishers), return_exceptions=True)

    asyncio.run(main())


@contextlib.contextmanager
def _router_ready_with(
    redis_url: str, log: IO[bytes], expected: dict[str, dict[str, int]]
) -> Iterator[tuple[subprocess.Popen[bytes], str, float]]:
    """``kvmesh router``; yields once it is ready with every worker's blocks per tier, with
    its URL and the seconds that took from the process' start."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    flags = ["router", "--host", HOST, "--port", str(port), "--redis-url", redis_url]
    start = time.monotonic()
    with kvmesh_process(flags, log) as proc:
        wait_ready(url, proc, log)
        wait_until(lambda: index_counts(url) == expected, READY_TIMEOUT_S, "router index")
        yield proc, url, time.monotonic() - start


def _wait_event(event: EventType, proc: multiprocessing.process.BaseProcess, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not event.wait(0.1):
        if not proc.is_alive():
            raise RuntimeError(f"{what}: the publishers' process exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done within {READY_TIMEOUT_S} s")


def _consumer_figures(router_url: str) -> dict[str, int]:
    consumer = httpx.get(f"{router_url}/index/stats", timeout=10.0).json()["consumer"]
    return {k: consumer[k] for k in ("snapshot_loads", "entries", "skipped_entries", "resyncs")}


async def _observer_exact(redis_url: str, trees: dict[str, dict[int, int]]) -> dict[str, Any]:
    start = time.monotonic()
    observer = await RouterRuntime.start(_observer_settings(redis_url))
    try:
        while not (
            observer.readiness()["ready"]
            and all(observer.consumer.last_seq(w) is not None for w in trees)
        ):
            if time.monotonic() - start > READY_TIMEOUT_S:
                raise TimeoutError(f"the observer was not ready: {observer.readiness()}")
            await asyncio.sleep(POLL_S)
        ready_s = time.monotonic() - start
        index = observer.index
        exact = all(index.worker_blocks(w) == tree for w, tree in trees.items())
        return {"observer_ready_s": round(ready_s, 3), "index_exact": exact}
    finally:
        await observer.aclose()


def router_restart(*, num_workers: int = 8, num_blocks: int = 100_000) -> dict[str, Any]:
    """See the module docstring."""
    trees = {f"w{i}": synthetic_tree(i, num_blocks) for i in range(num_workers)}
    expected = {w: counts_of(tree) for w, tree in trees.items()}
    context = multiprocessing.get_context("spawn")
    ready, snapshot, snapshotted, stop = (context.Event() for _ in range(4))
    with EmbeddedRedis() as server, tempfile.TemporaryFile() as log:
        child = context.Process(
            target=_publisher_main,
            args=(server.url, num_workers, num_blocks, ready, snapshot, snapshotted, stop),
            name="kvmesh-bench-publishers",
            daemon=True,
        )
        publish_start = time.monotonic()
        child.start()
        try:
            _wait_event(ready, child, "publishing")
            publish_s = time.monotonic() - publish_start
            with _router_ready_with(server.url, log, expected) as (proc, url, cold_s):
                cold = _consumer_figures(url)
                snapshot.set()
                _wait_event(snapshotted, child, "the snapshots")
                proc.send_signal(signal.SIGKILL)  # a crash: nothing flushed, nothing said
                proc.wait()
            with _router_ready_with(server.url, log, expected) as (proc, url, restart_s):
                restart = _consumer_figures(url)
                router_rss_mib = round((rss_kib(proc.pid) or 0) / 1024, 1)
            observer = asyncio.run(_observer_exact(server.url, trees))
        finally:
            stop.set()
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()
    return {
        "workers": num_workers,
        "blocks_per_worker": num_blocks,
        "entries": sum(len(t) for t in trees.values()),
        "publish_s": round(publish_s, 2),
        "cold_start_ready_s": round(cold_s, 3),
        "cold_start_consumer": cold,
        "restart_ready_s": round(restart_s, 3),
        "restart_consumer": restart,
        "router_rss_mib": router_rss_mib,
        **observer,
    }


# -- a publisher cut off from Redis until its buffer overflows ---------------------------------


async def _cut_off(url: str, num_blocks: int, buffer_blocks: int, cut_at: float) -> dict[str, Any]:
    admin: Any = aioredis.Redis.from_url(url)
    user, password = "kvmesh-cut-off", "cut-off-secret"
    await admin.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
    cut_url = url.replace("redis://", f"redis://{user}:{password}@")
    events = {w: synthetic_events(i, num_blocks) for i, w in enumerate(("w0", "w1"))}
    published: dict[str, list[KVCacheEvent]] = {"w0": [], "w1": []}
    options: dict[str, Any] = {"linger_s": 0, "heartbeat_ttl_s": 30.0}
    cut = EventPublisher(
        cut_url,
        "w0",
        PublisherConfig(max_buffer_blocks=buffer_blocks, **options),
        snapshot_source=_snapshot_of(published["w0"]),
        registry_entry={"url": "http://w0.invalid:8000", "tokens_per_block": TOKENS_PER_BLOCK},
    )
    honest = EventPublisher(
        url,
        "w1",
        PublisherConfig(**options),
        snapshot_source=_snapshot_of(published["w1"]),
        registry_entry={"url": "http://w1.invalid:8000", "tokens_per_block": TOKENS_PER_BLOCK},
    )
    split = int(len(events["w0"]) * cut_at)

    async def feed(publisher: EventPublisher, chosen: list[KVCacheEvent]) -> None:
        for event in chosen:
            published[publisher.worker_id].append(event)
            publisher.publish([event])
            await asyncio.sleep(0.001)

    observer = await RouterRuntime.start(_observer_settings(url))
    try:
        async with cut, honest:
            for publisher in (cut, honest):
                await feed(publisher, events[publisher.worker_id][:split])
                await publisher.flush(READY_TIMEOUT_S)
            wait_s = 0.0
            while observer.consumer.last_seq("w0") != split - 1 or (
                observer.consumer.last_seq("w1") != split - 1
            ):
                await asyncio.sleep(POLL_S)
                wait_s += POLL_S
                if wait_s > READY_TIMEOUT_S:
                    raise TimeoutError("the observer did not catch up before the cut")
            await admin.execute_command("ACL", "SETUSER", user, "off")
            await admin.execute_command("CLIENT", "KILL", "USER", user)
            cut_at_s = time.monotonic()
            await asyncio.gather(
                feed(cut, events["w0"][split:]), feed(honest, events["w1"][split:])
            )
            dropped = cut.num_dropped
            await admin.execute_command("ACL", "SETUSER", user, "on")
            reconnected = time.monotonic()
            trees = {w: synthetic_tree(i, num_blocks) for i, w in enumerate(("w0", "w1"))}
            index = observer.index
            while not all(
                observer.consumer.last_seq(w) == len(events[w]) - 1
                and index.worker_blocks(w) == tree
                for w, tree in trees.items()
            ):
                if time.monotonic() - reconnected > SETTLE_TIMEOUT_S:
                    break
                await asyncio.sleep(POLL_S)
            recovered = time.monotonic()
            exact = {w: index.worker_blocks(w) == tree for w, tree in trees.items()}
            stats = observer.consumer.stats()
            entries = await admin.xrange(keys.events_key("w0"))
            cut_stats = cut.stats()
    finally:
        await observer.aclose()
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()
    envelopes: list[Envelope] = [decode_envelope(fields) for _, fields in entries]
    return {
        "blocks_per_worker": num_blocks,
        "buffer_blocks": buffer_blocks,
        "cut_off_s": round(reconnected - cut_at_s, 3),
        "dropped_events": dropped,
        "dropped_in_stream": sum(e.dropped for e in envelopes),
        "publisher_snapshots": cut_stats["snapshots"],
        "resync_reasons": stats["resync_reasons"],
        "malformed": stats["malformed"],
        "expired": stats["expired"],
        "recovered_s": round(recovered - reconnected, 3),
        "index_exact": exact,
    }


def publisher_cut_off(
    *, num_blocks: int = 4_096, buffer_blocks: int = 512, cut_at: float = 0.5
) -> dict[str, Any]:
    """See the module docstring. ``cut_at``: the share of the blocks published before."""
    with EmbeddedRedis() as server:
        return asyncio.run(_cut_off(server.url, num_blocks, buffer_blocks, cut_at))


# -- load: R requests through a router to 4 workers --------------------------------------------


def load(
    *,
    num_workers: int = 4,
    num_requests: int = 5_000,
    rate: float = 100.0,
    stream_share: float = 0.2,
    max_tokens: int = 16,
) -> dict[str, Any]:
    """See the module docstring."""
    prompts = make_prompts(num_requests, SEED + 2, num_documents=64)
    with (
        EmbeddedRedis() as server,
        tempfile.TemporaryFile() as log,
        cluster(server.url, num_workers, log, num_gpu_blocks=1_024, num_host_blocks=256) as c,
    ):
        pids = {**c.pids(), "redis": server.pid, "client": os.getpid()}
        with RssSampler(pids) as rss:
            start = time.monotonic()
            outcomes = asyncio.run(
                drive(
                    c.router_url,
                    prompts,
                    rate=rate,
                    stream_share=stream_share,
                    max_tokens=max_tokens,
                )
            )
            seconds = time.monotonic() - start
        retries = _metric(c.router_url, "kvmesh_router_retries_total")
    summary = summarize(outcomes)
    return {
        "workers": num_workers,
        "offered_rate": rate,
        "achieved_rate": round(len(outcomes) / seconds, 1),
        "stream_share": stream_share,
        "max_tokens": max_tokens,
        **summary,
        "router_retries": int(retries),
        "rss_first_mib": rss.first_mib(),
        "rss_max_mib": rss.max_mib(),
        "rss_samples": rss.num_samples,
    }


# -- 8 publishers at full speed into one consumer ----------------------------------------------


def _consumer_main(
    url: str, expected: dict[str, int], trees: dict[str, dict[int, int]], conn: Connection
) -> None:
    conn.send(asyncio.run(_consume(url, expected, trees, conn)))
    conn.close()


async def _consume(
    url: str, expected: dict[str, int], trees: dict[str, dict[int, int]], conn: Connection
) -> dict[str, Any]:
    lag_ms: list[float] = []
    done = asyncio.Event()
    remaining = set(expected)
    pid = os.getpid()
    rss = {"first": rss_kib(pid) or 0, "max": 0}

    def on_entry(worker_id: str, envelope: Envelope, events: Any, blocks: int) -> None:
        if envelope.ts_us:
            lag_ms.append(time.time() * 1e3 - envelope.ts_us / 1e3)
        if envelope.seq_last >= expected.get(worker_id, -2):
            remaining.discard(worker_id)
            if not remaining:
                done.set()

    async def sample() -> None:
        while True:
            rss["max"] = max(rss["max"], rss_kib(pid) or 0)
            await asyncio.sleep(0.05)

    consumer = EventConsumer(url, on_entry=on_entry, registry_interval_s=0.1)
    sampler = asyncio.create_task(sample())
    try:
        async with consumer:
            while any(consumer.last_seq(w) is None for w in expected):
                await asyncio.sleep(0.005)
            rss["ready"] = rss_kib(pid) or 0
            conn.send("ready")
            start = time.monotonic()
            await asyncio.wait_for(done.wait(), READY_TIMEOUT_S * 2)
            seconds = time.monotonic() - start
            exact = all(consumer.index.worker_blocks(w) == trees[w] for w in expected)
            stats = consumer.stats()
    finally:
        sampler.cancel()
    return {"lag_ms": lag_ms, "rss": rss, "exact": exact, "stats": stats, "seconds": seconds}


async def _publish_all(url: str, recordings: list[Recording], conn: Connection) -> dict[str, Any]:
    publishers = [EventPublisher(url, rec.worker_id) for rec in recordings]
    for publisher in publishers:
        await publisher.start()
    while not conn.poll():
        await asyncio.sleep(0.005)
    if conn.recv() != "ready":
        raise RuntimeError("unexpected message from the consumer process")

    async def feed(publisher: EventPublisher, rec: Recording) -> None:
        for batch in rec.batches:
            publisher.publish(batch)
            await asyncio.sleep(0)

    start = time.monotonic()
    await asyncio.gather(*(feed(p, r) for p, r in zip(publishers, recordings, strict=True)))
    await asyncio.gather(*(p.flush(READY_TIMEOUT_S) for p in publishers))
    publish_s = time.monotonic() - start
    while not conn.poll():
        await asyncio.sleep(0.01)
    result: dict[str, Any] = conn.recv()
    result["publish_s"] = publish_s
    result["dropped"] = sum(p.num_dropped for p in publishers)
    for publisher in publishers:
        await publisher.aclose()
    return result


def publishers_into_consumer(
    *, num_publishers: int = 8, requests_per_worker: int = 150
) -> dict[str, Any]:
    """See the module docstring."""
    generate_start = time.monotonic()
    recordings = [
        record(f"p{i}", SEED + i, num_requests=requests_per_worker) for i in range(num_publishers)
    ]
    generate_s = time.monotonic() - generate_start
    expected = {rec.worker_id: rec.last_seq for rec in recordings}
    trees = {rec.worker_id: rec.tree for rec in recordings}
    context = multiprocessing.get_context("spawn")  # the consumer's RSS is its own, not ours
    with EmbeddedRedis() as server:
        parent_conn, child_conn = context.Pipe()
        child = context.Process(
            target=_consumer_main,
            args=(server.url, expected, trees, child_conn),
            name="kvmesh-bench-consumer",
            daemon=True,
        )
        child.start()
        try:
            gc.collect()
            result = asyncio.run(_publish_all(server.url, recordings, parent_conn))
        finally:
            child.join(30)
            if child.is_alive():
                child.kill()
                child.join()
    lag = result["lag_ms"]
    stats = result["stats"]
    block_events = sum(rec.block_events for rec in recordings)
    return {
        "publishers": num_publishers,
        "block_events": block_events,
        "events": sum(len(b) for rec in recordings for b in rec.batches),
        "entries": stats["entries"],
        "generate_s": round(generate_s, 2),
        "publish_s": round(result["publish_s"], 3),
        "consume_s": round(result["seconds"], 3),
        "block_events_per_s": round(block_events / result["seconds"]),
        "lag_p50_ms": round(statistics.median(lag), 2) if lag else 0.0,
        "lag_p99_ms": round(_percentile(lag, 0.99), 2),
        "lag_max_ms": round(max(lag, default=0.0), 2),
        "consumer_rss_first_mib": round(result["rss"]["first"] / 1024, 1),
        "consumer_rss_ready_mib": round(result["rss"]["ready"] / 1024, 1),
        "consumer_rss_max_mib": round(result["rss"]["max"] / 1024, 1),
        "dropped": result["dropped"],
        "resyncs": stats["resyncs"],
        "malformed": stats["malformed"],
        "yields": stats["yields"],
        "index_exact": result["exact"],
    }


# -- the whole run -----------------------------------------------------------------------------

FULL: dict[str, dict[str, Any]] = {
    "kill_worker": {"num_workers": 4, "num_requests": 1_000, "rate": 50.0},
    "redis_restart": {"num_workers": 4, "num_requests": 1_000, "rate": 50.0, "outage_s": 1.0},
    "router_restart": {"num_workers": 8, "num_blocks": 100_000},
    "publisher_cut_off": {"num_blocks": 20_000, "buffer_blocks": 1_024},
    "load": {"num_requests": 5_000, "rate": 100.0},
    "publishers": {"num_publishers": 8, "requests_per_worker": 150},
}
QUICK: dict[str, dict[str, Any]] = {
    "kill_worker": {"num_workers": 3, "num_requests": 100, "rate": 50.0},
    "redis_restart": {"num_workers": 3, "num_requests": 100, "rate": 50.0},
    "router_restart": {"num_workers": 4, "num_blocks": 2_000},
    "publisher_cut_off": {"num_blocks": 2_048, "buffer_blocks": 256},
    "load": {"num_requests": 200, "rate": 100.0},
    "publishers": {"num_publishers": 8, "requests_per_worker": 10},
}
SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "kill_worker": kill_worker_under_load,
    "redis_restart": redis_restart_under_load,
    "router_restart": router_restart,
    "publisher_cut_off": publisher_cut_off,
    "load": load,
    "publishers": publishers_into_consumer,
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = QUICK if getattr(args, "quick", False) else FULL
    out: dict[str, Any] = {"cpus": os.cpu_count()}
    httpx_logger = logging.getLogger("httpx")
    httpx_level = httpx_logger.level
    httpx_logger.setLevel(logging.WARNING)  # not a log line per request and per poll
    try:
        for name, scenario in SCENARIOS.items():
            start = time.monotonic()
            out[name] = scenario(**sizes[name])
            out[name]["scenario_s"] = round(time.monotonic() - start, 1)
    finally:
        httpx_logger.setLevel(httpx_level)
    return out
