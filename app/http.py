"""HTTP pieces every kvmesh service shares (worker, router): orjson bodies both ways, OpenAI's
error shape, the admin bearer-token check, and the handlers of the framework's own errors.

Services map their domain errors to HTTP in their own ``api`` module; what is here is the part
that must look the same on every service.
"""

from __future__ import annotations

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

from app.middleware import error_body

__all__ = [
    "ErrorDetail",
    "ErrorResponse",
    "OrjsonResponse",
    "OrjsonRoute",
    "admin_dependency",
    "error",
    "error_responses",
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
            self._json = orjson.loads(await self.body())
        return self._json


class OrjsonRoute(APIRoute):
    """A route that parses its JSON body with orjson: the standard library's decoder was an
    eighth of the worker's time on 4,096-token prompts. orjson's decode error subclasses
    ``json.JSONDecodeError``, so a malformed body is still the framework's 400."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return route


def error(
    status: int, message: str, kind: str, param: str | None = None, **headers: str
) -> Response:
    """An error response in OpenAI's shape."""
    return OrjsonResponse(
        error_body(message, kind, param), status_code=status, headers=headers or None
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


def install_error_handlers(app: FastAPI) -> None:
    """400 for a request the schema refuses (naming the field), and OpenAI's shape for the
    framework's HTTPExceptions (401 with ``WWW-Authenticate``, 403, 404, 405, 413)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
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


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    """How every kvmesh service runs: uvloop and httptools, no access log (a line per request
    costs more than the request), five seconds to finish in-flight requests on shutdown, and
    idle keep-alive connections kept 75 s: longer than clients keep theirs (httpx: 5 s), so
    that a client never sends on a connection the server is closing at that moment (a
    ReadError, seen under load with uvicorn's own 5 s)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level=log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=75,
    )
