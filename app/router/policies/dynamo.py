"""``dynamo``: NVIDIA Dynamo's KV router (``DefaultWorkerSelector``), as published, on kvmesh's
index and loads, so that a comparison is made in one run. Per worker, in blocks::

    prefill = (request tokens - overlap blocks * block size + queued prefill tokens) / bs
    decode  = active blocks + the request's blocks
    logit   = overlap_score_weight * prefill + decode

The lowest logit wins (temperature 0, random among ties), else softmax over the logits
normalised to [0, 1] with the temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from app.router.policies.base import (
    Candidate,
    Cost,
    Decision,
    Policy,
    PolicyState,
    RouteRequest,
    Weights,
    decision,
    lowest,
    require,
    softmax_pick,
)

__all__ = ["POLICY", "DynamoConfig", "dynamo"]


@dataclass(frozen=True, slots=True)
class DynamoConfig:
    overlap_weight: float  # Dynamo's overlap_score_weight
    temperature: float


@lru_cache(maxsize=64)
def config(weights: Weights) -> DynamoConfig:
    return DynamoConfig(weights.dynamo_overlap_weight, weights.temperature)


def dynamo(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    config: DynamoConfig,
    state: PolicyState,
) -> Decision:
    """See the module docstring."""
    require(candidates)
    tpb = request.tokens_per_block
    request_blocks = -(-request.num_tokens // tpb)
    costs: list[Cost] = []
    for c in candidates:
        new_tokens = request.num_tokens - c.matched_blocks * tpb
        prefill = max(new_tokens + c.queued_prefill_tokens, 0) / tpb
        decode = c.active_blocks + request_blocks
        logit = config.overlap_weight * prefill + decode
        cached = c.cached_tokens(request)
        costs.append(
            Cost(c.worker, logit, cached, float(request.num_tokens - cached), decode, c.fresh)
        )
    values = [c.cost for c in costs]
    if config.temperature > 0:
        spread = max(values) - min(values)
        index = softmax_pick(values, config.temperature * (spread or 1.0), state)
    else:
        index = lowest(values, [0.0] * len(values), state, request)
    return decision("dynamo", request, candidates[index], costs)


POLICY: Final = Policy("dynamo", dynamo, config)
