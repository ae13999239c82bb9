"""The HTTP-free steps of a routing request, shared by the FastAPI routes and the fast path of
``POST /route``: the prompt as token ids (text through the tokenizer) and as the words the
hasher reads, per-request routing overrides, the decision (observed by the metrics and the
decision hooks), and the ``/route`` answer. Errors are ``app.core.errors.BadRequest`` naming
the field, and the core's ``NoWorkerError``.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import asdict
from typing import Any

import numpy as np
import numpy.typing as npt

from app.core.errors import BadRequest
from app.router import schemas
from app.router.policies import Candidate, Decision, Weights
from app.router.runtime import RouterRuntime

__all__ = ["decide", "explain", "prompt_words", "route_body", "routing_of"]


def prompt_words(
    runtime: RouterRuntime, prompt: str | list[int], param: str
) -> tuple[list[int], npt.NDArray[np.uint32]]:
    """The prompt as token ids, and as the uint32 words the hasher reads (one C-level pass,
    which is also the range check)."""
    if isinstance(prompt, str):
        if runtime.tokenizer is None:
            raise BadRequest(
                f"{param}: text prompts need the router's tokenizer (--tokenizer); "
                "send token ids instead",
                param=param,
            )
        tokens = runtime.tokenize(prompt)
    else:
        tokens = prompt
    if not tokens:
        raise BadRequest(f"{param}: must hold at least one token", param=param)
    if len(tokens) > runtime.settings.max_prompt_tokens:
        raise BadRequest(
            f"{param}: {len(tokens)} tokens; the router takes at most "
            f"{runtime.settings.max_prompt_tokens}",
            param=param,
        )
    try:
        words = np.frombuffer(array("I", tokens), dtype=np.uint32)
    except OverflowError:
        raise BadRequest(f"{param}: token ids must be within 0..2**32-1", param=param) from None
    return tokens, words


def routing_of(runtime: RouterRuntime, routing: schemas.Routing | None) -> tuple[str, Weights]:
    core = runtime.core
    if routing is None:
        return core.policy, core.weights
    weights = core.weights
    if routing.weights is not None:
        try:
            weights = weights.updated(**routing.weights.model_dump())
        except ValueError as exc:
            raise BadRequest(f"routing.weights: {exc}", param="routing.weights") from None
    return routing.policy or core.policy, weights


def decide(
    runtime: RouterRuntime,
    words: npt.NDArray[np.uint32],
    fields: schemas.PromptFields,
    request_id: str,
    kind: str,
    *,
    exclude: tuple[str, ...] = (),
) -> tuple[Decision, list[int], float]:
    """Hash the prompt and choose; (decision, block hashes, seconds it took)."""
    start = time.perf_counter()
    core = runtime.core
    policy, weights = routing_of(runtime, fields.routing)
    hashes = core.hashes(words, lora_task_id=fields.lora_task_id, cache_salt=fields.cache_salt)
    decision = core.decide(hashes, len(words), policy=policy, weights=weights, exclude=exclude)
    elapsed = time.perf_counter() - start
    runtime.metrics.observe_decision(decision, elapsed, len(words))
    runtime.on_decision(request_id, kind, decision, len(words), hashes)
    return decision, hashes, elapsed


def route_body(
    runtime: RouterRuntime, decision: Decision, num_tokens: int, seconds: float
) -> dict[str, Any]:
    view = runtime.core.workers.get(decision.worker)
    return {
        "worker": decision.worker,
        "url": view.url if view is not None else None,
        "policy": decision.policy,
        "expected_cached_tokens": decision.expected_cached_tokens,
        "fresh": decision.fresh,
        "num_tokens": num_tokens,
        "num_blocks": num_tokens // runtime.core.tokens_per_block,
        "decision_us": round(seconds * 1e6, 3),
        "costs": decision.costs,  # dataclasses: orjson writes them as objects
    }


def explain(runtime: RouterRuntime, decision: Decision, hashes: list[int]) -> list[dict[str, Any]]:
    core = runtime.core
    by_tier = core.index.find_matches_by_tier(hashes) if hashes else {}
    candidates: dict[str, Candidate] = {c.worker: c for c in core.candidates(hashes)}
    out: list[dict[str, Any]] = []
    for cost in decision.costs:
        c = candidates.get(cost.worker) or Candidate(worker=cost.worker)
        view = core.workers.get(cost.worker)
        depth, gpu = by_tier.get(cost.worker, (0, 0))
        out.append(
            {
                "worker": cost.worker,
                "state": view.state if view is not None else "gone",
                "stale_reason": view.stale_reason if view is not None else None,
                "matched_blocks": c.matched_blocks,
                "index_blocks": depth,
                "gpu_blocks": gpu,
                "host_blocks": depth - gpu,
                "predicted_blocks": c.matched_blocks - depth,
                "queued_prefill_tokens": c.queued_prefill_tokens,
                "running": c.running,
                "active_blocks": c.active_blocks,
                "free_blocks": c.free_blocks,
                "cost": asdict(cost),
            }
        )
    return out
