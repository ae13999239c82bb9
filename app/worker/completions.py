"""Completion requests: checked against the model and the cache, turned into engine jobs; and
finished jobs turned into OpenAI completions. Plain functions, no HTTP; a request that cannot
be served as it is raises ``app.core.errors.BadRequest`` naming the field.
"""

from __future__ import annotations

import uuid
from array import array
from typing import Any

import numpy as np
import numpy.typing as npt

from app.chat import ModelTokenizer
from app.core.errors import BadRequest
from app.worker import schemas
from app.worker.backend import prompt_seed
from app.worker.engine import Job
from app.worker.settings import ModelShape
from cache import InvalidRetentionConfigError, RetentionConfig, TokenRangeRetention, cache_salt_id

__all__ = ["completion_body", "make_job", "timings_of", "token_words", "tokens_job", "usage"]


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
    prompt_tokens: int, max_tokens: int, shape: ModelShape, capacity_blocks: int, param: str
) -> None:
    """The prompt and its completion must fit the model's window and the worker's cache. The
    error names the field to change: ``prompt`` when the prompt leaves no room for even one
    generated token (max_tokens is at least 1, so no max_tokens would do), else ``max_tokens``
    (as vLLM words it)."""
    window = shape.max_seq_len
    if prompt_tokens >= window:
        raise BadRequest(
            f"{param}: {prompt_tokens} tokens; this model's window is {window} tokens "
            f"(prompt + max_tokens), so a prompt takes at most {window - 1}",
            param=param,
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
            f"{param}: {prompt_tokens} tokens and one generated need {least} KV cache blocks, "
            f"the worker has {capacity_blocks}",
            param=param,
        )
    need = -(-total // tpb)
    if need > capacity_blocks:
        raise BadRequest(
            f"max_tokens: the request needs {need} KV cache blocks, the worker has "
            f"{capacity_blocks}",
            param="max_tokens",
        )


def make_job(
    body: schemas.CompletionRequest,
    shape: ModelShape,
    capacity_blocks: int,
    tokenizer: ModelTokenizer | None = None,
) -> Job:
    """Check a completion request against the model and the cache size; a Job or BadRequest.
    A text prompt needs the worker's tokenizer (encoded as the engine would: with its special
    tokens)."""
    prompt, words = body.prompt, None
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest(
                "prompt: this worker has no tokenizer (--tokenizer); send token ids, or text "
                "to the router",
                param="prompt",
            )
        words = tokenizer.encode_text_words(prompt)
        prompt = words.tolist()
    elif prompt and isinstance(prompt[0], str):
        raise BadRequest("prompt: one prompt per request (a string)", param="prompt")
    if prompt and isinstance(prompt[0], list):
        raise BadRequest("prompt: one prompt per request (a list of token ids)", param="prompt")
    return tokens_job(
        prompt,  # type: ignore[arg-type]
        "prompt",
        body.max_tokens,
        shape,
        capacity_blocks,
        request_id=body.request_id,
        priority=body.priority,
        lora_task_id=body.lora_task_id,
        cache_salt=body.cache_salt,
        retention=body.retention,
        words=words,
    )


def token_words(tokens: list[Any]) -> array[int] | None:
    """The ids as unsigned 32-bit words, in one C-level pass (a quarter of ``min`` + ``max``
    over 4,096 ids); None when one is not an int in 0..2**32-1 (a bool counts as its int)."""
    try:
        return array("I", tokens)
    except (OverflowError, TypeError):
        return None


def tokens_job(
    tokens: list[int],
    param: str,
    max_tokens: int,
    shape: ModelShape,
    capacity_blocks: int,
    *,
    request_id: str | None,
    priority: int,
    lora_task_id: int | None,
    cache_salt: str | None,
    retention: schemas.Retention | None = None,
    prefix: str = "cmpl",
    words: array[int] | npt.NDArray[np.uint32] | None = None,
) -> Job:
    """A Job for a prompt of token ids (``param`` names the field they came from), checked
    against the vocabulary, the model's window and the cache size. ``words``: the ids'
    ``token_words``, where the caller has them already."""
    if not tokens:
        raise BadRequest(f"{param}: must hold at least one token id", param=param)
    if words is None:
        words = token_words(tokens)
    if words is not None:  # all in 0..2**32-1: only the top of the vocabulary to check
        low, high = 0, int(np.frombuffer(words, dtype=np.uint32).max())
    else:
        low, high = min(tokens), max(tokens)
    if low < 0 or high >= shape.vocab_size:
        bad = low if low < 0 else high
        raise BadRequest(
            f"{param}: token id {bad} at index {tokens.index(bad)} is outside the vocabulary "
            f"0..{shape.vocab_size - 1}",
            param=param,
        )
    _check_length(len(tokens), max_tokens, shape, capacity_blocks, param)
    return Job(
        job_id=request_id or f"{prefix}-{uuid.uuid4().hex}",
        prompt=tokens,
        max_tokens=max_tokens,
        seed=prompt_seed(tokens),
        priority=priority,
        lora_task_id=lora_task_id,
        cache_salt=cache_salt,
        cache_salt_id=cache_salt_id(cache_salt) if cache_salt is not None else None,
        retention=_retention(retention) if retention is not None else None,
        words=words,
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


def timings_of(worker_id: str, job: Job) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "request_id": job.job_id,
        "queue_ms": _ms(job.arrival_s, job.admitted_s),
        "ttft_ms": _ms(job.arrival_s, job.first_token_s),
        "e2e_ms": _ms(job.arrival_s, job.finished_s),
        "preemptions": job.num_preemptions,
    }


def completion_body(
    job: Job, worker_id: str, model: str, created: int, tokenizer: ModelTokenizer | None = None
) -> dict[str, Any]:
    """The OpenAI completion of a finished job, with kvmesh's timings; ``text`` is the output
    decoded when the worker has a tokenizer (``token_ids`` always)."""
    return {
        "id": job.job_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": tokenizer.decode(job.output) if tokenizer is not None else "",
                "token_ids": job.output,
                "logprobs": None,
                "finish_reason": job.finish_reason,
            }
        ],
        "usage": usage(job),
        "kvmesh": timings_of(worker_id, job),
    }
