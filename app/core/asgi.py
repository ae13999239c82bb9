"""Plain-ASGI pieces for a service's fast path: a hot route answered below the framework, with
anything it does not take handed to the FastAPI route unchanged.

``json_content`` says whether FastAPI would parse a body as JSON; ``plain_json`` whether a
request in front of the framework's middleware may be taken (a JSON body whose Content-Length
is within the body limit, neither streamed nor behind an ``Expect``; ``plain_json_headers``: the
same of a header list, for a fast route of the server's protocol); ``read_body`` reads one whole;
``replay`` gives that body to the app that answers instead, then the client's own ``receive``
(so that the app still sees a later disconnect); ``send_json`` answers with a JSON body as
Starlette's ``JSONResponse`` does (``content-length`` and ``content-type`` headers).
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import Message, Receive, Scope, Send

__all__ = ["json_content", "plain_json", "plain_json_headers", "read_body", "replay", "send_json"]


def json_content(scope: Scope) -> bool:
    """Whether FastAPI would parse this body as JSON (its strict content type: a JSON media
    type, not a missing one); when not, the route refuses the body, and so must a fast path."""
    return _json_type(scope["headers"])


def _json_type(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (
                kind.startswith(b"application/") and kind.endswith(b"+json")
            )
    return False


def plain_json(scope: Scope, max_body_bytes: int) -> bool:
    """Whether a request has a JSON body (``json_content``) and a Content-Length within
    ``max_body_bytes``, and no ``Expect`` or ``Transfer-Encoding``: what a fast path in front
    of the framework takes; any other is the framework's (``BodyLimit`` answers a body too
    large, or a Content-Length that is not a number)."""
    return plain_json_headers(scope["headers"], max_body_bytes)


def plain_json_headers(headers: list[tuple[bytes, bytes]], max_body_bytes: int) -> bool:
    """``plain_json`` of a request's headers as uvicorn parsed them (lower-case names): what a
    fast route of the server's protocol (``app.core.fast_http``) takes."""
    length = False
    for name, value in headers:
        if name == b"content-length":
            length = value.isdigit() and int(value) <= max_body_bytes
        elif name == b"expect" or name == b"transfer-encoding":
            return False
    return length and _json_type(headers)


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client went away before sending it."""
    message = await receive()
    if message["type"] != "http.request":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    chunks = [body]
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` (already read) first, then what ``receive`` gives."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def send_json(
    send: Send, status: int, body: bytes, headers: dict[str, str] | None = None
) -> None:
    """An answer with a JSON body (already encoded) and its headers."""
    raw = [
        (b"content-length", b"%d" % len(body)),
        (b"content-type", b"application/json"),
    ]
    if headers:
        raw += [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in headers.items()
        ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
