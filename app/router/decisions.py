"""The HTTP-free steps of a routing request, shared by the FastAPI routes and the fast path of
``POST /route``: the prompt (token ids, text or a chat, through its model's tokenizer) as a
``Prompt`` (the words the hasher reads, its model and session), per-request routing overrides,
the decision (observed by the metrics and the decision hooks), and the ``/route`` answer.
Errors are ``app.core.errors.BadRequest`` naming the field, and the core's ``NoWorkerError``.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.chat import ChatTemplateError
from app.core.errors import BadRequest
from app.router import schemas
from app.router.policies import Candidate, Decision, Weights
from app.router.runtime import RouterRuntime

__all__ = [
    "Prompt",
    "chat_prompt",
    "decide",
    "explain",
    "route_body",
    "routing_of",
    "text_prompt",
    "token_prompt",
]


@dataclass(slots=True)
class Prompt:
    """A request's prompt as the router places it: the words the hasher reads (none when the
    router has no tokenizer for its model: then it is placed by load alone, and ``note`` says
    so), its length in tokens (estimated from its text when not tokenized), the ids the worker
    is sent (the client's list, or ``words`` itself where the router encoded them; None when
    not tokenized), its model and its session."""

    words: npt.NDArray[np.uint32]
    num_tokens: int
    tokens: list[int] | npt.NDArray[np.uint32] | None
    model: str | None = None
    session: str | None = None
    note: str | None = None

    @property
    def tokenized(self) -> bool:
        return self.tokens is not None


_NO_WORDS: npt.NDArray[np.uint32] = np.zeros(0, dtype=np.uint32)
_CHARS_PER_TOKEN = 4  # an untokenized prompt's length, for load accounting only


def token_prompt(
    runtime: RouterRuntime,
    tokens: list[int],
    param: str,
    model: str | None = None,
    session: str | None = None,
) -> Prompt:
    """A prompt of token ids, checked (length, range: one C-level pass)."""
    _check_length(runtime, len(tokens), param)
    try:
        words = np.frombuffer(array("I", tokens), dtype=np.uint32)
    except OverflowError:
        raise BadRequest(f"{param}: token ids must be within 0..2**32-1", param=param) from None
    return Prompt(words, len(tokens), tokens, model, session)


def _encoded_prompt(
    runtime: RouterRuntime,
    words: npt.NDArray[np.uint32],
    param: str,
    model: str | None,
    session: str | None,
) -> Prompt:
    """A prompt the router's tokenizer encoded (ids in range by construction): its length
    checked. The array is the ids sent on too (orjson writes it as the list)."""
    _check_length(runtime, len(words), param)
    return Prompt(words, len(words), words, model, session)


def _check_length(runtime: RouterRuntime, num_tokens: int, param: str) -> None:
    if not num_tokens:
        raise BadRequest(f"{param}: must hold at least one token", param=param)
    if num_tokens > runtime.settings.max_prompt_tokens:
        raise BadRequest(
            f"{param}: {num_tokens} tokens; the router takes at most "
            f"{runtime.settings.max_prompt_tokens}",
            param=param,
        )


def _untokenized(text_length: int, model: str | None, session: str | None) -> Prompt:
    which = f"model {model!r}" if model is not None else "this request"
    note = (
        f"routed by load only: the router has no tokenizer for {which} (--model NAME=DIR or "
        "--tokenizer), so it cannot tell which worker holds its prefix"
    )
    return Prompt(_NO_WORDS, max(text_length // _CHARS_PER_TOKEN, 1), None, model, session, note)


def text_prompt(
    runtime: RouterRuntime,
    text: str,
    param: str,
    model: str | None = None,
    session: str | None = None,
) -> Prompt:
    """A text prompt, encoded as the engine encodes it (with the model's special tokens)."""
    tokenizer = runtime.tokenizer_for(model)
    if tokenizer is None:
        return _untokenized(len(text), model, session)
    return _encoded_prompt(runtime, tokenizer.encode_text_words(text), param, model, session)


def chat_prompt(
    runtime: RouterRuntime,
    messages: list[dict[str, Any]],
    options: dict[str, Any],
    model: str | None = None,
    session: str | None = None,
) -> Prompt:
    """A chat, rendered by the model's template and encoded as the engine does."""
    tokenizer = runtime.tokenizer_for(model)
    if tokenizer is None or not tokenizer.has_chat_template:
        size = sum(len(str(m.get("content") or "")) for m in messages)
        prompt = _untokenized(size, model, session)
        if tokenizer is not None:
            prompt.note = (
                f"routed by load only: the tokenizer at {tokenizer.path} has no chat template"
            )
        return prompt
    try:
        words = tokenizer.encode_chat_words(messages, **options)
    except ChatTemplateError as exc:
        raise BadRequest(f"messages: {exc}", param="messages") from None
    return _encoded_prompt(runtime, words, "messages", model, session)


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
    prompt: Prompt,
    fields: schemas.PromptFields | schemas.ChatBody,
    request_id: str,
    kind: str,
    *,
    exclude: tuple[str, ...] = (),
) -> tuple[Decision, list[int], float]:
    """Hash the prompt and choose among its model's workers; (decision, block hashes,
    seconds it took)."""
    start = time.perf_counter()
    core = runtime.core
    policy, weights = routing_of(runtime, fields.routing)
    array = None
    hashes: list[int] = []
    if prompt.tokens is not None:
        salt = fields.cache_salt
        array = core.hash_array(prompt.words, lora_task_id=fields.lora_task_id, cache_salt=salt)
        hashes = array.tolist()
    decision = core.decide(
        hashes,
        prompt.num_tokens,
        policy=policy,
        weights=weights,
        exclude=exclude,
        model=prompt.model,
        session=prompt.session,
        hash_array=array,
    )
    elapsed = time.perf_counter() - start
    runtime.metrics.observe_decision(decision, elapsed, prompt.num_tokens)
    runtime.on_decision(request_id, kind, decision, prompt.num_tokens, hashes)
    return decision, hashes, elapsed


def route_body(
    runtime: RouterRuntime, decision: Decision, prompt: Prompt, seconds: float
) -> dict[str, Any]:
    view = runtime.core.workers.get(decision.worker)
    num_tokens = prompt.num_tokens
    return {
        "worker": decision.worker,
        "url": view.url if view is not None else None,
        "model": view.model if view is not None else prompt.model,
        "policy": decision.policy,
        "expected_cached_tokens": decision.expected_cached_tokens,
        "fresh": decision.fresh,
        "tokenized": prompt.tokenized,
        "note": prompt.note,
        "num_tokens": num_tokens,
        "num_blocks": num_tokens // runtime.core.tokens_per_block if prompt.tokenized else 0,
        "decision_us": round(seconds * 1e6, 3),
        "costs": decision.costs,  # dataclasses: orjson writes them as objects
    }


def explain(
    runtime: RouterRuntime, decision: Decision, hashes: list[int], prompt: Prompt
) -> list[dict[str, Any]]:
    core = runtime.core
    by_tier = core.index.find_matches_by_tier(hashes) if hashes else {}
    candidates: dict[str, Candidate] = {
        c.worker: c for c in core.candidates(hashes, model=prompt.model, session=prompt.session)
    }
    out: list[dict[str, Any]] = []
    for cost in decision.costs:
        c = candidates.get(cost.worker) or Candidate(worker=cost.worker)
        view = core.workers.get(cost.worker)
        depth, gpu = by_tier.get(cost.worker, (0, 0))
        out.append(
            {
                "worker": cost.worker,
                "state": view.state if view is not None else "gone",
                "model": view.model if view is not None else None,
                "approximate": view.approximate if view is not None else False,
                "other_routers": {
                    "prefill_tokens": view.remote_prefill_tokens if view is not None else 0,
                    "running": view.remote_running if view is not None else 0,
                    "blocks": view.remote_blocks if view is not None else 0,
                },
                "session": c.session,
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
