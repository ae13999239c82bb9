"""The router's HTTP API: the OpenAI front door, routing decisions, the cluster's state.

Handlers are thin: prompts become block hashes, the ``RouterCore`` decides, ``proxy`` forwards.
Errors are mapped to HTTP once, here, in OpenAI's shape (the proxy's own: ``app.router.proxy``)::

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

from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import Response

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
from app.router import schemas
from app.router.core import NoWorkerError
from app.router.decisions import (
    chat_prompt,
    decide,
    route_body,
    routing_of,
    text_prompt,
    token_prompt,
)
from app.router.decisions import explain as explain_workers
from app.router.fast_path import FastPath, fast_routes
from app.router.metrics import CONTENT_TYPE
from app.router.proxy import proxy, request_id_of
from app.router.runtime import RouterRuntime
from app.router.settings import RouterSettings

__all__ = ["install"]

Runtime = Annotated[RouterRuntime, Depends(runtime_of)]


# -- prompts and decisions ---------------------------------------------------------------------


_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _payload(ours: dict[str, Any], sent: dict[str, Any]) -> Callable[[bool], bytes]:
    """A kvmesh worker gets ``ours``, an engine behind ``kvmesh ingest`` ``sent``; serialised
    only when sent (ids the router encoded are a uint32 array: a JSON list all the same)."""
    return lambda foreign: orjson.dumps(sent if foreign else ours, option=_NUMPY)


# -- routes ------------------------------------------------------------------------------------


def _session(request: Request, user: str | None) -> str | None:
    """The request's session: ``x-session-id``, else OpenAI's ``user``."""
    return request.headers.get("x-session-id") or user


def _routing_router() -> APIRouter:
    router = APIRouter(tags=["routing"], route_class=OrjsonRoute)

    @router.post(
        "/route",
        response_model=schemas.RouteResponse | schemas.ExplainResponse,
        summary="Choose a worker for a prompt (nothing is sent; ?explain=true for the details)",
        responses=error_responses(400, 404, 413, 503),
    )
    async def route(
        body: schemas.RouteBody,
        request: Request,
        runtime: Runtime,
        explain: Annotated[bool, Query()] = False,
    ) -> Response:
        model = runtime.resolve_model(body.model)
        session = _session(request, body.user)
        if body.messages is not None:
            messages = [m.for_template() for m in body.messages]
            prompt = chat_prompt(runtime, messages, body.render_options(), model, session)
        elif body.prompt_token_ids is not None:
            prompt = token_prompt(runtime, body.prompt_token_ids, "prompt_token_ids", model)
        elif isinstance(body.prompt, str):
            prompt = text_prompt(runtime, body.prompt, "prompt", model, session)
        else:
            assert body.prompt is not None
            prompt = token_prompt(runtime, body.prompt, "prompt", model)
        prompt.session = session
        decision, hashes, seconds = decide(runtime, prompt, body, "", "route")
        out = route_body(runtime, decision, prompt, seconds)
        if explain:
            out["workers"] = explain_workers(runtime, decision, hashes, prompt)
        return OrjsonResponse(out)

    @router.post(
        "/route/explain",
        response_model=schemas.ExplainResponse,
        summary="Why a prompt would go where it goes: every worker's match per tier, load, cost",
        responses=error_responses(400, 404, 413, 503),
    )
    async def route_explain(
        body: schemas.RouteBody, request: Request, runtime: Runtime
    ) -> Response:
        return await route(body, request, runtime, explain=True)

    @router.post(
        "/v1/completions",
        summary="OpenAI completions: routed to the best worker and proxied (streaming too)",
        responses=error_responses(400, 404, 413, 502, 503),
    )
    async def completions(
        body: schemas.CompletionBody, request: Request, runtime: Runtime
    ) -> Response:
        model = runtime.resolve_model(body.model)
        session = _session(request, body.user)
        if isinstance(body.prompt, str):
            prompt = text_prompt(runtime, body.prompt, "prompt", model, session)
        else:
            prompt = token_prompt(runtime, body.prompt, "prompt", model, session)
        request_id = request_id_of(runtime, body.request_id, "cmpl")
        sent = body.model_dump(exclude_unset=True, exclude={"routing"})
        ours = dict(sent, request_id=request_id)
        if prompt.tokens is not None:
            ours["prompt"] = prompt.tokens
        payload = _payload(ours, sent)
        path = "/v1/completions"
        return await proxy(runtime, body, body.stream, prompt, request_id, path, payload)

    @router.post(
        "/v1/chat/completions",
        summary="OpenAI chat completions: rendered and tokenized as the model's engine does, "
        "routed to the best worker and proxied (streaming too)",
        responses=error_responses(400, 404, 413, 502, 503),
    )
    async def chat_completions(
        body: schemas.ChatBody, request: Request, runtime: Runtime
    ) -> Response:
        model = runtime.resolve_model(body.model)
        session = _session(request, body.user)
        if body.prompt_token_ids is not None:
            prompt = token_prompt(runtime, body.prompt_token_ids, "prompt_token_ids", model)
            prompt.session = session
        else:
            messages = body.template_messages()
            prompt = chat_prompt(runtime, messages, body.render_options(), model, session)
        request_id = request_id_of(runtime, body.request_id, "chatcmpl")
        sent = body.model_dump(exclude_unset=True, exclude={"routing"})
        ours = dict(sent, request_id=request_id)
        if prompt.tokens is not None:
            ours["prompt_token_ids"] = prompt.tokens
        payload = _payload(ours, sent)
        path = "/v1/chat/completions"
        return await proxy(runtime, body, body.stream, prompt, request_id, path, payload)

    @router.get(
        "/v1/models",
        response_model=schemas.ModelList,
        summary="OpenAI's model list: each model at least one worker serving it is up",
    )
    async def models(runtime: Runtime) -> Response:
        created = int(runtime.started_at)
        return OrjsonResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": created,
                        "owned_by": "kvmesh",
                        "workers": len(workers),
                    }
                    for name, workers in sorted(runtime.core.models().items())
                ],
            }
        )

    return router


def _cluster_router(settings: RouterSettings) -> APIRouter:
    router = APIRouter(tags=["cluster"], route_class=OrjsonRoute)
    admin = admin_dependency(settings.admin_token, "router")

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
                "sharing": runtime.share.stats() if runtime.share is not None else None,
            }
        )

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
        policy, weights = routing_of(
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


def install(app: FastAPI, settings: RouterSettings) -> None:
    """The router's routes, its error handlers, the body limit, and the fast path in front of
    them all (``app.state.asgi_front``: what a server runs, ``app.core.http``), and the same
    for ``/route`` and ``/v1/completions`` in the server's protocol (``app.state.fast_routes``,
    ``app.core.fast_http``)."""
    _install_error_handlers(app, settings.retry_after_s)
    app.include_router(_routing_router())
    app.include_router(_cluster_router(settings))
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.state.asgi_front = FastPath(app, settings.max_body_bytes)
    app.state.fast_routes = fast_routes(app, settings.max_body_bytes)
    app.state.fast_max_body_bytes = settings.max_body_bytes
