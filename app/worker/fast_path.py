"""The fast path of ``POST /v1/completions``: a plain body answered without FastAPI's request
machinery, and what it shares with the FastAPI route (waiting on a job, the engine's refusals).

At 1,000 requests a second FastAPI's layers (middleware, dependency solving, model validation,
the response's trip back through them) were a quarter of the worker's CPU, more than the block
manager's own work in some steps. A plain body is a JSON object whose ``prompt`` is a non-empty
array of plain decimal integers in 0..2**32-1 (``app.core.token_json`` scans them into uint32
words, which the manager then hashes, without a Python int per id in between), with at most the
schema's other fields, each of its exact JSON type and in range (``max_tokens``, ``priority``,
``request_id``, ``lora_task_id``, ``cache_salt``, ``model``; ``stream`` false; ``retention``
null), and any other keys (ignored, as the schema allows). Everything else goes to the FastAPI
route, which answers it exactly as before: text prompts, streams, retention, values the schema
would coerce (``"4"``, ``2.0``, a ``true`` among the ids), a second prompt
(``prompt_token_ids``, or ``prompt`` twice), anything it refuses, malformed JSON, a body not
sent as JSON, a streamed body or one past the body limit (``BodyLimit``'s), a query string, and
every request the checks of ``tokens_job`` refuse (400).
The engine's refusals (429, 503, 409) are answered here, by the same mapping as the route's
(``refusal``). The OpenAPI schema is the FastAPI route's. ``CompletionFastPath`` runs in front
of the framework's middleware (it is the server's outermost app), whose layers it skips; and
its ``fast_routes`` answer the same bodies from the server's protocol, before any ASGI cycle
(``app.core.fast_http``), where a client that leaves cancels its job as a disconnect does here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from app.core.asgi import plain_json, plain_json_headers, read_body, replay, send_json
from app.core.errors import BadRequest
from app.core.fast_http import FastRoute, RawAnswer
from app.core.middleware import error_body
from app.core.token_json import parse_token_body
from app.worker.completions import completion_body, tokens_job
from app.worker.engine import (
    DrainingError,
    DuplicateJobError,
    Engine,
    EngineError,
    Job,
    QueueFullError,
)
from app.worker.runtime import WorkerRuntime
from app.worker.schemas import MAX_U64
from app.worker.settings import ModelShape

__all__ = ["CompletionFastPath", "Refusal", "await_job", "failed_job", "refusal"]

PATH = "/v1/completions"
_PRIORITY_MAX = 1_000_000
_DEFAULT_MAX_TOKENS = 16

# (status, message, OpenAI type, param, headers)
Refusal = tuple[int, str, str, str | None, dict[str, str]]


def refusal(exc: EngineError) -> Refusal:
    """The answer to an engine's refusal, for the route's exception handler and the fast path."""
    if isinstance(exc, QueueFullError):
        return 429, str(exc), "rate_limit_error", None, {"Retry-After": "1"}
    if isinstance(exc, DrainingError):
        return 503, str(exc), "unavailable_error", None, {"Retry-After": "5"}
    if isinstance(exc, DuplicateJobError):
        return 409, str(exc), "conflict_error", "request_id", {}
    return 503, str(exc), "unavailable_error", None, {"Retry-After": "1"}


def failed_job(job: Job) -> Refusal | None:
    """The answer to a job the engine failed (503), else None."""
    if job.finish_reason == "error":
        return 503, job.error or "the engine failed", "engine_error", None, {"Retry-After": "1"}
    return None


async def _cancel_on_disconnect(engine: Engine, job: Job, receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            engine.cancel(job.job_id)
            return


async def await_job(engine: Engine, job: Job, receive: Receive | None = None) -> None:
    """Wait for a submitted job to finish; a client that goes away cancels it: ``receive``
    says ``http.disconnect`` (an ASGI cycle), or this coroutine is cancelled (the server
    protocol's fast route, whose connection was lost; a handler cancelled)."""
    watch = (
        None
        if receive is None
        else asyncio.get_running_loop().create_task(_cancel_on_disconnect(engine, job, receive))
    )
    try:
        await job.done
    finally:
        if watch is not None:
            watch.cancel()
        if not job.finished:  # this coroutine was cancelled
            engine.cancel(job.job_id)


def _optional_str(value: Any, longest: int) -> bool:
    return value is None or (type(value) is str and 0 < len(value) <= longest)


def plain_job(runtime: WorkerRuntime, body: bytes, shape: ModelShape) -> Job | None:
    """The Job of a plain body (see the module docstring), or None: the route answers it.
    ``shape``: ``runtime.settings.shape`` (a property that builds it, 10 µs a request)."""
    parsed = parse_token_body(body)  # the ids scanned into uint32 words, no int per id
    if parsed is None or parsed.key != "prompt":
        return None
    data = parsed.fields
    max_tokens = data.get("max_tokens", _DEFAULT_MAX_TOKENS)
    priority = data.get("priority", 0)
    request_id = data.get("request_id")
    lora = data.get("lora_task_id")
    salt = data.get("cache_salt")
    if (
        type(max_tokens) is not int
        or max_tokens < 1
        or type(priority) is not int
        or not -_PRIORITY_MAX <= priority <= _PRIORITY_MAX
        or not _optional_str(request_id, 128)
        or (lora is not None and (type(lora) is not int or not 0 <= lora <= MAX_U64))
        or not _optional_str(salt, 256)
        or not (type(model := data.get("model")) is str or model is None)
        or data.get("stream", False) is not False
        or data.get("retention") is not None
    ):
        return None
    words = parsed.words.copy()  # kept by the job: not a view of the scan's larger buffer
    try:
        return tokens_job(
            words.tolist(),  # the manager's keys are made of ints
            "prompt",
            max_tokens,
            shape,
            runtime.capacity_blocks,
            request_id=request_id,
            priority=priority,
            lora_task_id=lora,
            cache_salt=salt,
            words=words,
        )
    except BadRequest:
        return None


class CompletionFastPath:
    """The outermost ASGI app (``app.state.asgi_front``, what a server runs: ``app.core.http``):
    plain ``POST /v1/completions`` bodies answered here, every other request, lifespan
    included, passed to ``app`` unchanged; see the module docstring."""

    def __init__(self, app: FastAPI, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._shape: tuple[WorkerRuntime, ModelShape] | None = None  # the runtime's, once

    def _shape_of(self, runtime: WorkerRuntime) -> ModelShape:
        known = self._shape
        if known is None or known[0] is not runtime:
            known = self._shape = (runtime, runtime.settings.shape)
        return known[1]

    def start(self, body: bytes) -> tuple[WorkerRuntime, Job | Refusal] | None:
        """A plain body's job, submitted to the engine, or the engine's refusal of it; None
        when the body is not plain (or the worker not started): the FastAPI route answers."""
        runtime: WorkerRuntime | None = getattr(self.app.state, "runtime", None)
        if runtime is None:
            return None
        job = plain_job(runtime, body, self._shape_of(runtime))
        if job is None:
            return None
        try:
            runtime.engine.submit(job)
        except EngineError as exc:
            return runtime, refusal(exc)
        return runtime, job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != PATH
            or scope["method"] != "POST"
            or scope["query_string"]
            or not plain_json(scope, self.max_body_bytes)
        ):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client went away
            return
        started = self.start(body)
        if started is None:
            await self.app(scope, replay(body, receive), send)
            return
        runtime, job = started
        if not isinstance(job, Job):
            await _refuse(send, job)
            return
        created = int(time.time())
        await await_job(runtime.engine, job, receive)
        failed = failed_job(job)
        if failed is not None:
            await _refuse(send, failed)
            return
        await send_json(send, 200, _completion(runtime, job, created))

    def fast_routes(self) -> dict[bytes, FastRoute]:
        """``POST /v1/completions`` in the server's protocol (``app.core.fast_http``): a plain
        body answered as ``__call__`` answers it, without uvicorn's ASGI request cycle (a
        scope, a task, two sends); the connection's loss cancels the job, as a disconnect
        does there. Anything else goes on to ``__call__`` and the framework, unchanged."""

        def completion(
            headers: list[tuple[bytes, bytes]], body: bytes
        ) -> Coroutine[Any, Any, RawAnswer] | None:
            if not plain_json_headers(headers, self.max_body_bytes):
                return None
            started = self.start(body)
            return None if started is None else _answer_later(*started)

        return {PATH.encode(): completion}


def _completion(runtime: WorkerRuntime, job: Job, created: int) -> bytes:
    settings = runtime.settings
    return orjson.dumps(
        completion_body(job, settings.worker_id, settings.model_name, created, runtime.tokenizer)
    )


_JSON = (b"content-type", b"application/json")


async def _answer_later(runtime: WorkerRuntime, job: Job | Refusal) -> RawAnswer:
    """A fast route's answer: the job's completion once it is done (cancelled if this
    coroutine is: the client left), or the refusal."""
    if not isinstance(job, Job):
        return _raw_refusal(job)
    created = int(time.time())
    await await_job(runtime.engine, job)
    failed = failed_job(job)
    if failed is not None:
        return _raw_refusal(failed)
    return 200, [_JSON], _completion(runtime, job, created)


def _raw_refusal(answer: Refusal) -> RawAnswer:
    status, message, kind, param, headers = answer
    raw = [_JSON] + [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    return status, raw, orjson.dumps(error_body(message, kind, param))


async def _refuse(send: Send, answer: Refusal) -> None:
    status, message, kind, param, headers = answer
    await send_json(send, status, orjson.dumps(error_body(message, kind, param)), headers)
