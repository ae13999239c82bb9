"""Two kvmesh trees' routers compared interleaved: the "B/A" figures of ``docs/benchmarks.md``.

``python tools/ab.py A_TREE B_TREE [--path completions|route] [--rounds 6] [--requests 2000]``

Plain pairs of ``kvmesh bench proxy`` or ``kvmesh bench router`` runs cannot see a few per
cent on a small shared host: its neighbours move a run by more than that. Here both routers run
at once and take turns, so both see the same host, second by second:

* one private Redis (``EmbeddedRedis``), and what the requests need, from the checkout this
  Python's kvmesh is installed from: for ``--path completions`` (the default) one ``kvmesh
  worker`` with the sim back-end at zero model time and ``kvmesh bench proxy``'s options; for
  ``--path route`` ``kvmesh bench router``'s fleet (16 publishers, ``--events`` events);
* every round, a fresh router from each tree (``python -m app router`` run in the tree, so its
  ``app/`` and ``cache/`` are imported, with ``--no-share-decisions``: the two are not replicas
  of one router), both ready (for ``route``: caught up with the whole index) before anything is
  timed;
* ``--requests`` requests, one at a time, request *i* to one router and *i + 1* to the other,
  on one keep-alive connection each; every other round starts with B instead of A. For
  ``completions``: non-streamed ``/v1/completions`` of 4,096 token ids (``max_tokens`` 1, the
  proxy bench's 64 prompts, all cached in the worker first); for ``route``: ``POST /route``
  with the router bench's 4,096-token prompts;
* each router's CPU over the round (its processes' CPU clocks, in nanoseconds; else ``/proc``'s
  10 ms ticks), per request it answered; the round's ratio B/A. Reported: every
  round, and the mean ratio with its 95 % t-interval over the rounds.

Each router's CPU includes its background work (its load reads; for ``completions`` the
worker's KV events of both routers' requests): only the ratio means anything, not either figure
alone.

A tree is a kvmesh checkout whose ``cache/`` holds a compiled build of its own sources for this
Python; a tree without one runs its plain sources, and measures those (said on stderr, and as
``a_compiled``/``b_compiled``). Build one with this checkout's Python, not with ``make`` there
(which would make the tree a virtual environment of its own). For the commit before the last
one, from this checkout's root::

    git worktree add /tmp/before HEAD~1
    (cd /tmp/before && "$OLDPWD/.venv/bin/python" tools/build_native.py)
    .venv/bin/python tools/ab.py /tmp/before .
    git worktree remove --force /tmp/before  # --force: the build is untracked

The Python running this script runs both trees, with its installed dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import orjson
import uvloop

from app.bench.fleet import publishers, worker_loads
from app.bench.http_client import KeepAliveConnection
from app.bench.index import build_streaming, generate
from app.bench.procfs import tree_cpu_seconds, tree_run_seconds
from app.bench.proxy import HOST, NUM_PROMPTS, PROXY_WORKER_OPTIONS, _wait_ready, make_bodies
from app.bench.router import NUM_EVENTS, _wait_caught_up
from app.bench.router import NUM_REQUESTS as NUM_ROUTE_PROMPTS
from app.bench.worker import kvmesh_process, worker_flags
from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port
from cache._native import built

__all__ = ["Round", "main", "measure", "summarize"]

NUM_WARMUP = 100  # requests to each router before a round is timed (after priming, if any)
WORKER_ID = "ab-worker"
# Student's t at 97.5 % for 1..30 degrees of freedom; beyond, the normal's 1.96 (2 % short at 31).
_T975 = (
    *(12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228),
    *(2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086),
    *(2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042),
)


@dataclass(slots=True)
class Round:
    """One round: who went first, and each router's requests and CPU µs per request."""

    b_first: bool
    a_requests: int
    b_requests: int
    a_cpu_us: float
    b_cpu_us: float

    @property
    def ratio(self) -> float:
        return self.b_cpu_us / self.a_cpu_us


def summarize(rounds: Sequence[Round]) -> dict[str, Any]:
    """The rounds, and the mean B/A ratio with its 95 % t-interval (none for one round)."""
    ratios = [r.ratio for r in rounds]
    mean = statistics.fmean(ratios)
    out: dict[str, Any] = {
        "rounds": [{**asdict(r), "ratio": round(r.ratio, 4)} for r in rounds],
        "ratio_mean": round(mean, 4),
        "b_lower_in": sum(ratio < 1 for ratio in ratios),
    }
    if len(ratios) > 1:
        df = len(ratios) - 1
        half = (_T975[df - 1] if df <= len(_T975) else 1.96) * statistics.stdev(ratios)
        half /= len(ratios) ** 0.5
        out["ratio_interval"] = [round(mean - half, 4), round(mean + half, 4)]
    return out


# -- what a comparison runs against ---------------------------------------------------------------


@dataclass(slots=True)
class _Setup:
    """Besides the two routers: the bodies, where they go, when a router is ready, what a
    good answer is, and whether the bodies go once through A first (to cache them)."""

    redis_url: str
    path: str
    bodies: list[bytes]
    ready: Callable[[str, subprocess.Popen[bytes], IO[bytes]], object]
    fault: Callable[[dict[str, Any]], str | None]  # what is wrong with an answer, if anything
    prime: bool


@contextlib.contextmanager
def _completions(redis_url: str, log: IO[bytes]) -> Iterator[_Setup]:
    """One sim worker; non-streamed completions of the proxy bench's prompts."""
    options = {**PROXY_WORKER_OPTIONS, "worker_id": WORKER_ID, "host": HOST}
    options |= {"port": free_port(), "redis_url": redis_url}
    with kvmesh_process(["worker", *worker_flags(options)], log) as worker:
        _wait_ready(f"http://{HOST}:{options['port']}", {"worker": worker}, log)

        def ready(url: str, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
            _wait_ready(url, {"router": proc}, log, up=WORKER_ID)

        def fault(answer: dict[str, Any]) -> str | None:
            worker_id = answer["kvmesh"]["worker_id"]
            return None if worker_id == WORKER_ID else f"answered by {worker_id!r}"

        bodies = make_bodies(NUM_PROMPTS)
        yield _Setup(redis_url, "/v1/completions", bodies, ready, fault, prime=True)


@contextlib.contextmanager
def _route(redis_url: str, num_events: int) -> Iterator[_Setup]:
    """``kvmesh bench router``'s fleet (16 publishers, ``num_events`` events) and prompts."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # as the bench: a clean heap
        stream, _, prompts = pool.apply(generate, (num_events, NUM_ROUTE_PROMPTS))
    stats = build_streaming(stream)[0].stats()
    expected = {key: stats[key] for key in ("workers", "blocks", "entries")}
    loads = worker_loads()
    with publishers(redis_url, stream, loads):

        def ready(url: str, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
            _wait_caught_up(url, proc, log, expected)

        def fault(answer: dict[str, Any]) -> str | None:
            return None if answer.get("worker") in loads else f"chose {answer.get('worker')!r}"

        bodies = [orjson.dumps({"prompt_token_ids": tokens}) for tokens in prompts.tolist()]
        yield _Setup(redis_url, "/route", bodies, ready, fault, prime=False)


# -- one round -----------------------------------------------------------------------------------


async def _interleave(
    setup: _Setup, ports: dict[str, int], pids: dict[str, int], requests: int, b_first: bool
) -> Round:
    order = ("b", "a") if b_first else ("a", "b")
    bodies = setup.bodies
    clients = {side: KeepAliveConnection(HOST, ports[side], setup.path) for side in order}
    try:
        for body in bodies if setup.prime else ():  # every prompt cached in the worker
            await clients["a"].post(body)
        for i in range(NUM_WARMUP):
            for side in order:
                await clients[side].post(bodies[i % len(bodies)])
        # One clock per router, read the same way before and after.
        clocks = {side: _cpu_clock(pids[side]) for side in order}
        before = {side: clocks[side]() for side in order}
        counts = dict.fromkeys(order, 0)
        for i in range(requests):
            side = order[i % 2]
            fault = setup.fault(await clients[side].post(bodies[i % len(bodies)]))
            if fault is not None:
                raise RuntimeError(f"router {side.upper()} {fault}")
            counts[side] += 1
        cpu = {side: clocks[side]() - before[side] for side in order}
    finally:
        for client in clients.values():
            await client.aclose()
    if cpu["a"] <= 0 or cpu["b"] <= 0:  # possible in ticks (10 ms each), without a CPU clock
        raise RuntimeError(f"a router used no CPU that /proc could see over {requests} requests")
    return Round(
        b_first=b_first,
        a_requests=counts["a"],
        b_requests=counts["b"],
        a_cpu_us=round(cpu["a"] / counts["a"] * 1e6, 1),
        b_cpu_us=round(cpu["b"] / counts["b"] * 1e6, 1),
    )


def _cpu_clock(pid: int) -> Callable[[], float]:
    """A router's CPU so far: to the nanosecond by its processes' CPU clocks, else (no such
    clock) in 10 ms ticks, a few in a round of 200 requests."""
    if tree_run_seconds(pid) is not None:
        return lambda: tree_run_seconds(pid) or 0.0
    return lambda: tree_cpu_seconds(pid) or 0.0


def _router_args(redis_url: str, port: int) -> list[str]:
    # not replicas of one router: neither publishes its flights to the other
    flags = ["--host", HOST, "--port", str(port), "--redis-url", redis_url]
    return ["router", *flags, "--no-share-decisions"]


def _rounds(
    setup: _Setup, trees: dict[str, Path], rounds: int, requests: int, log: IO[bytes]
) -> Iterator[Round]:
    """Each round: both routers started and ready, the interleaved requests, both stopped."""
    for n in range(rounds):
        ports = {side: free_port() for side in trees}
        with contextlib.ExitStack() as stack:
            procs = {
                side: stack.enter_context(
                    kvmesh_process(_router_args(setup.redis_url, ports[side]), log, tree)
                )
                for side, tree in trees.items()
            }
            for side, proc in procs.items():
                setup.ready(f"http://{HOST}:{ports[side]}", proc, log)
            pids = {side: proc.pid for side, proc in procs.items()}
            try:
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    done = runner.run(_interleave(setup, ports, pids, requests, n % 2 == 1))
            except Exception as exc:  # with what the services logged
                log.seek(0)
                tail = log.read()[-4_000:].decode(errors="replace")
                raise RuntimeError(f"round {n + 1} failed: {exc}\n{tail}") from exc
        print(
            f"round {n + 1}/{rounds}: A {done.a_cpu_us:.1f} µs, B {done.b_cpu_us:.1f} µs,"
            f" B/A {done.ratio:.3f}",
            file=sys.stderr,
        )
        yield done


def measure(
    trees: dict[str, Path],
    rounds: int,
    requests: int,
    path: str = "completions",
    num_events: int = NUM_EVENTS,
) -> list[Round]:
    """``rounds`` rounds of ``requests`` requests to ``path`` (``completions`` or ``route``),
    alternating between the two trees' routers."""
    with EmbeddedRedis() as server, tempfile.TemporaryFile() as log:
        made = (
            _completions(server.url, log)
            if path == "completions"
            else _route(server.url, num_events)
        )
        with made as setup:
            return list(_rounds(setup, trees, rounds, requests, log))


def _tree(value: str) -> Path:
    path = Path(value).resolve()
    if not (path / "app" / "__main__.py").is_file():
        raise argparse.ArgumentTypeError(f"{value}: not a kvmesh checkout (no app/__main__.py)")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/ab.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("a", type=_tree, help="the tree measured first (before)")
    parser.add_argument("b", type=_tree, help="the tree compared with it (after)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds (default: 6)")
    parser.add_argument(
        "--requests", type=int, default=2_000, help="requests a round, both routers (2,000)"
    )
    parser.add_argument(
        "--path",
        choices=("completions", "route"),
        default="completions",
        help="proxied /v1/completions to a sim worker, or /route over kvmesh bench router's "
        "fleet (default: completions)",
    )
    parser.add_argument(
        "--events",
        type=int,
        default=NUM_EVENTS,
        help=f"events the fleet publishes, --path route (default: {NUM_EVENTS:,})",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 2 or args.events < 1:
        parser.error("--rounds and --events must be at least 1, --requests at least 2")
    compiled = {side: built(tree / "cache") for side, tree in (("a", args.a), ("b", args.b))}
    for side, tree in (("a", args.a), ("b", args.b)):
        if not compiled[side]:
            print(
                f"tools/ab.py: {tree} has no compiled build of its cache/: it runs the plain"
                " sources",
                file=sys.stderr,
            )
    result = {
        "a": str(args.a),
        "b": str(args.b),
        "a_compiled": compiled["a"],
        "b_compiled": compiled["b"],
        "path": args.path,
        "requests_per_round": args.requests,
        **summarize(
            measure({"a": args.a, "b": args.b}, args.rounds, args.requests, args.path, args.events)
        ),
    }
    if args.json:
        print(json.dumps(result))
    else:
        interval = result.get("ratio_interval")
        shown = f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
        print(
            f"B/A {result['ratio_mean']:.3f}{shown}, "
            f"B lower in {result['b_lower_in']} of {args.rounds} rounds"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
