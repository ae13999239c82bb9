"""The fast path of ``POST /route``: a plain body answered without FastAPI's request machinery.

At 1,000 decisions a second FastAPI's dependency solving and model validation were a third of
the router's CPU. The checks here are the schema's; anything else (text prompts, ``routing``,
``?explain``, a field out of range, malformed JSON, a body not sent as JSON, an error to
report) goes to the FastAPI route, which answers it, errors included, exactly as it would have.
The OpenAPI schema is the FastAPI route's.
"""

from __future__ import annotations

from array import array

import numpy as np
import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.router import schemas
from app.router.core import NoWorkerError
from app.router.decisions import Prompt, decide, route_body
from app.router.runtime import RouterRuntime

__all__ = ["RouteFastPath"]

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
    if len(runtime.core.named_models()) > 1:  # the request must name its model: the route says
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
        prompt = Prompt(words, len(tokens), tokens)
        decision, _, seconds = decide(runtime, prompt, fields, "", "route")
    except NoWorkerError:
        return None  # the FastAPI route answers the 503, with its Retry-After
    return orjson.dumps(route_body(runtime, decision, prompt, seconds))
