from __future__ import annotations

import gc
from typing import Any

import pytest

import app.bench.worker as bench_worker
from app.bench import BENCHMARKS, load_benchmark
from app.bench.manager import (
    NUM_PREFIXES,
    PREFIX_TOKENS,
    TOKENS_PER_BLOCK,
    TOKENS_PER_REQUEST,
    make_prompts,
)
from app.bench.worker import (
    CONCURRENCY_QUICK,
    MAX_TOKENS,
    NUM_REQUESTS_QUICK,
    WORKER_OPTIONS,
    measure_manager,
    run,
    warmup_prompts,
    worker_flags,
)
from app.cli import build_parser
from app.worker.settings import WorkerSettings
from tests.app.bench_cli import run_quick_bench

KEYS = {
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "latency_p50_ms",
    "latency_p99_ms",
    "hit_rate",
    "manager_only_requests_per_s",
    "service_efficiency",
    "manager_only_cpu_us_per_request",
    "service_cpu_us_per_request",
    "requests",
    "ok",
    "failed",
    "seconds",
    "worker_cpu_s",
    "client_cpu_s",
    "other_cpu_s",
}
# A random suffix block can, rarely, share its first tokens with a cached block (partial
# reuse): allow a few blocks' worth of tokens above the shared prefixes, none below.
SLACK_TOKENS = 3 * TOKENS_PER_BLOCK


def test_registered() -> None:
    assert BENCHMARKS["worker"] == "app.bench.worker:run"
    assert load_benchmark("worker") is run


def test_worker_flags_are_the_settings() -> None:
    flags = worker_flags({**WORKER_OPTIONS, "worker_id": "w9", "port": 1234})
    assert "--no-allocate-pools" in flags
    assert flags[flags.index("--max-tokens-per-step") + 1] == "16384"
    args = build_parser().parse_args(["worker", *flags])
    values = {k: v for k, v in vars(args).items() if k in WorkerSettings.model_fields}
    settings = WorkerSettings(**{k: v for k, v in values.items() if v is not None})
    for name, value in WORKER_OPTIONS.items():
        assert getattr(settings, name) == value, name
    # 64 live sequences of prompt + output fit, with the 10 shared prefixes cached beside them.
    blocks_per_sequence = -(-(TOKENS_PER_REQUEST + MAX_TOKENS) // TOKENS_PER_BLOCK)
    live = settings.max_batch_size * blocks_per_sequence
    assert settings.blocks_per_level()[0] >= live + NUM_PREFIXES * PREFIX_TOKENS // TOKENS_PER_BLOCK


def test_warmup_covers_every_prefix_with_fresh_suffixes() -> None:
    prompts = make_prompts(NUM_REQUESTS_QUICK)
    warmup = warmup_prompts(prompts, CONCURRENCY_QUICK)
    prefixes = {tuple(p[:PREFIX_TOKENS]) for p in prompts}
    assert len(warmup) == len(prefixes) + CONCURRENCY_QUICK
    assert {tuple(p[:PREFIX_TOKENS]) for p in warmup[: len(prefixes)]} == prefixes
    assert all(len(p) == TOKENS_PER_REQUEST for p in warmup)
    timed_suffixes = {tuple(p[PREFIX_TOKENS:]) for p in prompts}
    assert not timed_suffixes & {tuple(p[PREFIX_TOKENS:]) for p in warmup}


def test_the_manager_part_runs_the_collector_as_the_worker_does_then_puts_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = make_prompts(8)
    seen: list[tuple[tuple[int, ...], int]] = []  # per replay: thresholds, objects frozen
    original = bench_worker.replay

    def replay(*args: Any) -> dict[str, int]:
        seen.append((gc.get_threshold(), gc.get_freeze_count()))
        return original(*args)

    monkeypatch.setattr(bench_worker, "replay", replay)
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        measure_manager(prompts, warmup_prompts(prompts, 4), 4)
        after = (gc.get_threshold(), gc.get_freeze_count())
    finally:
        gc.set_threshold(*before)
    # the warm-up as the process runs, the timed part as the worker's settle_heap leaves it
    assert [threshold for threshold, _ in seen] == [(700, 10, 10), (20_000, 10, 10)]
    assert seen[1][1] > 0
    assert after == ((700, 10, 10), 0)


def test_quick_run_from_the_command_line() -> None:
    report = run_quick_bench("worker")
    assert report.keys() >= KEYS
    assert report["requests"] == NUM_REQUESTS_QUICK
    assert report["ok"] == NUM_REQUESTS_QUICK
    assert report["failed"] == 0, report["errors"]
    assert report["concurrency"] == CONCURRENCY_QUICK
    assert report["events_dropped"] == 0
    assert report["preemptions"] == 0
    for key in ("requests_per_s", "manager_only_requests_per_s", "seconds", "engine_steps"):
        assert isinstance(report[key], int | float) and report[key] > 0, key
    assert 0 <= report["ttft_p50_ms"] <= report["ttft_p99_ms"]
    assert 0 < report["latency_p50_ms"] <= report["latency_p99_ms"]
    expected = report["requests_per_s"] / report["manager_only_requests_per_s"]
    assert abs(report["service_efficiency"] - expected) < 1e-3
    assert report["manager_only_cpu_us_per_request"] > 0
    if report["worker_cpu_us_per_request"] is not None:  # None where /proc is not there
        overhead = report["worker_cpu_us_per_request"] - report["manager_only_cpu_us_per_request"]
        assert report["service_cpu_us_per_request"] == round(overhead, 1)

    # Every prefix is cached by the warm-up, so each timed request reuses exactly its shared
    # 2,048 tokens (hit rate 0.5), give or take a partial match of a random suffix block.
    prompt_tokens = NUM_REQUESTS_QUICK * TOKENS_PER_REQUEST
    reused, computed = report["reused_prompt_tokens"], report["computed_prompt_tokens"]
    assert reused + computed == prompt_tokens
    assert 0 <= reused - NUM_REQUESTS_QUICK * PREFIX_TOKENS <= SLACK_TOKENS
    assert report["hit_rate"] == round(reused / prompt_tokens, 6)
    assert report["response_hit_rate"] == report["hit_rate"]
    low = PREFIX_TOKENS / TOKENS_PER_REQUEST
    high = low + SLACK_TOKENS / prompt_tokens
    assert low <= report["manager_only_hit_rate"] <= high
