"""A ``/route``'s stages timed with the caches warm and cold: the tables of ``docs/benchmarks.md``,
"Issue 24, thirteenth pass".

``.venv/bin/python tools/cold_route.py [--requests 1000] [--rounds 2] [--calls]``

In service a router answers one request and then sleeps while the client, Redis and the
publishers run on the same cores: the next request finds its code and data gone from the caches,
and the route's Python costs about twice what it costs in a loop. This runs the route's stages
in one process over ``kvmesh bench router``'s workload (its index and loads, its 4,096-token
bodies), each request timed by stage, in three modes:

* ``hot``: back to back, as a loop or a profiler sees them;
* ``l2``: after writing 4 MiB between requests (four times a core's 1 MiB L2 on the
  development machine);
* ``cold``: after writing 48 MiB (more than its 32 MiB L3).

Flushing by writing leaves dirty lines, so a miss may also pay for a write-back, and leaves
numpy's ``add`` warm. The body is flushed too, which in service arrives hot from the socket:
the scan's cold figure is an upper bound. ``decide`` matches the prompt itself, so the match is
also timed alone, in a pass of its own (after the route's, the rows would be in cache). Each
line: the mode, and each stage's median in µs; ``in all`` is the route's (the match counted
once, in ``decide``).

``--calls``: instead, what one call of each kind costs in the three modes (an empty lambda, a
Python function, numba functions of one and of seven arguments, ``ndarray.sum``), 300 calls each.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import time

import numpy as np
import orjson

from app.bench.fleet import worker_loads
from app.bench.index import build_streaming, generate
from app.bench.router import make_core
from app.core.token_json import parse_token_body

STAGES = ("scan", "hash", "tolist", "match", "decide", "answer")
FLUSH_BYTES = {"hot": 0, "l2": 4 << 20, "cold": 48 << 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1_000, help="timed per mode")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the three modes")
    parser.add_argument("--calls", action="store_true", help="time one call of each kind instead")
    args = parser.parse_args()
    if args.calls:
        _calls(args.rounds)
        return

    # The bench's workload, generated in a child as the bench does (this heap stays clean).
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        stream, _, request_array = pool.apply(generate, (20_000, args.requests))
    index, _ = build_streaming(stream)
    core = make_core(index, worker_loads())
    bodies = [orjson.dumps({"prompt_token_ids": tokens}) for tokens in request_array.tolist()]
    gc.collect()
    gc.freeze()
    junk = np.zeros(max(FLUSH_BYTES.values()), dtype=np.uint8)
    clock = time.perf_counter_ns

    def one(body: bytes, samples: list[list[int]]) -> None:
        t0 = clock()
        parsed = parse_token_body(body)
        assert parsed is not None
        t1 = clock()
        array = core.hash_array(parsed.words)
        t2 = clock()
        hashes = array.tolist()
        t3 = clock()
        decision = core.decide(hashes, len(parsed.words), hash_array=array)
        t4 = clock()
        orjson.dumps({"worker": decision.worker, "costs": decision.costs})
        t5 = clock()
        for stage, start, end in (
            ("scan", t0, t1),
            ("hash", t1, t2),
            ("tolist", t2, t3),
            ("decide", t3, t4),
            ("answer", t4, t5),
        ):
            samples[STAGES.index(stage)].append(end - start)

    parsed_bodies = [parse_token_body(body) for body in bodies]
    arrays = [core.hash_array(parsed.words) for parsed in parsed_bodies if parsed is not None]
    warm: list[list[int]] = [[] for _ in STAGES]
    for body in bodies:  # compiles and warms everything once
        one(body, warm)
    match = STAGES.index("match")
    for _ in range(args.rounds):
        for mode, flush in FLUSH_BYTES.items():
            samples: list[list[int]] = [[] for _ in STAGES]
            flush_view = junk[:flush]
            for body in bodies:
                if flush:
                    flush_view += 1  # written, so that every cache line is evicted
                one(body, samples)
            for array in arrays:
                if flush:
                    flush_view += 1
                start = clock()
                index.find_matches_by_tier(array)
                samples[match].append(clock() - start)
            print(_line(mode, samples), flush=True)


def _calls(rounds: int) -> None:
    import numba

    @numba.njit(nogil=True)
    def one_argument(a):
        return a[0]

    @numba.njit(nogil=True)
    def seven_arguments(rows, meta, h, alive, out, tiers, monotone):
        return rows[0, 0] + meta[0] + h[0] + alive[0] + out[0, 0] + tiers + monotone

    def python(a: np.ndarray) -> int:
        return int(a[0])

    rows = np.zeros((1 << 20, 4), dtype=np.uint64)  # the index's table, as large
    meta, out = np.zeros(8, dtype=np.int64), np.zeros((3, 16), dtype=np.int64)
    hashes, alive = np.zeros(256, dtype=np.uint64), np.zeros(1, dtype=np.uint64)
    calls = {
        "empty lambda": lambda: None,
        "Python function": lambda: python(hashes),
        "numba, 1 argument": lambda: one_argument(hashes),
        "numba, 7 arguments": lambda: seven_arguments(rows, meta, hashes, alive, out, True, False),
        "ndarray.sum": lambda: hashes.sum(),
    }
    junk = np.zeros(max(FLUSH_BYTES.values()), dtype=np.uint8)
    for call in calls.values():
        call()  # compiled
    for _ in range(rounds):
        for name, call in calls.items():
            medians = []
            for flush in FLUSH_BYTES.values():
                flush_view = junk[:flush]
                times = []
                for _ in range(300):
                    if flush:
                        flush_view += 1
                    start = time.perf_counter_ns()
                    call()
                    times.append(time.perf_counter_ns() - start)
                medians.append(f"{float(np.median(times)) / 1e3:.2f}")
            print(
                f"{name:<20} "
                + ", ".join(f"{m} {v}" for m, v in zip(FLUSH_BYTES, medians, strict=True))
            )


def _line(mode: str, samples: list[list[int]]) -> str:
    medians: dict[str, float] = {
        stage: float(np.median(times)) / 1e3 for stage, times in zip(STAGES, samples, strict=True)
    }
    total = sum(v for stage, v in medians.items() if stage != "match")
    parts: list[str] = [f"{stage} {value:.1f}" for stage, value in medians.items()]
    return f"{mode:<5} " + ", ".join(parts) + f"; in all {total:.1f}"


if __name__ == "__main__":
    main()
