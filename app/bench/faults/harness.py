"""The faults benches' harness: constants, processes and their memory (RSS), a cluster of
``kvmesh`` processes on a private Redis, waiting, and what the router and the workers report."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from app.bench.worker import kvmesh_process
from app.core.net import free_port

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


def log_tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read()[-4_000:].decode(errors="replace")


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: IO[bytes]) -> float:
    """Poll ``url/ready`` until 200; the seconds it took (RuntimeError if it exits or stalls)."""
    start = time.monotonic()
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() - start < READY_TIMEOUT_S:
            if proc.poll() is not None:
                raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/ready").status_code == 200:
                    return time.monotonic() - start
            time.sleep(POLL_S)
    raise RuntimeError(f"{url} was not ready within {READY_TIMEOUT_S} s:\n{log_tail(log)}")


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
