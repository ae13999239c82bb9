"""``sglang``: SGLang router's ``cache_aware``, as published, on kvmesh's index and loads.

Load is requests in flight. If the busiest and the idlest worker differ by more than
``balance_abs`` and the busiest has more than ``balance_rel`` times the idlest's, the idlest
wins; else the longest match wins if it covers more than ``cache_threshold`` of the prompt; else
the worker holding the fewest cached blocks (the smallest tree). That last rule needs every
worker's tree size, which this policy declares (``needs_tree_sizes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from app.router.policies.base import (
    Candidate,
    Decision,
    Policy,
    PolicyState,
    RouteRequest,
    Weights,
    decision,
    lowest,
    plain_costs,
    require,
)

__all__ = ["POLICY", "SglangConfig", "sglang"]


@dataclass(frozen=True, slots=True)
class SglangConfig:
    cache_threshold: float
    balance_abs: int
    balance_rel: float


@lru_cache(maxsize=64)
def config(weights: Weights) -> SglangConfig:
    return SglangConfig(
        weights.sglang_cache_threshold, weights.sglang_balance_abs, weights.sglang_balance_rel
    )


def sglang(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    config: SglangConfig,
    state: PolicyState,
) -> Decision:
    """See the module docstring."""
    require(candidates)
    running = [c.running for c in candidates]
    low, high = min(running), max(running)
    matched = [c.cached_tokens(request) for c in candidates]
    if high - low > config.balance_abs and high > low * config.balance_rel:
        values = [float(r) for r in running]
    else:
        best = max(matched)
        rate = best / request.num_tokens if request.num_tokens else 0.0
        if rate > config.cache_threshold:
            values = [float(request.num_tokens - m) for m in matched]
        else:
            values = [float(c.cached_blocks) for c in candidates]
    index = lowest(values, [float(r) for r in running], state, request)
    return decision("sglang", request, candidates[index], plain_costs(request, candidates, values))


POLICY: Final = Policy("sglang", sglang, config, needs_tree_sizes=True)
