"""Forwarding a completion to the chosen worker: the FastAPI routes' and the fast path's.

The hop goes through ``runtime.upstream`` (``app.router.upstream``: keep-alive HTTP/1.1 on an
asyncio protocol, httpx for other schemes than ``http``). A worker that fails before answering
(connection refused or reset, a timeout on connecting, or a 502/503/504) is tried once more on
the next best worker; if that fails too the client gets a 502 naming both. A worker's own
answer (a 4xx about the request, say) is passed through as it came, with the worker's id in
``x-kvmesh-worker``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi.responses import Response, StreamingResponse

from app.core.errors import BadRequest
from app.core.http import error
from app.core.middleware import error_body
from app.router import schemas
from app.router.core import NoWorkerError
from app.router.decisions import Prompt, decide
from app.router.runtime import RouterRuntime
from app.router.upstream import UPSTREAM_ERRORS, UpstreamResponse

__all__ = ["no_worker_response", "proxy", "request_id_of"]

_RETRY_STATUSES = frozenset((502, 503, 504))

# What a worker is sent, by whether it is an engine behind ``kvmesh ingest`` (``foreign``).
Payload = Callable[[bool], bytes]


def request_id_of(runtime: RouterRuntime, given: str | None, prefix: str) -> str:
    request_id = given or f"{prefix}-{os.urandom(16).hex()}"  # (no UUID object: 2 µs less)
    if request_id in runtime.core.inflight:
        raise BadRequest(f"request_id: {request_id!r} is already in flight", param="request_id")
    return request_id


def no_worker_response(runtime: RouterRuntime, exc: NoWorkerError) -> Response:
    """The 503 of no worker to send to, with its Retry-After."""
    retry_after = str(runtime.settings.retry_after_s)
    return error(503, str(exc), "unavailable_error", None, **{"Retry-After": retry_after})


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def proxy(
    runtime: RouterRuntime,
    fields: schemas.PromptFields | schemas.ChatBody,
    stream: bool,
    prompt: Prompt,
    request_id: str,
    path: str,
    payload: Payload,
) -> Response:
    """Send to the best worker; once more to the next best if the first fails before
    answering. A kvmesh worker gets ``payload(False)`` (the router's token ids and request
    id), an engine behind ``kvmesh ingest`` ``payload(True)`` (the client's body as it came,
    less ``routing``): it tokenizes the prompt itself."""
    core = runtime.core
    metrics = runtime.metrics
    tried: list[str] = []
    failures: list[str] = []
    for _attempt in range(2):
        decision, hashes, _ = decide(
            runtime, prompt, fields, request_id, "completion", exclude=tuple(tried)
        )
        worker = decision.worker
        tried.append(worker)
        view = core.workers[worker]
        url = f"{view.url}{path}"
        core.begin(request_id, decision, hashes, prompt.num_tokens, prompt.session)
        relayed = False  # the flight is then _relay's to finish
        try:
            try:
                upstream = await runtime.upstream.post(url, payload(view.foreign))
            except UPSTREAM_ERRORS as exc:
                core.finish(request_id)
                core.unpredict(worker, hashes)  # it never got the request
                failures.append(f"{worker}: {type(exc).__name__}")
                metrics.retries.inc()
                continue
            if upstream.status_code in _RETRY_STATUSES:
                await upstream.aclose()
                core.finish(request_id)
                core.unpredict(worker, hashes)
                failures.append(f"{worker}: HTTP {upstream.status_code}")
                metrics.retries.inc()
                continue
            headers = {"x-kvmesh-worker": worker}
            if stream and upstream.status_code == 200:
                response = StreamingResponse(
                    _relay(runtime, request_id, upstream),
                    status_code=upstream.status_code,
                    media_type=upstream.headers.get("content-type", "text/event-stream"),
                    headers=headers,
                )
                relayed = True
                return response
            try:
                data = await upstream.aread()
            except UPSTREAM_ERRORS as exc:
                failures.append(f"{worker}: {type(exc).__name__} while reading")
                return error(502, f"worker {worker} failed mid-response", "upstream_error")
            finally:
                await upstream.aclose()
        except asyncio.CancelledError:  # the client left (``app.core.fast_http``): nginx's 499
            metrics.count_completion(worker, 499)
            raise
        finally:  # whatever happened (an unexpected exception too), no flight is left behind
            if not relayed:
                core.finish(request_id)
        metrics.count_completion(worker, upstream.status_code)
        return Response(
            data,
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type", "application/json"),
            headers=headers,
        )
    metrics.count_completion("", 502)
    return error(
        502,
        f"no worker answered: {'; '.join(failures)}",
        "upstream_error",
    )


async def _relay(
    runtime: RouterRuntime, request_id: str, upstream: UpstreamResponse
) -> AsyncIterator[bytes]:
    """Pass a worker's stream through chunk by chunk; the first chunk ends the prefill."""
    core = runtime.core
    worker = core.inflight[request_id].worker if request_id in core.inflight else ""
    status = 200
    try:
        async for chunk in upstream.aiter_raw():
            core.prefilled(request_id)
            yield chunk
    except UPSTREAM_ERRORS:
        status = 502
        yield _sse(error_body("the worker failed mid-stream", "upstream_error"))
    finally:
        await upstream.aclose()
        core.finish(request_id)
        runtime.metrics.count_completion(worker, status)
