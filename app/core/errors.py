"""The errors kvmesh's HTTP APIs answer with: one tree, mapped to OpenAI's error shape once
(``app.core.http.install_error_handlers``), for every service::

    ApiError                 its ``status``, OpenAI ``type`` (``kind``), ``param``, headers
     ├── BadRequest          400 invalid_request_error   the request as sent cannot be served;
     │                                                    ``param`` names the field
     ├── NotFound            404 not_found_error          an id that names nothing
     ├── Conflict            409 conflict_error           not in the state the call needs
     └── Unavailable         503 unavailable_error        try again later (``Retry-After``)

Domain errors of the engine room (``cache``, ``events``) and of a service's own logic stay what
they are; a service's ``api`` module maps those it lets through, and raises these for its own
checks. The message is the whole answer: it names what was wrong, never a secret.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["ApiError", "BadRequest", "Conflict", "NotFound", "Unavailable"]


class ApiError(Exception):
    """An answer other than 2xx, in OpenAI's shape; see the module docstring."""

    status: ClassVar[int] = 500
    kind: ClassVar[str] = "error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.code = code  # OpenAI's machine-readable code ("model_not_found"), where one exists


class BadRequest(ApiError):
    status = 400
    kind = "invalid_request_error"


class NotFound(ApiError):
    status = 404
    kind = "not_found_error"


class Conflict(ApiError):
    status = 409
    kind = "conflict_error"


class Unavailable(ApiError):
    status = 503
    kind = "unavailable_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param, headers={"Retry-After": str(retry_after_s)})
