"""The cache-blind baselines: ``round_robin``, ``random`` and ``least_loaded``.

``round_robin``: each worker in turn (the position survives changes in the candidate list).
``random``: uniformly at random (seeded). ``least_loaded``: fewest queued prefill tokens plus
``decode`` x running sequences (as kv_aware weighs them), ties by fewer active blocks.
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

__all__ = ["LEAST_LOADED", "RANDOM", "ROUND_ROBIN", "LeastLoadedConfig"]


def _no_config(weights: Weights) -> None:
    return None


def round_robin(
    request: RouteRequest, candidates: Sequence[Candidate], config: None, state: PolicyState
) -> Decision:
    """Each worker in turn (the position survives changes in the candidate list)."""
    require(candidates)
    index = state.next_index % len(candidates)
    state.next_index = index + 1
    ranks = [(i - index) % len(candidates) for i in range(len(candidates))]
    return decision(
        "round_robin", request, candidates[index], plain_costs(request, candidates, ranks)
    )


def random_choice(
    request: RouteRequest, candidates: Sequence[Candidate], config: None, state: PolicyState
) -> Decision:
    """Uniformly at random (seeded)."""
    require(candidates)
    index = state.rng.randrange(len(candidates))
    ranks = [0.0 if i == index else 1.0 for i in range(len(candidates))]
    return decision("random", request, candidates[index], plain_costs(request, candidates, ranks))


@dataclass(frozen=True, slots=True)
class LeastLoadedConfig:
    decode: float  # prefill tokens one running sequence is worth


@lru_cache(maxsize=64)
def _least_loaded_config(weights: Weights) -> LeastLoadedConfig:
    return LeastLoadedConfig(weights.decode)


def least_loaded(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    config: LeastLoadedConfig,
    state: PolicyState,
) -> Decision:
    """Fewest queued prefill tokens plus running sequences (as kv_aware weighs them); cache
    blind."""
    require(candidates)
    values = [c.queued_prefill_tokens + config.decode * c.running for c in candidates]
    index = lowest(values, [float(c.active_blocks) for c in candidates], state, request)
    return decision(
        "least_loaded", request, candidates[index], plain_costs(request, candidates, values)
    )


ROUND_ROBIN: Final = Policy("round_robin", round_robin, _no_config)
RANDOM: Final = Policy("random", random_choice, _no_config)
LEAST_LOADED: Final = Policy("least_loaded", least_loaded, _least_loaded_config)
