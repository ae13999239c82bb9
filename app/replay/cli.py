"""``kvmesh replay``: a Mooncake trace through an in-process cluster, once per policy.

    kvmesh replay --trace conversation_trace.jsonl --workers 8 --tokens-per-block 64 \\
        --blocks-per-worker 38613 --policy kv_aware --policy round_robin --policy pooled

Each policy runs on a fresh cluster (``app.replay.cluster``); policies run in parallel processes
(``--jobs``, default one per policy up to the CPU count). Prints a table per policy; ``--json``
adds one JSON line last; ``--plot DIR`` writes PNGs. A bad trace or flag is exit status 2 with
a message naming the line and field (no traceback).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from app.core.sim_timing import SimTiming
from app.replay.cluster import POOLED, REPLAY_TIMING, ClusterConfig, RunResult, run_policy
from app.replay.report import format_table, plot, summarise
from app.replay.trace import TokenSource, TraceError, TraceRequest, load_trace
from app.router.policies import POLICIES, Weights

__all__ = ["add_arguments", "main"]

DEFAULT_POLICIES = ("kv_aware", "round_robin")
_WEIGHT_NAMES = tuple(Weights.__dataclass_fields__)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _weight(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or name not in _WEIGHT_NAMES:
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE with NAME one of {', '.join(_WEIGHT_NAMES)}, got {text!r}"
        )
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: expected a number, got {value!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``kvmesh replay``, each with a help that gives its default."""
    t = REPLAY_TIMING
    defaults = ClusterConfig()
    parser.add_argument("--trace", required=True, type=Path, help="Mooncake-format JSONL trace")
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=defaults.num_workers,
        help=f"simulated workers (default: {defaults.num_workers})",
    )
    parser.add_argument(
        "--blocks-per-worker",
        type=_positive_int,
        default=defaults.blocks_per_worker,
        help=f"KV cache blocks of each worker (default: {defaults.blocks_per_worker})",
    )
    parser.add_argument(
        "--tokens-per-block",
        type=_positive_int,
        default=defaults.tokens_per_block,
        help=f"tokens per KV cache block (default: {defaults.tokens_per_block})",
    )
    parser.add_argument(
        "--policy",
        action="append",
        choices=[*POLICIES, POOLED],
        help=f"a routing policy, or {POOLED} (repeat; default: {', '.join(DEFAULT_POLICIES)})",
    )
    parser.add_argument(
        "--speed",
        type=_positive_float,
        default=1.0,
        help="trace time per virtual second (default: 1)",
    )
    parser.add_argument(
        "--limit", type=_positive_int, help="replay the first N requests only (default: all)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="token generator and policy seed (default: 0)"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="DIR", help="write PNG plots here (default: none)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON line last (default: tables only)"
    )
    parser.add_argument(
        "--jobs", type=_positive_int, help="processes (default: policies, up to the CPU count)"
    )
    # The defaults are app.replay.cluster's (REPLAY_TIMING: a ~70B model on one node).
    timing = parser.add_argument_group("simulated worker")
    timing.add_argument(
        "--step-overhead-ms",
        type=_non_negative_float,
        default=t.step_overhead_s * 1e3,
        help=f"fixed time of an engine step (default: {t.step_overhead_s * 1e3:g})",
    )
    timing.add_argument(
        "--prefill-us-per-token",
        type=_non_negative_float,
        default=t.prefill_s_per_token * 1e6,
        help=f"time per uncached prompt token (default: {t.prefill_s_per_token * 1e6:g})",
    )
    timing.add_argument(
        "--decode-us-per-sequence",
        type=_non_negative_float,
        default=t.decode_s_per_sequence * 1e6,
        help=f"time per decoding sequence in a step (default: {t.decode_s_per_sequence * 1e6:g})",
    )
    timing.add_argument(
        "--max-tokens-per-step",
        type=_positive_int,
        default=defaults.max_tokens_per_step,
        help="token budget of one step, prefill chunks and decodes "
        f"(default: {defaults.max_tokens_per_step})",
    )
    timing.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=defaults.max_batch_size,
        help=f"most sequences running at once (default: {defaults.max_batch_size})",
    )
    timing.add_argument(
        "--slow-workers",
        type=int,
        default=defaults.slow_workers,
        metavar="N",
        help="a mixed fleet: the last N workers are --slow-factor times slower (default: 0)",
    )
    timing.add_argument(
        "--slow-factor",
        type=_positive_float,
        default=defaults.slow_factor,
        help=f"how much slower each part of a slow worker's step is "
        f"(default: {defaults.slow_factor:g})",
    )
    timing.add_argument(
        "--no-speed-reports",
        action="store_true",
        help="the workers report no speed with their load, so kv_aware uses its token cost, "
        "as for an engine behind kvmesh ingest (default: they report the speed they fit)",
    )
    timing.add_argument(
        "--partial-reuse",
        action="store_true",
        help="reuse partially matching blocks, as kvmesh worker does by default "
        "(default here: off, whole blocks only)",
    )
    router = parser.add_argument_group("router")
    router.add_argument(
        "--predict-ttl-s",
        type=_non_negative_float,
        default=defaults.predict_ttl_s,
        help="seconds a decision's blocks count as cached before their events, at least "
        f"(at most twice) (default: {defaults.predict_ttl_s:g})",
    )
    router.add_argument(
        "--routers",
        type=int,
        default=defaults.routers,
        help="router replicas, requests dealt round robin, each with its own in-flight view, "
        "sharing their decisions as live routers do (default: 1)",
    )
    router.add_argument(
        "--no-share",
        action="store_true",
        help="with --routers N: the replicas do not share their decisions, so that the loss "
        "shows (default: they share)",
    )
    router.add_argument(
        "--event-delay-ms",
        type=_non_negative_float,
        default=defaults.event_delay_s * 1e3,
        help="KV events and loads reach the routers this late (default: 0)",
    )
    router.add_argument(
        "--no-events",
        action="store_true",
        help="the workers publish no KV events: routers match what they sent each worker "
        "(approximate, as for kvmesh register; default: exact events)",
    )
    router.add_argument(
        "--approx-ttl-s",
        type=_non_negative_float,
        default=defaults.approx_ttl_s,
        help="with --no-events: seconds a router assumes a worker holds what it sent it "
        f"(default: {defaults.approx_ttl_s:g}, as kvmesh router's)",
    )
    router.add_argument(
        "--weight",
        type=_weight,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"a policy weight (repeat): {', '.join(_WEIGHT_NAMES)} (default: the router's)",
    )


def _config(args: argparse.Namespace) -> ClusterConfig:
    weights = Weights(**dict(args.weight)) if args.weight else None
    return ClusterConfig(
        num_workers=args.workers,
        blocks_per_worker=args.blocks_per_worker,
        tokens_per_block=args.tokens_per_block,
        timing=SimTiming(
            args.step_overhead_ms / 1e3,
            args.prefill_us_per_token / 1e6,
            args.decode_us_per_sequence / 1e6,
        ),
        max_batch_size=args.max_batch_size,
        max_tokens_per_step=args.max_tokens_per_step,
        speed=args.speed,
        seed=args.seed,
        predict_ttl_s=args.predict_ttl_s,
        weights=weights,
        enable_partial_reuse=args.partial_reuse,
        routers=args.routers,
        share=not args.no_share,
        event_delay_s=args.event_delay_ms / 1e3,
        no_events=args.no_events,
        slow_workers=args.slow_workers,
        slow_factor=args.slow_factor,
        speed_reports=not args.no_speed_reports,
        approx_ttl_s=args.approx_ttl_s,
    )


def _fail(message: str) -> int:
    print(f"kvmesh replay: error: {message}", file=sys.stderr)
    return 2


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


# -- running the policies --------------------------------------------------------------------

# Per-process progress counters (one slot per policy), inherited by the pool's processes.
_progress_slots: Any = None


def _init_child(slots: Any) -> None:
    global _progress_slots
    _progress_slots = slots


def _run_child(
    slot: int, trace: Sequence[TraceRequest], policy: str, config: ClusterConfig
) -> RunResult:
    slots = _progress_slots

    def progress(n: int) -> None:
        slots[slot] += n

    return _run(trace, policy, config, progress)


def _run(
    trace: Sequence[TraceRequest],
    policy: str,
    config: ClusterConfig,
    progress: Callable[[int], None],
) -> RunResult:
    started = time.perf_counter()
    result = run_policy(trace, policy, config, TokenSource(config.seed), progress)
    result.wall_s = time.perf_counter() - started
    return result


class _Progress:
    """A tqdm bar on stderr when it is a terminal; nothing otherwise."""

    def __init__(self, total: int) -> None:
        self.bar: Any = None
        if sys.stderr.isatty():
            from tqdm import tqdm  # type: ignore[import-untyped]

            self.bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def set(self, n: int) -> None:
        if self.bar is not None and n > self.bar.n:
            self.bar.update(n - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_policies(
    trace: Sequence[TraceRequest], policies: Sequence[str], config: ClusterConfig, jobs: int
) -> list[RunResult]:
    """Each policy on its own cluster; in ``jobs`` processes when more than one."""
    bar = _Progress(len(trace) * len(policies))
    try:
        if jobs <= 1 or len(policies) == 1:
            return [_run(trace, p, config, bar.update) for p in policies]
        context = multiprocessing.get_context("fork")
        slots = context.Array("q", len(policies), lock=False)
        with ProcessPoolExecutor(
            max_workers=jobs, mp_context=context, initializer=_init_child, initargs=(slots,)
        ) as pool:
            futures: list[Future[RunResult]] = [
                pool.submit(_run_child, i, trace, p, config) for i, p in enumerate(policies)
            ]
            while not all(f.done() for f in futures):
                time.sleep(0.2)
                bar.set(sum(slots))
            return [f.result() for f in futures]
    finally:
        bar.close()


def main(args: argparse.Namespace) -> int:
    policies = list(dict.fromkeys(args.policy or DEFAULT_POLICIES))
    try:
        config = _config(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        trace = load_trace(args.trace, limit=args.limit)
    except TraceError as exc:
        return _fail(str(exc))
    jobs = args.jobs or min(len(policies), os.cpu_count() or 1)
    results = run_policies(trace, policies, config, jobs)
    summaries = {r.policy: summarise(r) for r in results}
    print(
        f"{len(trace)} requests of {args.trace}, {config.num_workers} workers x "
        f"{config.blocks_per_worker} blocks of {config.tokens_per_block} tokens, "
        f"speed {config.speed:g}"
    )
    print(format_table(summaries))
    if args.plot is not None:
        for path in plot(results, summaries, args.plot):
            print(f"wrote {path}")
    if args.json:
        print(json.dumps(_json_safe({"policies": summaries}), sort_keys=False))
    return 0
