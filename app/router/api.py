"""The router's HTTP API: the OpenAI front door, routing decisions, the cluster's state.

Handlers are thin: prompts become block hashes, the ``RouterCore`` decides, ``proxy`` forwards.
Errors are mapped to HTTP once, here, in OpenAI's shape::

    RequestValidationError, BadRequest          400 (naming the field)
    missing bearer token                        401
    admin calls disabled, or a wrong token      403
    NotFound (fleet admin: an unknown worker)   404
    body over max_body_bytes                    413
    NoWorkerError                               503 + Retry-After
    Unavailable (fleet admin: Redis is down)    503 (nothing was recorded)
    (BadRequest, NotFound, Unavailable: ``app.core.errors``)

A worker's own answer (a 4xx about the request, say) is passed through as it came, with the
worker's id in ``x-kvmesh-worker``. A worker that fails before answering (connection refused
or reset, a timeout on connecting, or a 502/503/504) is tried once more on the next best
worker; if that fails too the client gets a 502 naming both.
"""

from __future__ import annotations

import time
import uuid
from array import array
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Annotated, Any

import httpx
import numpy as np
import numpy.typing as npt
import orjson
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.errors import BadRequest
from app.core.http import (
    OrjsonResponse,
    OrjsonRoute,
    admin_dependency,
    error,
    error_responses,
    install_error_handlers,
)
from app.core.middleware import BodyLimit, error_body
from app.router import schemas
from app.router.core import NoWorkerError
from app.router.metrics import CONTENT_TYPE
from app.router.policy import Candidate, Decision, Weights
from app.router.service import RouterRuntime

__all__ = ["install"]

_RETRY_STATUSES = frozenset((502, 503, 504))


async def _runtime(request: Request) -> RouterRuntime:
    runtime: RouterRuntime = request.app.state.runtime
    return runtime


Runtime = Annotated[RouterRuntime, Depends(_runtime)]


# -- prompts and decisions ---------------------------------------------------------------------


def _tokens(
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


def _routing(runtime: RouterRuntime, routing: schemas.Routing | None) -> tuple[str, Weights]:
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


def _decide(
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
    policy, weights = _routing(runtime, fields.routing)
    hashes = core.hashes(words, lora_task_id=fields.lora_task_id, cache_salt=fields.cache_salt)
    decision = core.decide(hashes, len(words), policy=policy, weights=weights, exclude=exclude)
    elapsed = time.perf_counter() - start
    runtime.metrics.observe_decision(decision, elapsed, len(words))
    runtime.dashboard.on_decision(request_id, kind, decision, len(words), hashes)
    return decision, hashes, elapsed


def _route_body(
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


def _explain(runtime: RouterRuntime, decision: Decision, hashes: list[int]) -> list[dict[str, Any]]:
    core = runtime.core
    by_tier = core.index.find_matches_by_tier(hashes) if hashes else {}
    candidates: dict[str, Candidate] = {c.worker: c for c in core.candidates(hashes)}
    out: list[dict[str, Any]] = []
    for cost in decision.costs:
        c = candidates.get(cost.worker) or Candidate(cost.worker)
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


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


# -- routes ------------------------------------------------------------------------------------


def _routing_router() -> APIRouter:
    router = APIRouter(tags=["routing"], route_class=OrjsonRoute)

    @router.post(
        "/route",
        response_model=schemas.RouteResponse | schemas.ExplainResponse,
        summary="Choose a worker for a prompt (nothing is sent; ?explain=true for the details)",
        responses=error_responses(400, 413, 503),
    )
    async def route(
        body: schemas.RouteBody, runtime: Runtime, explain: Annotated[bool, Query()] = False
    ) -> Response:
        prompt = body.prompt_token_ids if body.prompt_token_ids is not None else body.prompt
        param = "prompt_token_ids" if body.prompt_token_ids is not None else "prompt"
        assert prompt is not None
        _, words = _tokens(runtime, prompt, param)
        decision, hashes, seconds = _decide(runtime, words, body, "", "route")
        out = _route_body(runtime, decision, len(words), seconds)
        if explain:
            out["workers"] = _explain(runtime, decision, hashes)
        return OrjsonResponse(out)

    @router.post(
        "/route/explain",
        response_model=schemas.ExplainResponse,
        summary="Why a prompt would go where it goes: every worker's match per tier, load, cost",
        responses=error_responses(400, 413, 503),
    )
    async def route_explain(body: schemas.RouteBody, runtime: Runtime) -> Response:
        return await route(body, runtime, explain=True)

    @router.post(
        "/v1/completions",
        summary="OpenAI completions: routed to the best worker and proxied (streaming too)",
        responses=error_responses(400, 413, 502, 503),
    )
    async def completions(body: schemas.CompletionBody, runtime: Runtime) -> Response:
        tokens, words = _tokens(runtime, body.prompt, "prompt")
        payload = body.model_dump(exclude_unset=True, exclude={"routing"})
        payload["prompt"] = tokens
        request_id = body.request_id or f"cmpl-{uuid.uuid4().hex}"
        if request_id in runtime.core.inflight:
            raise BadRequest(f"request_id: {request_id!r} is already in flight", param="request_id")
        payload["request_id"] = request_id
        return await _proxy(runtime, body, words, payload, request_id)

    return router


async def _proxy(
    runtime: RouterRuntime,
    body: schemas.CompletionBody,
    words: npt.NDArray[np.uint32],
    payload: dict[str, Any],
    request_id: str,
) -> Response:
    """Send to the best worker; once more to the next best if the first fails before answering."""
    core = runtime.core
    metrics = runtime.metrics
    content = orjson.dumps(payload)
    tried: list[str] = []
    failures: list[str] = []
    for _attempt in range(2):
        decision, hashes, _ = _decide(
            runtime, words, body, request_id, "completion", exclude=tuple(tried)
        )
        worker = decision.worker
        tried.append(worker)
        view = core.workers[worker]
        url = f"{view.url}/v1/completions"
        core.begin(request_id, decision, hashes, len(words))
        try:
            upstream = await runtime.http.send(
                runtime.http.build_request(
                    "POST", url, content=content, headers={"content-type": "application/json"}
                ),
                stream=True,
            )
        except httpx.HTTPError as exc:
            core.finish(request_id)
            failures.append(f"{worker}: {type(exc).__name__}")
            metrics.retries.inc()
            continue
        if upstream.status_code in _RETRY_STATUSES:
            await upstream.aclose()
            core.finish(request_id)
            failures.append(f"{worker}: HTTP {upstream.status_code}")
            metrics.retries.inc()
            continue
        headers = {"x-kvmesh-worker": worker}
        if body.stream and upstream.status_code == 200:
            return StreamingResponse(
                _relay(runtime, request_id, upstream),
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type", "text/event-stream"),
                headers=headers,
            )
        try:
            data = await upstream.aread()
        except httpx.HTTPError as exc:
            failures.append(f"{worker}: {type(exc).__name__} while reading")
            return error(502, f"worker {worker} failed mid-response", "upstream_error")
        finally:
            await upstream.aclose()
            core.finish(request_id)
        metrics.completions.labels(worker=worker, status=str(upstream.status_code)).inc()
        return Response(
            data,
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type", "application/json"),
            headers=headers,
        )
    metrics.completions.labels(worker="", status="502").inc()
    return error(
        502,
        f"no worker answered: {'; '.join(failures)}",
        "upstream_error",
    )


async def _relay(
    runtime: RouterRuntime, request_id: str, upstream: httpx.Response
) -> AsyncIterator[bytes]:
    """Pass a worker's stream through chunk by chunk; the first chunk ends the prefill."""
    core = runtime.core
    worker = core.inflight[request_id].worker if request_id in core.inflight else ""
    status = "200"
    try:
        async for chunk in upstream.aiter_raw():
            core.prefilled(request_id)
            yield chunk
    except httpx.HTTPError:
        status = "502"
        yield _sse(error_body("the worker failed mid-stream", "upstream_error"))
    finally:
        await upstream.aclose()
        core.finish(request_id)
        runtime.metrics.completions.labels(worker=worker, status=status).inc()


def _cluster_router(runtime_settings: Any, *, routing: bool) -> APIRouter:
    router = APIRouter(tags=["cluster"], route_class=OrjsonRoute)
    admin = admin_dependency(runtime_settings.admin_token, "router")

    @router.get("/workers", summary="Every worker: state, load, blocks per tier, heartbeat")
    async def workers(runtime: Runtime) -> Response:
        return OrjsonResponse({"workers": runtime.workers_report()})

    @router.get("/index/stats", summary="The prefix index and the event consumer")
    async def index_stats(runtime: Runtime) -> Response:
        stats = runtime.index.stats()
        return OrjsonResponse(
            {
                "index": stats,
                "consumer": runtime.consumer.stats(),
                "tokens_per_block": runtime.core.tokens_per_block,
            }
        )

    if routing:

        @router.get("/policy", response_model=schemas.PolicyOut, summary="The routing policy")
        async def get_policy(runtime: Runtime) -> Response:
            return OrjsonResponse(_policy_body(runtime))

        @router.put(
            "/policy",
            response_model=schemas.PolicyOut,
            dependencies=[admin],
            summary="Change the routing policy or its weights (admin)",
            responses=error_responses(400, 401, 403),
        )
        async def put_policy(body: schemas.PolicyUpdate, runtime: Runtime) -> Response:
            policy, weights = _routing(
                runtime, schemas.Routing(policy=body.policy, weights=body.weights)
            )
            runtime.core.policy = policy
            runtime.core.weights = weights
            return OrjsonResponse(_policy_body(runtime))

        fleet_errors = error_responses(401, 403, 404, 503)

        @router.post(
            "/workers/{worker_id}/cordon",
            summary="No new requests to this worker from any router; those in flight finish "
            "(admin; kept in Redis until uncordoned)",
            dependencies=[admin],
            responses=fleet_errors,
            tags=["fleet"],
        )
        async def cordon(worker_id: str, runtime: Runtime) -> Response:
            return OrjsonResponse(await runtime.cordon(worker_id, "cordoned"))

        @router.post(
            "/workers/{worker_id}/drain",
            summary="Cordon, then the worker's own POST /drain; GET /workers reports what is "
            "left in flight until done (admin)",
            dependencies=[admin],
            responses=fleet_errors,
            tags=["fleet"],
        )
        async def drain(worker_id: str, runtime: Runtime) -> Response:
            return OrjsonResponse(await runtime.cordon(worker_id, "draining"))

        @router.post(
            "/workers/{worker_id}/uncordon",
            summary="Back in rotation; a drained worker is asked to admit again (admin)",
            dependencies=[admin],
            responses=fleet_errors,
            tags=["fleet"],
        )
        async def uncordon(worker_id: str, runtime: Runtime) -> Response:
            return OrjsonResponse(await runtime.uncordon(worker_id))

    @router.get("/health", summary="The process is up")
    async def health() -> Response:
        return OrjsonResponse({"status": "ok"})

    @router.get(
        "/ready",
        summary="Ready to route: workers known, up, fresh and caught up (else 503, with why)",
        responses={503: {"description": "not ready: the body lists the reasons"}},
    )
    async def ready(runtime: Runtime) -> Response:
        body = runtime.readiness()
        return OrjsonResponse(body, status_code=200 if body["ready"] else 503)

    @router.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics(runtime: Runtime) -> Response:
        return Response(runtime.metrics.render(), media_type=CONTENT_TYPE)

    return router


def _policy_body(runtime: RouterRuntime) -> dict[str, Any]:
    return {"policy": runtime.core.policy, "weights": asdict(runtime.core.weights)}


# -- errors ------------------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    install_error_handlers(app)

    @app.exception_handler(NoWorkerError)
    async def no_worker(request: Request, exc: NoWorkerError) -> Response:
        return error(
            503, str(exc), "unavailable_error", None, **{"Retry-After": str(retry_after_s)}
        )


# -- the fast path of POST /route --------------------------------------------------------------

_FAST_KEYS = frozenset(("prompt_token_ids", "prompt", "lora_task_id", "cache_salt"))
_MAX_U64 = (1 << 64) - 1


class RouteFastPath:
    """``POST /route`` with a plain body (token ids, and at most a LoRA id and a cache salt),
    answered without FastAPI's request machinery: at 1,000 decisions a second its dependency
    solving and model validation were a third of the router's CPU. The checks are the same as
    the schema's; anything else (text prompts, ``routing``, ``?explain``, a field out of range,
    malformed JSON, an error to report) goes to the FastAPI route, which answers it, errors
    included, exactly as before. The OpenAPI schema is the FastAPI route's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["path"] != "/route"
            or scope["method"] != "POST"
            or scope["query_string"]
            or not _json_content(scope)
        ):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        runtime: RouterRuntime | None = getattr(scope["app"].state, "runtime", None)
        answer = _fast_route(runtime, body) if runtime is not None else None
        if answer is None:
            await self.app(scope, _replay(body), send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(answer)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer})


def _json_content(scope: Scope) -> bool:
    """Whether FastAPI would parse this body as JSON (its strict content type: a JSON media
    type, not a missing one); when not, the route refuses the body, and so must this path."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (
                kind.startswith(b"application/") and kind.endswith(b"+json")
            )
    return False


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


def _fast_route(runtime: RouterRuntime, body: bytes) -> bytes | None:
    """The answer to a plain ``/route`` body, or None when the FastAPI route must answer."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(data) is not dict or not data.keys() <= _FAST_KEYS:
        return None
    if ("prompt" in data) == ("prompt_token_ids" in data):
        return None
    tokens = data.get("prompt_token_ids", data.get("prompt"))
    lora, salt = data.get("lora_task_id"), data.get("cache_salt")
    if (
        type(tokens) is not list
        or not 0 < len(tokens) <= runtime.settings.max_prompt_tokens
        or (lora is not None and (type(lora) is not int or not 0 <= lora <= _MAX_U64))
        or (salt is not None and (type(salt) is not str or not 0 < len(salt) <= 256))
    ):
        return None
    try:
        words = np.frombuffer(array("I", tokens), dtype=np.uint32)
    except (OverflowError, TypeError):  # the FastAPI route names the problem
        return None
    fields = schemas.PromptFields.model_construct(lora_task_id=lora, cache_salt=salt, routing=None)
    try:
        decision, _, seconds = _decide(runtime, words, fields, "", "route")
    except NoWorkerError:
        return None  # the FastAPI route answers the 503, with its Retry-After
    return orjson.dumps(_route_body(runtime, decision, len(words), seconds))


def install(app: FastAPI, settings: Any, *, routing: bool = True) -> None:
    _install_error_handlers(app, settings.retry_after_s)
    if routing:
        app.include_router(_routing_router())
        app.add_middleware(RouteFastPath)  # inside BodyLimit, which is added after it
    app.include_router(_cluster_router(settings, routing=routing))
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
