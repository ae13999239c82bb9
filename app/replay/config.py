"""The replay cluster's configuration: its workers (size, speed, scheduling limits), the
router's knobs, and the replica options (``routers``, ``share``, ``event_delay_s``,
``no_events``). ``REPLAY_TIMING`` is the replay's default worker speed."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Final

from app.core.sim_timing import SimTiming
from app.router.policies import Weights

__all__ = ["REPLAY_TIMING", "ClusterConfig"]

# The replay's default worker: a ~70B model on one node rather than the worker's 8B sim
# default (SimTiming()), whose 32 us a prompt token would leave 8 workers ~15 % busy on the
# Mooncake conversation trace (73.6 M prompt tokens in 30 min). Here a step costs 10 ms (the
# weights read once), a prompt token 100 us, a decoding sequence 150 us. Under round robin (hit
# ratio ~0.10) the prefill work alone is then ~46 % of each worker's time and decode steps fill
# most of the rest: busy, with TTFT p50 ~1.2 s, but not saturated (queues drain; every request
# completes within the trace's pace).
REPLAY_TIMING: Final = SimTiming(
    step_overhead_s=10e-3, prefill_s_per_token=100e-6, decode_s_per_sequence=150e-6
)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    num_workers: int = 8
    blocks_per_worker: int = 38_613
    tokens_per_block: int = 64
    timing: SimTiming = REPLAY_TIMING
    max_batch_size: int = 64
    max_tokens_per_step: int = 8_192
    speed: float = 1.0  # trace time / virtual time
    seed: int = 0
    predict_ttl_s: float = 2.0
    weights: Weights | None = None
    # Off: a block is reused only when its whole key matches (a partial block only an equal
    # partial block), which is what the router's index sees. The worker's default is on.
    enable_partial_reuse: bool = False
    coalesce_decode: bool = True  # off: every decode step is simulated (tests compare)
    # Router replicas (requests dealt round robin), each with its own in-flight view, sharing
    # their flights as app.router.share does (unless share is off); events and loads reach
    # the routers event_delay_s late; no_events: the workers publish none (approximate).
    routers: int = 1
    share: bool = True
    event_delay_s: float = 0.0
    no_events: bool = False
    approx_ttl_s: float = 600.0  # no_events: how long a router assumes what it sent is held
    # A mixed fleet: the last slow_workers workers take slow_factor times as long for each
    # part of a step (an older GPU, a bigger model shard); the others run at ``timing``.
    slow_workers: int = 0
    slow_factor: float = 2.0
    speed_reports: bool = True  # off: the workers report no speed (kv_aware's token cost)

    def __post_init__(self) -> None:
        for name in ("num_workers", "blocks_per_worker", "tokens_per_block", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_tokens_per_step < self.tokens_per_block:
            raise ValueError(
                f"max_tokens_per_step: must be >= tokens_per_block ({self.tokens_per_block}), "
                f"got {self.max_tokens_per_step}"
            )
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"speed: must be a positive number, got {self.speed}")
        if self.routers < 1:
            raise ValueError(f"routers: must be >= 1, got {self.routers}")
        if not (math.isfinite(self.event_delay_s) and self.event_delay_s >= 0):
            raise ValueError(f"event_delay_s: must be >= 0, got {self.event_delay_s}")
        if not 0 <= self.slow_workers <= self.num_workers:
            raise ValueError(
                f"slow_workers: must be within 0..{self.num_workers}, got {self.slow_workers}"
            )
        if not (math.isfinite(self.slow_factor) and self.slow_factor > 0):
            raise ValueError(f"slow_factor: must be a positive number, got {self.slow_factor}")

    def worker_timing(self, index: int) -> SimTiming:
        """Worker ``index``'s speed: ``timing``, or ``slow_factor`` times it for the last
        ``slow_workers``."""
        if index < self.num_workers - self.slow_workers:
            return self.timing
        t, f = self.timing, self.slow_factor
        return SimTiming(
            t.step_overhead_s * f, t.prefill_s_per_token * f, t.decode_s_per_sequence * f
        )

    def pooled(self) -> ClusterConfig:
        """One worker with every worker's blocks and compute (see the module docstring): the
        workers' speeds add up (a slow worker adds 1 / slow_factor of a fast one)."""
        n = self.num_workers
        fast = n - self.slow_workers + self.slow_workers / self.slow_factor  # in fast workers
        t = self.timing
        return replace(
            self,
            num_workers=1,
            blocks_per_worker=self.blocks_per_worker * n,
            timing=SimTiming(
                t.step_overhead_s / fast,
                t.prefill_s_per_token / fast,
                t.decode_s_per_sequence / fast,
            ),
            slow_workers=0,
            max_batch_size=self.max_batch_size * n,
            max_tokens_per_step=self.max_tokens_per_step * n,
        )
