"""HTTP pieces every kvmesh service shares (worker, router): orjson bodies both ways, OpenAI's
error shape, the admin bearer-token check, and the handlers of the framework's own errors.

Services map their domain errors to HTTP in their own ``api`` module; what is here is the part
that must look the same on every service.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import orjson
import uvicorn
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, SecretStr
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from app.core.errors import ApiError
from app.core.fast_http import fast_protocol
from app.core.middleware import error_body

__all__ = [
    "ErrorDetail",
    "ErrorResponse",
    "OrjsonResponse",
    "OrjsonRoute",
    "admin_dependency",
    "error",
    "error_responses",
    "front_of",
    "install_error_handlers",
    "uvicorn_config",
]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for routes that answer these statuses in OpenAI's error shape."""
    return {code: {"model": ErrorResponse} for code in codes}


class OrjsonResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class _OrjsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise _placed(exc, body) from None
        return self._json


def _placed(exc: json.JSONDecodeError, body: bytes) -> json.JSONDecodeError:
    """orjson's decode error, or for bytes that are not UTF-8 one that says which byte and
    where: orjson reports those at character 0 whatever their place."""
    try:
        body.decode()
    except UnicodeDecodeError as bad:
        before = body[: bad.start].decode()
        return json.JSONDecodeError(
            f"invalid UTF-8 (byte 0x{body[bad.start]:02X})", before, len(before)
        )
    return exc


class OrjsonRoute(APIRoute):
    """A route that parses its JSON body with orjson: the standard library's decoder was an
    eighth of the worker's time on 4,096-token prompts. orjson's decode error subclasses
    ``json.JSONDecodeError``, so a malformed body is still the framework's 400 (see
    ``install_error_handlers`` for its message)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return route


def error(
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    code: str | None = None,
    **headers: str,
) -> Response:
    """An error response in OpenAI's shape."""
    return OrjsonResponse(
        error_body(message, kind, param, code), status_code=status, headers=headers or None
    )


def admin_dependency(token: SecretStr | None, service: str) -> Any:
    """A dependency refusing calls without ``Authorization: Bearer <token>`` (compared in
    constant time); with no token configured every admin call is refused, never open."""
    expected = token.get_secret_value().encode() if token else None

    def require_admin(authorization: Annotated[str | None, Header()] = None) -> None:
        if expected is None:
            raise HTTPException(403, f"admin calls are disabled: the {service} has no admin token")
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise HTTPException(401, "admin calls need 'Authorization: Bearer <token>'")
        if not secrets.compare_digest(given.encode(), expected):
            raise HTTPException(403, "wrong admin token")

    return Depends(require_admin)


def _json_kind(value: Any) -> str:
    """The JSON name of a decoded value's type, with its article."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: bool is an int
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__  # not from JSON: decoding gives only the types above


def _body_error(request: Request, exc: RequestValidationError, first: dict[str, Any]) -> str | None:
    """The message for an error about the body as a whole (malformed, empty, not an object),
    or None for one about a field. ``param`` is null for these: OpenAI's ``param`` names a
    field, and the framework's ``loc`` here is ("body", character offset) or ("body",)."""
    loc = tuple(first.get("loc", ()))
    kind = first.get("type")
    if kind == "json_invalid":
        # FastAPI's: loc ("body", e.pos), ctx {"error": e.msg}, exc.body = e.doc (the text).
        pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else 0
        reason = (first.get("ctx") or {}).get("error") or "malformed"
        doc = exc.body if isinstance(exc.body, str) else ""
        line = doc.count("\n", 0, pos) + 1
        column = pos - doc.rfind("\n", 0, pos)  # rfind is -1 on the first line: 1-based
        return (
            f"the body is not valid JSON: {reason} at line {line} column {column} (character {pos})"
        )
    if loc != ("body",):
        return None
    if kind == "missing":  # FastAPI reads an empty body as no body at all
        return "the body is empty: send a JSON object"
    value = first.get("input")
    if isinstance(value, bytes):  # not parsed: the content type is not JSON
        given = request.headers.get("content-type")
        has = f"content-type: {given}" if given else "no content-type"
        return (
            "the body must be a JSON object sent with content-type: application/json; this "
            f"request has {has}"
        )
    if isinstance(value, dict):
        return None
    return f"the body must be a JSON object, not {_json_kind(value)}"


def install_error_handlers(app: FastAPI) -> None:
    """Every ``app.core.errors.ApiError`` as its status and OpenAI's shape; 400 for a request
    the schema refuses (naming the field; for a body that is malformed, empty or not an object,
    saying what and where, with a null ``param``); and OpenAI's shape for the framework's
    HTTPExceptions (401 with ``WWW-Authenticate``, 403, 404, 405, 413)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return error(exc.status, exc.message, exc.kind, exc.param, exc.code, **exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        whole = _body_error(request, exc, dict(first))
        if whole is not None:
            return error(400, whole, "invalid_request_error", None)
        loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
        param = ".".join(loc) or None
        text = str(first.get("msg")).removeprefix("Value error, ")  # pydantic's, for validators
        message = f"{param}: {text}" if param else text
        return error(400, message, "invalid_request_error", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kinds = {
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            413: "invalid_request_error",
        }
        headers = dict(exc.headers or {})
        if exc.status_code == 401:
            headers.setdefault("WWW-Authenticate", "Bearer")
        kind = kinds.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "error"
        )
        return error(exc.status_code, str(exc.detail), kind, None, **headers)


def front_of(app: FastAPI) -> ASGIApp:
    """What a server runs for ``app``: its ``app.state.asgi_front`` (a fast path in front of
    the framework, which passes it everything else, lifespan included), else ``app``."""
    front: ASGIApp = getattr(app.state, "asgi_front", app)
    return front


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    """How every kvmesh service runs: uvloop and httptools (with the app's fast routes, if it
    has any: ``app.core.fast_http``; and its ``asgi_front``: ``front_of``), no access log (a
    line per request costs more than the request), five seconds to finish in-flight requests
    on shutdown, and idle keep-alive connections kept 75 s: longer than clients keep theirs
    (httpx: 5 s), so that a client never sends on a connection the server is closing at that
    moment (a ReadError, seen under load with uvicorn's own 5 s)."""
    return uvicorn.Config(
        front_of(app),
        host=host,
        port=port,
        loop="uvloop",
        http=fast_protocol(app) or "httptools",
        log_level=log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=75,
    )
