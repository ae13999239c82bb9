"""Completion requests: checked against the model and the cache, turned into engine jobs; and
finished jobs turned into OpenAI completions. Plain functions, no HTTP; a request that cannot
be served as it is raises ``app.core.errors.BadRequest`` naming the field.
"""

from __future__ import annotations

import uuid
from typing import Any

from app.core.errors import BadRequest
from app.worker import schemas
from app.worker.backend import prompt_seed
from app.worker.engine import Job
from app.worker.settings import ModelShape
from cache import InvalidRetentionConfigError, RetentionConfig, TokenRangeRetention, cache_salt_id

__all__ = ["completion_body", "make_job", "usage"]


def _retention(spec: schemas.Retention) -> RetentionConfig:
    try:
        return RetentionConfig(
            ranges=[
                TokenRangeRetention(r.start, r.end, r.priority, r.duration_s) for r in spec.ranges
            ],
            decode_priority=spec.decode_priority,
            decode_duration_s=spec.decode_duration_s,
        )
    except InvalidRetentionConfigError as exc:
        raise BadRequest(f"retention: {exc}", param="retention") from None


def _check_length(
    prompt_tokens: int, max_tokens: int, shape: ModelShape, capacity_blocks: int
) -> None:
    """The prompt and its completion must fit the model's window and the worker's cache. The
    error names the field to change: ``prompt`` when the prompt leaves no room for even one
    generated token (max_tokens is at least 1, so no max_tokens would do), else ``max_tokens``
    (as vLLM words it)."""
    window = shape.max_seq_len
    if prompt_tokens >= window:
        raise BadRequest(
            f"prompt: {prompt_tokens} tokens; this model's window is {window} tokens "
            f"(prompt + max_tokens), so a prompt takes at most {window - 1}",
            param="prompt",
        )
    total = prompt_tokens + max_tokens
    if total > window:
        raise BadRequest(
            f"max_tokens: this model's maximum context length is {window} tokens; you "
            f"requested {total} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion): lower max_tokens to at most {window - prompt_tokens}",
            param="max_tokens",
        )
    tpb = shape.tokens_per_block
    least = -(-(prompt_tokens + 1) // tpb)
    if least > capacity_blocks:
        raise BadRequest(
            f"prompt: {prompt_tokens} tokens and one generated need {least} KV cache blocks, "
            f"the worker has {capacity_blocks}",
            param="prompt",
        )
    need = -(-total // tpb)
    if need > capacity_blocks:
        raise BadRequest(
            f"max_tokens: the request needs {need} KV cache blocks, the worker has "
            f"{capacity_blocks}",
            param="max_tokens",
        )


def make_job(body: schemas.CompletionRequest, shape: ModelShape, capacity_blocks: int) -> Job:
    """Check a completion request against the model and the cache size; a Job or BadRequest."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        raise BadRequest(
            "prompt: a worker takes token ids; send text prompts to the router", param="prompt"
        )
    if prompt and isinstance(prompt[0], list):
        raise BadRequest("prompt: one prompt per request (a list of token ids)", param="prompt")
    tokens: list[int] = prompt  # type: ignore[assignment]
    if not tokens:
        raise BadRequest("prompt: must hold at least one token id", param="prompt")
    low, high = min(tokens), max(tokens)
    if low < 0 or high >= shape.vocab_size:
        bad = low if low < 0 else high
        raise BadRequest(
            f"prompt: token id {bad} at index {tokens.index(bad)} is outside the vocabulary "
            f"0..{shape.vocab_size - 1}",
            param="prompt",
        )
    _check_length(len(tokens), body.max_tokens, shape, capacity_blocks)
    retention = _retention(body.retention) if body.retention is not None else None
    return Job(
        job_id=body.request_id or f"cmpl-{uuid.uuid4().hex}",
        prompt=tokens,
        max_tokens=body.max_tokens,
        seed=prompt_seed(tokens),
        priority=body.priority,
        lora_task_id=body.lora_task_id,
        cache_salt=body.cache_salt,
        cache_salt_id=cache_salt_id(body.cache_salt) if body.cache_salt is not None else None,
        retention=retention,
    )


# -- responses ---------------------------------------------------------------------------------


def _ms(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round((end - start) * 1e3, 3)


def usage(job: Job) -> dict[str, Any]:
    prompt_tokens = len(job.prompt)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(job.output),
        "total_tokens": prompt_tokens + len(job.output),
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }


def _timings(worker_id: str, job: Job) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "request_id": job.job_id,
        "queue_ms": _ms(job.arrival_s, job.admitted_s),
        "ttft_ms": _ms(job.arrival_s, job.first_token_s),
        "e2e_ms": _ms(job.arrival_s, job.finished_s),
        "preemptions": job.num_preemptions,
    }


def completion_body(job: Job, worker_id: str, model: str, created: int) -> dict[str, Any]:
    """The OpenAI completion of a finished job, with kvmesh's timings."""
    return {
        "id": job.job_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": "",
                "token_ids": job.output,
                "logprobs": None,
                "finish_reason": job.finish_reason,
            }
        ],
        "usage": usage(job),
        "kvmesh": _timings(worker_id, job),
    }
