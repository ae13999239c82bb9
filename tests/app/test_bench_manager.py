from __future__ import annotations

from app.bench import BENCHMARKS, load_benchmark
from app.bench.manager import (
    MAX_LIVE,
    NUM_REQUESTS_QUICK,
    PREFIX_TOKENS,
    TOKENS_PER_BLOCK,
    TOKENS_PER_REQUEST,
    make_prompts,
    run,
)
from cache._native import built as native_built
from tests.app.bench_cli import run_quick_bench

KEYS = {
    "requests_per_s",
    "blocks_per_s",
    "hit_rate",
    "requests",
    "seconds",
    "event_bytes",
    "hash_impl",
    "cache_impl",
    "us_per_request",
}


def expected_hit_rate(num_requests: int) -> float:
    """What the workload implies if exactly the shared prefixes are reused.

    Blocks are stored for reuse when a request is removed, i.e. when request i + MAX_LIVE
    arrives; so request i reuses its whole prefix when an earlier request with the same prefix
    has been removed by then. (A random suffix token can also, by chance, partially match a
    cached block: rare enough that the test allows for one block or so.)
    """
    prompts = make_prompts(num_requests)
    prefix_blocks = PREFIX_TOKENS // TOKENS_PER_BLOCK
    blocks = TOKENS_PER_REQUEST // TOKENS_PER_BLOCK
    stored: set[tuple[int, ...]] = set()
    reused = 0
    for i, tokens in enumerate(prompts):
        if i >= MAX_LIVE:
            stored.add(tuple(prompts[i - MAX_LIVE][:PREFIX_TOKENS]))
        if tuple(tokens[:PREFIX_TOKENS]) in stored:
            reused += prefix_blocks
    return reused / (num_requests * blocks)


def test_registered() -> None:
    assert BENCHMARKS["manager"] == "app.bench.manager:run"
    assert load_benchmark("manager") is run


def test_prompts_are_the_workload() -> None:
    prompts = make_prompts(50)
    assert len(prompts) == 50
    assert all(len(p) == TOKENS_PER_REQUEST for p in prompts)
    assert all(type(p) is list and type(p[0]) is int for p in prompts)
    assert all(0 <= t < 32_000 for p in prompts for t in p)
    prefixes = {tuple(p[:PREFIX_TOKENS]) for p in prompts}
    assert 1 < len(prefixes) <= 10
    assert make_prompts(50) == prompts  # seeded


def test_quick_run_from_the_command_line() -> None:
    report = run_quick_bench("manager")
    assert report.keys() >= KEYS
    assert report["requests"] == NUM_REQUESTS_QUICK
    assert report["hash_impl"] in ("numba", "python")
    # the mypyc build whenever it matches the sources (make test builds it first)
    assert report["cache_impl"] == ("mypyc" if native_built() else "python")
    for key in ("requests_per_s", "blocks_per_s", "seconds", "us_per_request"):
        assert isinstance(report[key], int | float) and report[key] > 0, key
    assert isinstance(report["event_bytes"], int) and report["event_bytes"] > 0
    blocks_per_request = TOKENS_PER_REQUEST // TOKENS_PER_BLOCK
    # A copy-on-partial-reuse block counts as allocated and as reused: a block or two extra.
    assert 0 <= report["blocks"] - NUM_REQUESTS_QUICK * blocks_per_request <= 2
    assert 0 < report["hit_rate"] < 1
    expected = expected_hit_rate(NUM_REQUESTS_QUICK)
    assert abs(report["hit_rate"] - expected) <= 3 / (NUM_REQUESTS_QUICK * blocks_per_request)
