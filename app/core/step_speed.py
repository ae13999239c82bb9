"""A worker's observed speed: what its engine steps take, learned from the steps it ran.

The model is ``SimTiming``'s, linear: a step costs a fixed time, plus per prompt token computed,
plus per sequence decoded. ``StepSpeed`` fits it to the steps a worker ran (least squares with
exponential forgetting, so that it follows a worker whose speed changes), and the worker
publishes the fit with its load (``speed_fields``); the router reads it back
(``speed_from_load``) to predict each worker's time to a request's first token in seconds.

Nothing here knows the simulated timing: a ``kvmesh worker --engine sim`` and ``kvmesh replay``
are fitted from the step times they produced, a torch worker from the wall time of its steps.

Why a fit and not ratios: a step mixes prefill chunks and decodes, so neither "prefill tokens
per second" nor "seconds per step" alone is a speed. Three unknowns, so a 3x3 normal equation,
solved in plain floats (no numpy on an engine step). A ridge towards a prior keeps it defined
before the steps vary enough: per term, a millionth of what the steps said about that term
(negligible once the steps vary, whatever their sizes) plus a vanishing
constant (so that a term never seen, as a worker's decode cost before it decoded, stays the
prior's). A fit over fewer than ``MIN_STEPS`` steps is not published.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from app.core.sim_timing import SimTiming

__all__ = ["MIN_STEPS", "SPEED_FIELDS", "StepSpeed", "speed_fields", "speed_from_load"]

# The load fields that carry a speed (integers, as every load field is).
SPEED_FIELDS: Final = (
    "step_overhead_us",
    "prefill_ns_per_token",
    "decode_ns_per_sequence",
    "max_tokens_per_step",
)
MIN_STEPS: Final = 32
_RIDGE: Final = 1e-6
_RIDGE_FLOOR: Final = 1e-9
# Features are scaled to be near 1 (a step of ~1,000 prefill tokens and ~10 decodes), so that
# one ridge weight suits all three and the normal equations are well conditioned.
_TOKEN_SCALE: Final = 1e-3
_DECODE_SCALE: Final = 1e-1


class StepSpeed:
    """Least-squares fit of step time on (1, prefill tokens, decodes), forgetting old steps.

    ``half_life_steps``: a step's weight halves after this many newer steps."""

    __slots__ = ("_decay", "_prior", "_s", "steps")

    def __init__(self, prior: SimTiming | None = None, *, half_life_steps: float = 2_000) -> None:
        if not half_life_steps > 0:
            raise ValueError(f"half_life_steps: must be positive, got {half_life_steps!r}")
        self._prior = prior or SimTiming()
        self._decay = 0.5 ** (1.0 / half_life_steps)
        # Decayed sums: x0x0 = weight, x0x1, x0x2, x1x1, x1x2, x2x2, x0y, x1y, x2y.
        self._s = [0.0] * 9
        self.steps = 0

    def observe(self, duration_s: float, prefill_tokens: int, decodes: int, count: int = 1) -> None:
        """An engine step that took ``duration_s`` (``count`` such steps in a row: replay's
        coalesced decode runs); an idle or failed step is not one."""
        if not (prefill_tokens or decodes) or not math.isfinite(duration_s) or duration_s < 0:
            return
        p = prefill_tokens * _TOKEN_SCALE
        d = decodes * _DECODE_SCALE
        s = self._s
        k = self._decay if count == 1 else self._decay**count
        n = float(count)  # the run's steps, weighed as the newest (their decay is negligible)
        s[0] = s[0] * k + n
        s[1] = s[1] * k + n * p
        s[2] = s[2] * k + n * d
        s[3] = s[3] * k + n * p * p
        s[4] = s[4] * k + n * p * d
        s[5] = s[5] * k + n * d * d
        s[6] = s[6] * k + n * duration_s
        s[7] = s[7] * k + n * p * duration_s
        s[8] = s[8] * k + n * d * duration_s
        self.steps += count

    def estimate(self) -> SimTiming:
        """The fitted speed (the prior's where the steps say nothing yet); no term below 0."""
        prior = self._prior
        theta0 = (
            prior.step_overhead_s,
            prior.prefill_s_per_token / _TOKEN_SCALE,
            prior.decode_s_per_sequence / _DECODE_SCALE,
        )
        s = self._s
        r = [_RIDGE * s[i] + _RIDGE_FLOOR for i in (0, 3, 5)]
        a = [
            [s[0] + r[0], s[1], s[2]],
            [s[1], s[3] + r[1], s[4]],
            [s[2], s[4], s[5] + r[2]],
        ]
        b = [s[6] + r[0] * theta0[0], s[7] + r[1] * theta0[1], s[8] + r[2] * theta0[2]]
        theta = _solve3(a, b)
        return SimTiming(
            max(theta[0], 0.0),
            max(theta[1], 0.0) * _TOKEN_SCALE,
            max(theta[2], 0.0) * _DECODE_SCALE,
        )


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float]:
    """Cramer's rule: the ridge makes ``a`` positive definite, so the determinant is > 0."""

    def det(m: list[list[float]]) -> float:
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    d = det(a)
    out = []
    for col in range(3):
        m = [row[:] for row in a]
        for i in range(3):
            m[i][col] = b[i]
        out.append(det(m) / d)
    return out[0], out[1], out[2]


def speed_fields(speed: SimTiming, max_tokens_per_step: int) -> dict[str, int]:
    """A speed as load fields (integers: microseconds per step, nanoseconds per unit)."""
    return {
        "step_overhead_us": round(speed.step_overhead_s * 1e6),
        "prefill_ns_per_token": round(speed.prefill_s_per_token * 1e9),
        "decode_ns_per_sequence": round(speed.decode_s_per_sequence * 1e9),
        "max_tokens_per_step": max_tokens_per_step,
    }


def speed_from_load(load: Mapping[str, int]) -> tuple[SimTiming, int] | None:
    """The speed and step token budget a load report carries, or None if it carries none, or
    one no fit gives (a time below 0, a budget below 1 token: ``speed_fields`` writes neither,
    and a worker reporting a step of -1e12 µs would win every request)."""
    try:
        step_us, prefill_ns, decode_ns, budget = (load[name] for name in SPEED_FIELDS)
    except KeyError:
        return None
    if min(step_us, prefill_ns, decode_ns) < 0 or budget < 1:
        return None
    return SimTiming(step_us / 1e6, prefill_ns / 1e9, decode_ns / 1e9), int(budget)
