"""The fast path of ``POST /route`` and ``POST /v1/completions``: plain bodies answered without
FastAPI's request machinery.

At 1,000 requests a second FastAPI's middleware, dependency solving and model validation, and
parsing a 4,096-token prompt into Python ints, were half of the router's CPU. ``FastPath`` is
the outermost ASGI app the server runs (``app.state.asgi_front``, see ``app.core.http``); it
takes a request only when it is a POST to one of these two paths with no query string, a JSON
content type and a Content-Length within ``max_body_bytes``, and its body is plain
(``app.core.token_json``: token ids, every field of the right type and in range). The checks
are the schema's. Anything else (text prompts, ``routing``, ``stream``, ``?explain``, a field
out of range, malformed JSON, a body not sent as JSON, a model not served) goes to the FastAPI
route, which answers it, errors included, exactly as it would have; a test holds both paths to
the same answers. The OpenAPI schema is the FastAPI routes'.

Both are also answered from the server's protocol, without an ASGI cycle (``fast_routes``,
``app.core.fast_http``): ``route_answer`` is synchronous, and ``completion_answer`` decides
synchronously whether it takes a body, then gives the worker's answer to await. A completion
is forwarded as the client's own
bytes: an engine behind ``kvmesh ingest`` gets the body as it came, a kvmesh worker the same
with the router's ``request_id`` added (the token ids are not parsed into ints, nor written
again).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.core.asgi import plain_json_headers, read_body, replay, send_json
from app.core.errors import ApiError
from app.core.fast_http import FastRoute, RawAnswer
from app.core.http import error
from app.core.token_json import TokenBody, parse_token_body
from app.router import schemas
from app.router.core import NoWorkerError
from app.router.decisions import Prompt, decide, route_body
from app.router.proxy import no_worker_response, proxy, request_id_of
from app.router.runtime import RouterRuntime

__all__ = ["FastPath", "completion_answer", "fast_routes", "route_answer"]

_MAX_U64 = (1 << 64) - 1
_ROUTE_KEYS = frozenset(("lora_task_id", "cache_salt", "model", "user"))
_PATHS = frozenset(("/route", "/v1/completions"))
# Most bodies name no LoRA and no salt: one instance serves them all (only ever read).
_NO_KEY_FIELDS = schemas.PromptFields.model_construct(
    lora_task_id=None, cache_salt=None, routing=None
)


class FastPath:
    """The outermost ASGI app: plain ``/route`` and ``/v1/completions`` bodies answered here,
    everything else passed to ``app`` (see the module docstring)."""

    def __init__(self, app: FastAPI, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in _PATHS
            or scope["query_string"]
        ):
            await self.app(scope, receive, send)
            return
        session = plain_headers(scope["headers"], self.max_body_bytes)
        runtime: RouterRuntime | None = getattr(self.app.state, "runtime", None)
        if session is None or runtime is None:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client went away
            return
        if scope["path"] == "/route":
            answer = route_answer(runtime, body, session or None)
            if answer is not None:
                await send_json(send, 200, answer)
                return
        else:
            proxied = completion_answer(runtime, body, session or None)
            if proxied is not None:
                response = await proxied
                await response(scope, receive, send)
                return
        await self.app(scope, replay(body, receive), send)


def fast_routes(app: FastAPI, max_body_bytes: int) -> dict[bytes, FastRoute]:
    """``POST /route`` and ``POST /v1/completions`` for the server's protocol
    (``app.core.fast_http``), answered as ``FastPath`` answers them."""

    def route(headers: list[tuple[bytes, bytes]], body: bytes) -> bytes | None:
        session = plain_headers(headers, max_body_bytes)
        runtime: RouterRuntime | None = getattr(app.state, "runtime", None)
        if session is None or runtime is None:
            return None
        return route_answer(runtime, body, session or None)

    def completion(
        headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Coroutine[Any, Any, RawAnswer] | None:
        session = plain_headers(headers, max_body_bytes)
        runtime: RouterRuntime | None = getattr(app.state, "runtime", None)
        if session is None or runtime is None:
            return None
        answer = completion_answer(runtime, body, session or None)
        return None if answer is None else _raw(answer)

    return {b"/route": route, b"/v1/completions": completion}


async def _raw(answer: Awaitable[Response]) -> RawAnswer:
    """A whole (not streamed) Response as the protocol writes it."""
    response = await answer
    if isinstance(response, StreamingResponse):  # only non-streamed bodies are taken
        raise TypeError("a streamed answer on the protocol's path")
    headers = [item for item in response.raw_headers if item[0] != b"content-length"]
    return response.status_code, headers, bytes(response.body)


def plain_headers(headers: list[tuple[bytes, bytes]], max_body_bytes: int) -> str | None:
    """The session (``x-session-id``, "" when none) of a request whose headers the fast path
    takes (``app.core.asgi.plain_json_headers``: a JSON body FastAPI would parse, within the
    body limit, not streamed, no ``Expect``); None for any other."""
    if not plain_json_headers(headers, max_body_bytes):
        return None
    for name, value in headers:
        if name == b"x-session-id":  # the first, as Starlette reads it
            return value.decode("latin-1")
    return ""


def _str_or_none(value: Any, longest: int | None = None) -> bool:
    return value is None or (type(value) is str and (longest is None or 0 < len(value) <= longest))


def _prompt_fields(
    runtime: RouterRuntime, parsed: TokenBody, session: str | None
) -> tuple[Prompt, schemas.PromptFields] | None:
    """The prompt and its cache-key fields, or None where the schema or the model would say
    more than "fine"."""
    data = parsed.fields
    lora, salt = data.get("lora_task_id"), data.get("cache_salt")
    model, user = data.get("model"), data.get("user")
    if (
        len(parsed.words) > runtime.settings.max_prompt_tokens
        or (lora is not None and (type(lora) is not int or not 0 <= lora <= _MAX_U64))
        or not _str_or_none(salt, 256)
        or not _str_or_none(model)
        or not _str_or_none(user)
    ):
        return None
    try:
        resolved = runtime.resolve_model(model)
    except ApiError:  # the FastAPI route says which model, in OpenAI's words
        return None
    # ``tokens`` is only read as "tokenized" on these paths: the ids are ``words``.
    prompt = Prompt(parsed.words, len(parsed.words), [], resolved, session or user)
    if lora is None and salt is None:
        return prompt, _NO_KEY_FIELDS
    fields = schemas.PromptFields.model_construct(lora_task_id=lora, cache_salt=salt, routing=None)
    return prompt, fields


def route_answer(runtime: RouterRuntime, body: bytes, session: str | None) -> bytes | None:
    """The 200 answer to a plain ``/route`` body, or None when the FastAPI route must answer
    (it answers the 503 of no worker too, with its Retry-After)."""
    parsed = parse_token_body(body)
    if parsed is None or not parsed.fields.keys() <= _ROUTE_KEYS:
        return None
    made = _prompt_fields(runtime, parsed, session)
    if made is None:
        return None
    prompt, fields = made
    try:
        decision, _, seconds = decide(runtime, prompt, fields, "", "route")
    except NoWorkerError:
        return None
    return orjson.dumps(route_body(runtime, decision, prompt, seconds))


def completion_answer(
    runtime: RouterRuntime, body: bytes, session: str | None
) -> Coroutine[Any, Any, Response] | None:
    """The worker's answer to a plain, non-streamed ``/v1/completions`` body (a Response, to
    await), or None when the FastAPI route must answer. Which of the two is decided before
    anything is awaited (as ``app.core.fast_http`` requires)."""
    parsed = parse_token_body(body)
    if parsed is None or parsed.key != "prompt":
        return None
    data = parsed.fields
    given_id, max_tokens = data.get("request_id"), data.get("max_tokens", 16)
    if (
        "routing" in data
        or data.get("stream", False) is not False
        or type(max_tokens) is not int
        or max_tokens < 1
        or not _str_or_none(given_id, 128)
    ):
        return None
    made = _prompt_fields(runtime, parsed, session)
    if made is None:
        return None
    prompt, fields = made
    try:
        request_id = request_id_of(runtime, given_id, "cmpl")
    except ApiError:
        return None
    if given_id is None:  # the id as the object's last member: one copy of the body
        close = body.rindex(b"}")
        ours = b"".join(
            (memoryview(body)[:close], b',"request_id":', orjson.dumps(request_id), b"}")
        )
    else:
        ours = body

    def payload(foreign: bool) -> bytes:
        return body if foreign else ours

    return _proxied(runtime, fields, prompt, request_id, payload)


async def _proxied(
    runtime: RouterRuntime,
    fields: schemas.PromptFields,
    prompt: Prompt,
    request_id: str,
    payload: Callable[[bool], bytes],
) -> Response:
    try:
        # Again: the protocol starts this coroutine an iteration after the first check, and
        # another request may have taken the id meanwhile. From here to the flight's start
        # (in ``proxy``, before its first await) nothing else runs.
        request_id_of(runtime, request_id, "cmpl")
    except ApiError as exc:  # the answer the app's handler gives
        return error(exc.status, exc.message, exc.kind, exc.param, exc.code, **exc.headers)
    try:
        return await proxy(runtime, fields, False, prompt, request_id, "/v1/completions", payload)
    except NoWorkerError as exc:
        return no_worker_response(runtime, exc)
