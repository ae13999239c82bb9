"""The worker's HTTP API: OpenAI-compatible completions, the admin API, health and metrics.

Handlers are thin: they validate, then hand work to the engine (``submit``, ``cancel``, or
``call`` for anything that reads or changes the manager). A plain ``POST /v1/completions`` is
answered below FastAPI by ``app.worker.fast_path``, with the same checks and answers; the route
here answers the rest and is what ``/docs`` shows. Errors are mapped to HTTP once, in
the exception handlers below, as OpenAI's error shape ``{"error": {"message", "type",
"param", "code"}}``::

    RequestValidationError, BadRequest, InvalidRetentionConfigError   400
    missing bearer token                                               401
    admin calls disabled, or a wrong token                             403
    NotFound, UnknownBlockError, UnknownRequestError                   404
    DuplicateJobError, PinConflictError, Conflict                      409
    (BadRequest, NotFound, Conflict: ``app.core.errors``)
    body over max_body_bytes                                           413
    QueueFullError                                                     429 + Retry-After
    DrainingError                                                      503 + Retry-After

Mutating admin calls need ``Authorization: Bearer <KVMESH_ADMIN_TOKEN>``, compared in constant
time; with no token configured they are refused, never open.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse

from app.chat import ChatCompletionRequest
from app.chat.detokenize import IncrementalText
from app.core.errors import Conflict, NotFound
from app.core.http import (
    OrjsonResponse,
    OrjsonRoute,
    admin_dependency,
    error,
    error_responses,
    install_error_handlers,
)
from app.core.lifespan import runtime_of
from app.core.middleware import BodyLimit
from app.worker import schemas
from app.worker.chat import chat_body, chat_job, chat_stream, stop_watch
from app.worker.completions import completion_body, make_job, timings_of
from app.worker.engine import EngineError, Job
from app.worker.fast_path import CompletionFastPath, await_job, failed_job, refusal
from app.worker.metrics import CONTENT_TYPE
from app.worker.runtime import WorkerRuntime
from app.worker.settings import WorkerSettings
from cache import (
    InvalidRetentionConfigError,
    KVCacheBlock,
    KVCacheManager,
    PinConflictError,
    UnknownBlockError,
    UnknownRequestError,
)
from events.snapshot import manager_snapshot

__all__ = ["install"]


_error = error


Runtime = Annotated[WorkerRuntime, Depends(runtime_of)]


def _admin(settings: WorkerSettings) -> Any:
    return admin_dependency(settings.admin_token, "worker")


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


async def _stream(runtime: WorkerRuntime, job: Job, created: int) -> AsyncIterator[bytes]:
    """One chunk per engine step (tokens produced since the last chunk), a last chunk with the
    finish reason and usage, then ``[DONE]``. A client that goes away cancels the job."""
    sent = 0
    model = runtime.settings.model_name
    tokenizer = runtime.tokenizer
    # With a tokenizer, each chunk's text is what its ids add (decoded as they come).
    text = IncrementalText(tokenizer) if tokenizer is not None else None
    sent_text = ""
    try:
        while True:
            job.updated.clear()
            if len(job.output) > sent:
                new, sent = job.output[sent:], len(job.output)
                delta = ""
                if text is not None:
                    so_far = text.update(job.output)
                    delta, sent_text = so_far[len(sent_text) :], so_far
                yield _sse(
                    {
                        "id": job.job_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [
                            {"index": 0, "text": delta, "token_ids": new, "finish_reason": None}
                        ],
                    }
                )
            if job.finished:
                final = completion_body(job, runtime.settings.worker_id, model, created)
                final["choices"][0]["token_ids"] = []
                if text is not None:  # a partial character held back to the end
                    text.update(job.output)
                    final["choices"][0]["text"] = text.final()[len(sent_text) :]
                yield _sse(final)
                yield b"data: [DONE]\n\n"
                return
            await job.updated.wait()
    finally:
        if not job.finished:
            runtime.engine.cancel(job.job_id)


# -- routes ------------------------------------------------------------------------------------

ERRORS = error_responses(400, 404, 409, 413, 429, 503)
ADMIN_ERRORS = error_responses(400, 401, 403, 404, 409)


def _inference_router() -> APIRouter:
    router = APIRouter(tags=["inference"], route_class=OrjsonRoute)

    @router.post(
        "/v1/completions",
        response_model=schemas.CompletionResponse,
        responses=ERRORS,
        summary="OpenAI completions with a token-id prompt",
    )
    async def create_completion(
        body: schemas.CompletionRequest, request: Request, runtime: Runtime
    ) -> Response:
        settings = runtime.settings
        job = make_job(body, settings.shape, runtime.capacity_blocks, runtime.tokenizer)
        runtime.engine.submit(job)
        created = int(time.time())
        if body.stream:
            return _streaming(_stream(runtime, job, created))
        failed = await _finish(runtime, job, request)
        if failed is not None:
            return failed
        answer = completion_body(
            job, settings.worker_id, settings.model_name, created, runtime.tokenizer
        )
        return OrjsonResponse(answer)

    @router.post(
        "/v1/chat/completions",
        responses=ERRORS,
        summary="OpenAI chat completions (needs --tokenizer, or the router's prompt_token_ids)",
    )
    async def create_chat_completion(
        body: ChatCompletionRequest, request: Request, runtime: Runtime
    ) -> Response:
        settings = runtime.settings
        job = chat_job(body, runtime.tokenizer, settings.shape, runtime.capacity_blocks)
        runtime.engine.submit(job)
        created = int(time.time())
        model = settings.model_name
        if body.stream:
            return _streaming(
                chat_stream(runtime.engine, job, body, runtime.tokenizer, model, created)
            )
        watch = asyncio.ensure_future(stop_watch(runtime.engine, job, body, runtime.tokenizer))
        try:
            failed = await _finish(runtime, job, request)
        finally:
            watch.cancel()
        if failed is not None:
            return failed
        timings = timings_of(settings.worker_id, job)
        return OrjsonResponse(chat_body(job, body, runtime.tokenizer, model, created, timings))

    return router


def _streaming(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _finish(runtime: WorkerRuntime, job: Job, request: Request) -> Response | None:
    """Wait for the job to finish (cancelling it if the client goes away); the error answer
    of a job the engine failed, else None."""
    await await_job(runtime.engine, job, request.receive)
    failed = failed_job(job)
    if failed is None:
        return None
    status, message, kind, param, headers = failed
    return _error(status, message, kind, param, **headers)


def _block_info(block: KVCacheBlock, with_tokens: bool) -> dict[str, Any]:
    parent = block.prev_block
    return {
        "block_id": block.block_id,
        "hash": block.hash,
        "parent_hash": parent.hash if parent is not None and parent.block_id >= 0 else None,
        "level": 0 if block.is_primary else 1,
        "priority": block.priority,
        "ref_count": block.ref_count,
        "num_tokens": len(block.key.tokens),
        "tokens": list(block.key.tokens) if with_tokens else None,
    }


def _sequence_info(job: Job, mgr: KVCacheManager) -> dict[str, Any]:
    blocks = 0
    if job.request_id in mgr.sequences:
        blocks = len(mgr.get_cache_block_ids(job.request_id)[0])
    return {
        "request_id": job.job_id,
        "state": job.state.value,
        "priority": job.priority,
        "prompt_tokens": len(job.prompt),
        "generated_tokens": len(job.output),
        "max_tokens": job.max_tokens,
        "cached_tokens": job.cached_tokens,
        "position": job.position,
        "num_blocks": blocks,
        "preemptions": job.num_preemptions,
    }


def _admin_router(settings: WorkerSettings) -> APIRouter:
    router = APIRouter(tags=["admin"], responses=ADMIN_ERRORS, route_class=OrjsonRoute)
    admin = _admin(settings)

    @router.get("/health", response_model=schemas.HealthResponse, summary="Liveness")
    async def health(runtime: Runtime) -> dict[str, Any]:
        return {"status": "ok", "worker_id": runtime.settings.worker_id}

    @router.get(
        "/ready",
        response_model=schemas.HealthResponse,
        responses={503: {"model": schemas.HealthResponse}},
        summary="Engine running, Redis reachable, not draining",
    )
    async def ready(runtime: Runtime) -> Response:
        checks = {
            "engine": runtime.engine_alive,
            "redis": await runtime.redis_ok(),
            "admitting": not runtime.engine.draining,
        }
        ok = all(checks.values())
        body = {
            "status": "ready" if ok else "not ready",
            "worker_id": runtime.settings.worker_id,
            "checks": checks,
        }
        return OrjsonResponse(body, status_code=200 if ok else 503)

    @router.get("/stats", summary="Manager statistics, hit rate, events, queue")
    async def stats(runtime: Runtime) -> dict[str, Any]:
        kv = await runtime.engine.call(lambda mgr: mgr.get_kv_cache_stats())
        engine = runtime.engine
        counters = engine.stats
        prompt_total = counters.reused_tokens + counters.computed_tokens
        return {
            "worker_id": runtime.settings.worker_id,
            "uptime_s": round(time.time() - runtime.started_at, 3),
            "kv_cache": {
                "max_num_blocks": kv.max_num_blocks,
                "free_num_blocks": kv.free_num_blocks,
                "used_num_blocks": kv.used_num_blocks,
                "tokens_per_block": kv.tokens_per_block,
                "alloc_total_blocks": kv.alloc_total_blocks,
                "alloc_new_blocks": kv.alloc_new_blocks,
                "reused_blocks": kv.reused_blocks,
                "missed_blocks": kv.missed_blocks,
                "cache_hit_rate": kv.cache_hit_rate,
                "allocated_bytes": kv.allocated_bytes,
            },
            "load": dict(engine.load),
            "prompt_token_hit_rate": counters.reused_tokens / prompt_total if prompt_total else 0.0,
            "engine": {
                "steps": counters.steps,
                "submitted": counters.submitted,
                "finished": counters.finished,
                "cancelled": counters.cancelled,
                "failed": counters.failed,
                "preemptions": counters.preemptions,
                "errors": counters.errors,
                "reused_prompt_tokens": counters.reused_tokens,
                "computed_prompt_tokens": counters.computed_tokens,
                "prefill_tokens": counters.prefill_tokens,
                "generated_tokens": counters.generated_tokens,
                "waiting": engine.num_waiting,
                "running": len(engine.running),
                "max_queue_len": engine.config.max_queue_len,
                "draining": engine.draining,
            },
            "events": runtime.publisher.stats(),
        }

    @router.get("/config", summary="The worker's settings (no secrets)")
    async def config(runtime: Runtime) -> dict[str, Any]:
        data = runtime.settings.model_dump(exclude={"admin_token", "redis_url"})
        data["shape"] = dataclasses.asdict(runtime.settings.shape)
        data["blocks_per_level"] = list(runtime.settings.blocks_per_level())
        data["admin_token_set"] = runtime.settings.admin_token is not None
        return data

    @router.get("/sequences", response_model=list[schemas.SequenceInfo], summary="Live requests")
    async def sequences(runtime: Runtime) -> list[dict[str, Any]]:
        jobs = list(runtime.engine.jobs.values())
        return await runtime.engine.call(lambda mgr: [_sequence_info(job, mgr) for job in jobs])

    @router.get("/sequences/{request_id}", response_model=schemas.SequenceInfo)
    async def sequence(request_id: str, runtime: Runtime) -> dict[str, Any]:
        job = runtime.job_for(request_id)
        if job is None:
            raise NotFound(f"no live request with id {request_id!r}")
        return await runtime.engine.call(lambda mgr: _sequence_info(job, mgr))

    @router.get("/blocks", response_model=schemas.BlockPage, summary="The reuse tree, paginated")
    async def blocks(
        runtime: Runtime,
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        tokens: bool = False,
    ) -> dict[str, Any]:
        def page(mgr: KVCacheManager) -> dict[str, Any]:
            tree = next(iter(mgr.windows.values())).tree_blocks()
            chosen = tree[offset : offset + limit]
            return {
                "total": len(tree),
                "offset": offset,
                "limit": limit,
                "blocks": [_block_info(block, tokens) for block in chosen],
            }

        return await runtime.engine.call(page)

    @router.get("/blocks/{block_hash}", response_model=schemas.BlockInfo)
    async def block(
        block_hash: Annotated[int, schemas.BlockHash], runtime: Runtime, tokens: bool = False
    ) -> dict[str, Any]:
        found = await runtime.engine.call(lambda mgr: mgr.find_block_by_hash(block_hash))
        if found is None:
            raise NotFound(f"no block with hash {block_hash} in the reuse tree")
        return _block_info(found, tokens)

    @router.get("/events", response_model=schemas.EventPage, summary="Recent KV events")
    async def recent_events(
        runtime: Runtime,
        since: Annotated[int, Query(ge=-1)] = -1,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1_000,
    ) -> dict[str, Any]:
        events, oldest, latest = runtime.engine.events_after(since, limit)
        chosen = [event.to_dict() for event in events]
        return {
            "events": chosen,
            "oldest_event_id": oldest,
            "latest_event_id": latest,
            "truncated": oldest is not None and since < oldest - 1,
        }

    @router.get("/snapshot", response_model=schemas.SnapshotResponse, summary="The whole tree")
    async def snapshot(runtime: Runtime, tokens: bool = False) -> dict[str, Any]:
        snap = await runtime.engine.call(lambda mgr: manager_snapshot(mgr, with_tokens=tokens))
        return {
            "event_id": snap.event_id,
            "num_blocks": snap.num_blocks,
            "events": [event.to_dict() for event in snap.events],
        }

    @router.post(
        "/cache/clear",
        response_model=schemas.CountResponse,
        dependencies=[admin],
        summary="Free every unreferenced cached block (reported removed)",
    )
    async def clear(runtime: Runtime) -> dict[str, Any]:
        count = await runtime.engine.call(lambda mgr: mgr.clear_reusable_blocks())
        return {"count": count}

    @router.post(
        "/cache/offload",
        response_model=schemas.CountResponse,
        dependencies=[admin],
        summary="Move unreferenced cached blocks to host memory",
    )
    async def offload(
        runtime: Runtime, body: schemas.OffloadRequest | None = None
    ) -> dict[str, Any]:
        limit = body.max_blocks if body is not None else None
        count = await runtime.engine.call(lambda mgr: mgr.offload_reusable_blocks(limit))
        return {"count": count}

    @router.post(
        "/blocks/pin",
        response_model=schemas.PinResponse,
        dependencies=[admin],
        summary="Pin cached blocks (and their ancestors) by hash so they are not evicted",
    )
    async def pin(body: schemas.BlockHashes, runtime: Runtime) -> dict[str, Any]:
        ids = await runtime.engine.call(lambda mgr: mgr.pin_blocks_by_hash(body.block_hashes))
        return {"block_ids": ids}

    @router.post(
        "/blocks/unpin",
        response_model=schemas.PinResponse,
        dependencies=[admin],
        summary="Undo a pin made with the same hashes",
    )
    async def unpin(body: schemas.BlockHashes, runtime: Runtime) -> dict[str, Any]:
        ids = await runtime.engine.call(lambda mgr: mgr.unpin_blocks_by_hash(body.block_hashes))
        return {"block_ids": ids}

    @router.post(
        "/drain",
        response_model=schemas.DrainResponse,
        dependencies=[admin],
        summary="Stop admitting new requests (503) and let those in flight finish; stay up",
    )
    async def drain(runtime: Runtime) -> dict[str, Any]:
        return runtime.admin_drain()

    @router.post(
        "/resume",
        response_model=schemas.DrainResponse,
        dependencies=[admin],
        summary="Admit new requests again after POST /drain (409 while shutting down)",
    )
    async def resume(runtime: Runtime) -> dict[str, Any]:
        try:
            return runtime.admin_resume()
        except ValueError as exc:
            raise Conflict(str(exc)) from None

    @router.get(
        "/drain", response_model=schemas.DrainResponse, summary="Draining, and what is left"
    )
    async def drain_state(runtime: Runtime) -> dict[str, Any]:
        return runtime.drain_report()

    @router.post(
        "/requests/{request_id}/cancel",
        response_model=schemas.CancelResponse,
        dependencies=[admin],
        summary="Cancel a live request and free its blocks",
    )
    async def cancel(request_id: str, runtime: Runtime) -> dict[str, Any]:
        if not runtime.engine.cancel(request_id):
            raise NotFound(f"no live request with id {request_id!r}")
        return {"request_id": request_id, "cancelled": True}

    @router.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics(runtime: Runtime) -> Response:
        runtime.metrics.kv_stats = await runtime.engine.call(lambda mgr: mgr.get_kv_cache_stats())
        return Response(runtime.metrics.render(), media_type=CONTENT_TYPE)

    return router


# -- errors and limits ---------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI) -> None:
    install_error_handlers(app)

    @app.exception_handler(InvalidRetentionConfigError)
    async def bad_retention(request: Request, exc: InvalidRetentionConfigError) -> Response:
        return _error(400, f"retention: {exc}", "invalid_request_error", "retention")

    @app.exception_handler(UnknownBlockError)
    @app.exception_handler(UnknownRequestError)
    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(404, str(exc), "not_found_error")

    @app.exception_handler(PinConflictError)
    async def pin_conflict(request: Request, exc: PinConflictError) -> Response:
        return _error(409, str(exc), "conflict_error", "block_hashes")

    @app.exception_handler(EngineError)
    async def engine_refused(request: Request, exc: EngineError) -> Response:
        status, message, kind, param, headers = refusal(exc)
        return _error(status, message, kind, param, **headers)


def install(app: FastAPI, settings: WorkerSettings, *, fast_path: bool = True) -> None:
    """The routes, their error handlers, the completions fast path (``fast_path=False``: the
    FastAPI route answers every completion, as the test that both answer alike needs) and the
    body limit."""
    _install_error_handlers(app)
    app.include_router(_inference_router())
    app.include_router(_admin_router(settings))
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if fast_path:  # in front of the framework's middleware: what a server runs (app.core.http)
        front = CompletionFastPath(app, settings.max_body_bytes)
        app.state.asgi_front = front
        app.state.fast_routes = front.fast_routes()  # and in the server's protocol, before it
        app.state.fast_max_body_bytes = settings.max_body_bytes
