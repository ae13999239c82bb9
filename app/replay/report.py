"""Figures of a replay run: the metrics per policy, the table, the JSON, the plots.

Definitions (times in seconds of trace time, i.e. virtual time x speed):

* ``hit_ratio``: prompt tokens reused / prompt tokens, over the requests admitted (reused is what
  ``add_sequence`` reports, so the last prompt token and partial blocks follow its rules);
* ``ttft_*``: arrival to the end of the step that completes the prompt; ``e2e_*``: arrival to
  the end of the step that produces the last token; percentiles over the completed requests;
* ``requests_per_s`` / ``tokens_per_s``: completed requests and their prompt plus output tokens
  over the span from the first arrival to the last completion;
* ``load_imbalance``: how much more prefill the busiest worker did than the most even placement
  of the same requests could have given it, per 60 s window of trace time. For window *t*
  (steps by their start), ``L[t, w]`` is the prompt tokens worker *w* computed (not reused);
  no placement gives the busiest worker less than ``B[t] = max(mean_w L[t, w], the most tokens
  one request computed in t)``, since a request's prefill runs on one worker; the window's
  ratio is ``max_w L[t, w] / B[t]`` (1 to the number of workers), and ``load_imbalance`` is
  the windows' ratios averaged weighted by their prefill, ``sum_t ratio[t] * L[t].sum() /
  L.sum()``. 1.0: no window's busiest worker did more than it had to (``pooled``, one
  worker, is 1.0); at most the number of workers: all of each window's prefill on one worker,
  in requests small next to the window's total. Over the mean alone (the bound before), a
  window with fewer requests than workers read as imbalanced whatever the policy: one request
  among 8 workers scored 8.0, and round robin, 24 requests on each of 8 workers, scored 2.65
  on the demo trace (6.6 requests a minute);
* ``ttft_floor_*``: the TTFT each request would have had with the cache hits it got, alone on an
  idle worker (its uncached prompt at one worker's speed, in steps of the step token budget:
  no queue, no decodes beside it). ``pooled``'s floor uses the best hits any placement can get,
  so its ``ttft_floor_p99_s`` bounds every router's ``ttft_p99_s`` from below (to the extent
  the slowest requests are the big cold prompts, as in the Mooncake traces): a target below it
  cannot be met by placement;
* ``failed``: requests that could never fit in a worker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from app.replay.cluster import POOLED, RequestRecord, RunResult

__all__ = [
    "IMBALANCE_WINDOW_S",
    "format_table",
    "largest_prefill",
    "load_imbalance",
    "plot",
    "prefill_load",
    "summarise",
    "ttft_floor",
]

IMBALANCE_WINDOW_S: Final = 60.0


def _percentile(values: npt.NDArray[np.float64], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def prefill_load(result: RunResult, window_s: float = IMBALANCE_WINDOW_S) -> npt.NDArray[np.int64]:
    """Prefill tokens per (window of trace time, worker): shape (num_windows, num_workers)."""
    speed = result.config.speed
    num_workers = len(result.worker_ids)
    steps = result.prefill_steps
    if not steps:
        return np.zeros((0, num_workers), dtype=np.int64)
    workers = np.fromiter((s.worker for s in steps), dtype=np.int64, count=len(steps))
    starts = np.fromiter((s.start_s for s in steps), dtype=np.float64, count=len(steps))
    tokens = np.fromiter((s.prefill_tokens for s in steps), dtype=np.int64, count=len(steps))
    windows = np.floor(starts * speed / window_s).astype(np.int64)
    load = np.zeros((int(windows.max()) + 1, num_workers), dtype=np.int64)
    np.add.at(load, (windows, workers), tokens)
    return load


def largest_prefill(
    result: RunResult, window_s: float = IMBALANCE_WINDOW_S
) -> npt.NDArray[np.int64]:
    """The most prefill tokens one request computed in each window: shape (num_windows,), the
    windows of ``prefill_load``."""
    speed = result.config.speed
    per_request: dict[tuple[int, int], int] = {}
    last = -1
    for step in result.prefill_steps:
        window = math.floor(step.start_s * speed / window_s)
        last = max(last, window)
        for request, tokens in step.chunks:
            key = (window, request)
            per_request[key] = per_request.get(key, 0) + tokens
    largest = np.zeros(last + 1, dtype=np.int64)
    for (window, _), tokens in per_request.items():
        largest[window] = max(largest[window], tokens)
    return largest


def load_imbalance(
    load: npt.NDArray[np.int64], largest: npt.NDArray[np.int64] | None = None
) -> float:
    """``load_imbalance`` of the module docstring from ``prefill_load`` and ``largest_prefill``.
    Without ``largest`` (callers that do not know requests apart) the bound is the mean alone."""
    totals = load.sum(axis=1)
    busy = totals > 0
    if not busy.any():
        return 1.0
    bound = totals[busy] / load.shape[1]
    if largest is not None:
        if largest.shape != totals.shape:
            raise ValueError(f"largest: shape {largest.shape}, the load has {totals.shape}")
        bound = np.maximum(bound, largest[busy])
    ratios = load[busy].max(axis=1) / bound
    return float(np.average(ratios, weights=totals[busy]))


def ttft_floor(result: RunResult, records: Sequence[RequestRecord]) -> npt.NDArray[np.float64]:
    """Each record's ``ttft_floor`` (see the module docstring), in seconds of trace time."""
    config = result.cluster_config or result.config
    timing = config.timing
    own = np.array([r.prompt_tokens - r.reused_tokens for r in records], dtype=np.float64)
    steps = np.maximum(np.ceil(own / config.max_tokens_per_step), 1.0)
    seconds = own * timing.prefill_s_per_token + steps * timing.step_overhead_s
    return seconds * result.config.speed


def summarise(result: RunResult) -> dict[str, Any]:
    """The figures of one run (see the module docstring), JSON-ready."""
    speed = result.config.speed
    records = result.requests
    admitted = [r for r in records if not r.failed]
    done = [r for r in admitted if not math.isnan(r.finished_s)]
    prompt = sum(r.prompt_tokens for r in admitted)
    reused = sum(r.reused_tokens for r in admitted)
    arrival = np.array([r.arrival_s for r in done], dtype=np.float64)
    ttft = (np.array([r.first_token_s for r in done], dtype=np.float64) - arrival) * speed
    e2e = (np.array([r.finished_s for r in done], dtype=np.float64) - arrival) * speed
    if done:
        span = (max(r.finished_s for r in done) - min(r.arrival_s for r in records)) * speed
    else:
        span = 0.0
    tokens = sum(r.prompt_tokens + r.output_tokens for r in done)
    floor = ttft_floor(result, done)
    return {
        "hit_ratio": reused / prompt if prompt else 0.0,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p90_s": _percentile(ttft, 90),
        "ttft_p99_s": _percentile(ttft, 99),
        "ttft_floor_p50_s": _percentile(floor, 50),
        "ttft_floor_p99_s": _percentile(floor, 99),
        "e2e_p50_s": _percentile(e2e, 50),
        "e2e_p99_s": _percentile(e2e, 99),
        "load_imbalance": load_imbalance(prefill_load(result), largest_prefill(result)),
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(admitted),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "requests_per_s": len(done) / span if span > 0 else 0.0,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "workers": len(result.worker_ids),
        "steps": result.num_steps,
        "events": result.num_events,
        "wall_s": result.wall_s,
    }


_COLUMNS: Final = (
    ("policy", "{}", "policy"),
    ("hit", "{:.3f}", "hit_ratio"),
    ("ttft p50", "{:.3f}", "ttft_p50_s"),
    ("p90", "{:.3f}", "ttft_p90_s"),
    ("p99", "{:.3f}", "ttft_p99_s"),
    ("floor p99", "{:.3f}", "ttft_floor_p99_s"),
    ("e2e p50", "{:.2f}", "e2e_p50_s"),
    ("p99", "{:.2f}", "e2e_p99_s"),
    ("imbalance", "{:.2f}", "load_imbalance"),
    ("req/s", "{:.2f}", "requests_per_s"),
    ("tok/s", "{:,.0f}", "tokens_per_s"),
    ("requests", "{}", "requests"),
    ("failed", "{}", "failed"),
    ("wall s", "{:.1f}", "wall_s"),
)


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    """One row per policy, aligned; times in seconds."""
    rows = [[title for title, _, _ in _COLUMNS]]
    for policy, figures in summaries.items():
        values = {"policy": policy, **figures}
        rows.append([fmt.format(values[key]) for _, fmt, key in _COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot(
    results: Sequence[RunResult], summaries: dict[str, dict[str, Any]], out: Path
) -> list[Path]:
    """Write hit_ratio.png, ttft_cdf.png and prefill_load_<policy>.png under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    policies = list(summaries)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(policies, [summaries[p]["hit_ratio"] for p in policies], color="tab:blue")
    ax.set_ylabel("prompt tokens reused / prompt tokens")
    ax.set_title("Hit ratio per policy")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    written.append(out / "hit_ratio.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for result in results:
        speed = result.config.speed
        ttft = np.sort(
            [
                (r.first_token_s - r.arrival_s) * speed
                for r in result.requests
                if not math.isnan(r.first_token_s)
            ]
        )
        if len(ttft):
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=result.policy)
        if result.policy == POOLED:  # the floor no placement can beat (module docstring)
            done = [r for r in result.requests if not math.isnan(r.first_token_s)]
            floor = np.sort(ttft_floor(result, done))
            if len(floor):
                y = np.arange(1, len(floor) + 1) / len(floor)
                ax.plot(floor, y, "k--", linewidth=1, label="floor (alone, pooled hits)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    written.append(out / "ttft_cdf.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    for result in results:
        load = prefill_load(result)
        fig, ax = plt.subplots(figsize=(8, 4))
        minutes = np.arange(load.shape[0]) * IMBALANCE_WINDOW_S / 60.0
        for w, worker in enumerate(result.worker_ids):
            ax.plot(minutes, load[:, w] / IMBALANCE_WINDOW_S, label=worker, linewidth=1)
        ax.set_xlabel("trace time (min)")
        ax.set_ylabel("prefill tokens / s (60 s windows)")
        ax.set_title(f"Prefill load per worker: {result.policy}")
        if len(result.worker_ids) <= 16:
            ax.legend(fontsize="small", ncol=2)
        fig.tight_layout()
        written.append(out / f"prefill_load_{result.policy}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
