"""``POST /v1/chat/completions`` on a worker with a tokenizer: the chat as a job, and the job's
output as OpenAI's ``chat.completion`` (or its ``chat.completion.chunk`` stream).

The prompt is the router's ``prompt_token_ids`` when it sent them (it rendered the chat with
the same tokenizer, so rendering twice would only cost time), else the chat rendered here. A
worker without a tokenizer serves no chat: its answer could not be text.
Generated ids are decoded with the tokenizer; ``stop`` strings end the answer where the first
one appears (``finish_reason: "stop"``), as OpenAI's servers do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson

from app.chat import ChatCompletionRequest, ChatTemplateError, ModelTokenizer
from app.chat.detokenize import IncrementalText
from app.core.errors import BadRequest
from app.worker.completions import tokens_job, usage
from app.worker.engine import Engine, Job
from app.worker.settings import ModelShape

__all__ = ["chat_body", "chat_job", "chat_stream", "stop_watch"]


def chat_job(
    body: ChatCompletionRequest,
    tokenizer: ModelTokenizer | None,
    shape: ModelShape,
    capacity_blocks: int,
) -> Job:
    """Check a chat request and render it (unless the router sent its ids); a Job or
    BadRequest naming the field."""
    if tokenizer is None:  # even with the router's ids: its answer could not be text
        raise BadRequest(
            "messages: this worker has no tokenizer (--tokenizer DIR) to serve a chat with",
            param="messages",
        )
    words = None
    if body.prompt_token_ids is not None:
        tokens, param = body.prompt_token_ids, "prompt_token_ids"
    else:
        try:
            words = tokenizer.encode_chat_words(body.template_messages(), **body.render_options())
        except ChatTemplateError as exc:
            raise BadRequest(f"messages: {exc}", param="messages") from None
        tokens, param = words.tolist(), "messages"
    return tokens_job(
        tokens,
        param,
        body.completion_tokens,
        shape,
        capacity_blocks,
        request_id=body.request_id,
        priority=body.priority,
        lora_task_id=body.lora_task_id,
        cache_salt=body.cache_salt,
        prefix="chatcmpl",
        words=words,
    )


def _stops(body: ChatCompletionRequest) -> list[str]:
    stop = body.stop
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def _cut(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the first stop string starts in ``text`` (at ``start`` or later), or None."""
    found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(found) if found else None


def _rescan_from(text: str, stops: Sequence[str]) -> int:
    """Where the next search of a longer ``text`` must start: a stop string that was not in
    ``text`` may end in what is added, so it starts at most its length - 1 before the end."""
    return max(len(text) - max((len(s) for s in stops), default=1) + 1, 0)


def _text(tokenizer: ModelTokenizer | None, ids: Sequence[int]) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else ""


def chat_body(
    job: Job,
    body: ChatCompletionRequest,
    tokenizer: ModelTokenizer | None,
    model: str,
    created: int,
    timings: dict[str, Any],
) -> dict[str, Any]:
    """The ``chat.completion`` of a finished job."""
    text = _text(tokenizer, job.output)
    finish: str | None = job.finish_reason
    cut = _cut(text, _stops(body))
    if cut is not None:
        text, finish = text[:cut], "stop"
    return {
        "id": job.job_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
                "token_ids": job.output,
            }
        ],
        "usage": usage(job),
        "kvmesh": timings,
    }


async def stop_watch(
    engine: Engine, job: Job, body: ChatCompletionRequest, tokenizer: ModelTokenizer | None
) -> None:
    """Cancel ``job`` once its text holds a stop string (a non-streamed answer's end: the
    tokens after it are not generated, as the stream does)."""
    stops = _stops(body)
    if not stops or tokenizer is None:
        return
    incremental = IncrementalText(tokenizer)
    start = 0
    while not job.finished:
        job.updated.clear()
        text = incremental.update(job.output)
        if _cut(text, stops, start) is not None:
            engine.cancel(job.job_id)
            return
        start = _rescan_from(text, stops)
        await job.updated.wait()


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def chat_stream(
    engine: Engine,
    job: Job,
    body: ChatCompletionRequest,
    tokenizer: ModelTokenizer | None,
    model: str,
    created: int,
) -> AsyncIterator[bytes]:
    """OpenAI's chunk stream: the role first, a content delta per engine step, a chunk with
    the finish reason, the usage chunk when ``stream_options.include_usage``, ``[DONE]``. A
    client that goes away cancels the job."""
    stops = _stops(body)

    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        return _sse(
            {
                "id": job.job_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            }
        )

    sent_text = ""
    finish: str | None = None
    role_sent = False
    # Decoded as it comes: a window of ids per step, not the whole output (O(n) a token).
    incremental = IncrementalText(tokenizer) if tokenizer is not None else None
    start = 0  # where the next search for a stop string starts
    try:
        while finish is None:
            job.updated.clear()
            if job.output or job.finished:
                # The role goes with the first output, not before: a router takes the first
                # chunk of a stream as the end of the request's prefill.
                if not role_sent:
                    yield chunk({"role": "assistant", "content": ""}, None)
                    role_sent = True
                if incremental is None:
                    text = ""
                elif job.finished:
                    incremental.update(job.output)
                    text = incremental.final()
                else:
                    text = incremental.update(job.output)
                cut = _cut(text, stops, start)
                start = _rescan_from(text, stops)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    engine.cancel(job.job_id)
                elif job.finished:
                    finish = job.finish_reason or "length"
                # Hold back what could still become a stop string, and a partial character.
                ready = text if finish is not None else text[: len(text) - _held(text, stops)]
                if len(ready) > len(sent_text):
                    # (A byte-fallback decoder may re-decode bytes already sent differently;
                    # then the client's text differs there, but nothing is dropped.)
                    yield chunk({"content": ready[len(sent_text) :]}, None)
                    sent_text = ready
            if finish is None:
                await job.updated.wait()
        yield chunk({}, finish)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse(
                {
                    "id": job.job_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(job),
                }
            )
        yield b"data: [DONE]\n\n"
    finally:
        if not job.finished:
            engine.cancel(job.job_id)


def _held(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` not to send yet: the trailing replacement characters
    (a UTF-8 sequence the next tokens complete: a byte-fallback decoder gives one per byte, and
    may decode them again as one character), or the start of a stop string."""
    held = len(text) - len(text.rstrip("\ufffd"))
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                held = max(held, n)
                break
    return held
