from __future__ import annotations

import orjson

from app.bench import BENCHMARKS, load_benchmark
from app.bench.proxy import (
    BATCH_QUICK,
    MAX_TOKENS,
    NUM_PROMPTS_QUICK,
    PROMPT_TOKENS,
    ROUNDS_QUICK,
    VOCAB_SIZE,
    make_bodies,
    run,
)
from tests.app.bench_cli import run_quick_bench

KEYS = {
    "requests",
    "rounds",
    "prompt_tokens",
    "max_tokens",
    "prompts",
    "direct_ok",
    "direct_errors",
    "direct_error_samples",
    "direct_seconds",
    "direct_p50_ms",
    "direct_p99_ms",
    "direct_worker_ttft_p50_ms",
    "worker_cpu_us_direct",
    "proxied_ok",
    "proxied_errors",
    "proxied_error_samples",
    "proxied_seconds",
    "proxied_p50_ms",
    "proxied_p99_ms",
    "proxied_worker_ttft_p50_ms",
    "worker_cpu_us_proxied",
    "added_p50_ms",
    "added_p99_ms",
    "router_cpu_s",
    "router_cpu_us_per_request",
    "router_idle_cpu_s",
    "router_busy_cpu_us_per_request",
    "client_cpu_s",
    "redis_cpu_s",
    "other_cpu_s",
    "cpus",
    "load_average",
}


def test_registered() -> None:
    assert BENCHMARKS["proxy"] == "app.bench.proxy:run"
    assert load_benchmark("proxy") is run


def test_the_bodies_are_seeded_token_prompts_asking_for_one_token() -> None:
    bodies = make_bodies(3)
    assert bodies == make_bodies(3)
    assert len(set(bodies)) == 3
    for body in bodies:
        data = orjson.loads(body)
        assert data.keys() == {"prompt", "max_tokens"}
        assert data["max_tokens"] == MAX_TOKENS == 1
        assert len(data["prompt"]) == PROMPT_TOKENS
        assert all(0 <= t < VOCAB_SIZE for t in data["prompt"])


def test_quick_run_from_the_command_line() -> None:
    report = run_quick_bench("proxy")
    assert report.keys() == KEYS
    requests = ROUNDS_QUICK * BATCH_QUICK
    assert report["requests"] == requests
    assert report["rounds"] == ROUNDS_QUICK
    assert report["prompts"] == NUM_PROMPTS_QUICK
    assert (report["prompt_tokens"], report["max_tokens"]) == (PROMPT_TOKENS, MAX_TOKENS)
    # Every request answered 200 by the one worker, with one token, both ways.
    for way in ("direct", "proxied"):
        assert report[f"{way}_ok"] == requests, report[f"{way}_error_samples"]
        assert report[f"{way}_errors"] == 0
        assert report[f"{way}_error_samples"] == []
        assert 0 < report[f"{way}_p50_ms"] <= report[f"{way}_p99_ms"]
        assert report[f"{way}_seconds"] > 0
        assert report[f"{way}_worker_ttft_p50_ms"] > 0
    assert report["added_p50_ms"] == round(report["proxied_p50_ms"] - report["direct_p50_ms"], 3)
    assert report["added_p99_ms"] == round(report["proxied_p99_ms"] - report["direct_p99_ms"], 3)
    assert report["router_cpu_s"] >= 0
    assert report["router_cpu_us_per_request"] == round(report["router_cpu_s"] / requests * 1e6, 1)
    busy = report["router_busy_cpu_us_per_request"]
    assert 0 <= busy <= report["router_cpu_us_per_request"]
    assert report["cpus"] >= 1
