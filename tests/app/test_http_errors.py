"""Errors about the request body as a whole (malformed JSON, not UTF-8, empty, not an object,
not sent as JSON) on both services, in-process: the same 400 and message on every route that
takes a body, ``param`` null (OpenAI's ``param`` names a field); and the worker's length checks
naming the field to change."""

from __future__ import annotations

from typing import Any

import pytest

from tests.app.router_support import router_client, router_settings
from tests.app.worker_support import AUTH, worker_client, worker_settings
from tests.support.wait import eventually

JSON = {"content-type": "application/json"}
NOT_JSON = "the body is not valid JSON: "

# (body, message). Positions are characters of the decoded text, not bytes: "é€😀" is 3
# characters and 9 bytes, so the x after it is character 8 (byte 14).
BODY_ERRORS: list[tuple[bytes, str]] = [
    (b"", "the body is empty: send a JSON object"),
    (b"  \n ", NOT_JSON + "input data is empty at line 1 column 1 (character 0)"),
    (
        b"{not json",
        NOT_JSON + "unexpected character, expected a string key at line 1 column 2 (character 1)",
    ),
    (b'{"prompt": [1, 2,', NOT_JSON + "unexpected end of data at line 1 column 18 (character 17)"),
    (
        b'{"prompt": [1],\n "max_tokens": 2,\n "x" 1}',
        NOT_JSON + "unexpected character, expected ':' after key at line 3 column 6 (character 39)",
    ),
    (
        '{"é€😀": x}'.encode(),
        NOT_JSON + "unexpected character, expected a JSON value at line 1 column 9 (character 8)",
    ),
    (
        b'{"prompt": [1]}\n\n  x',
        NOT_JSON + "unexpected content after document at line 3 column 3 (character 19)",
    ),
    (b'{"a": 1,}', NOT_JSON + "trailing comma is not allowed at line 1 column 8 (character 7)"),
    (b"\xff\xfe{}", NOT_JSON + "invalid UTF-8 (byte 0xFF) at line 1 column 1 (character 0)"),
    (
        b'{"prompt": "\xe9"}',
        NOT_JSON + "invalid UTF-8 (byte 0xE9) at line 1 column 13 (character 12)",
    ),
    (  # after a 2-byte character: byte 8, character 7
        b'{"\xc3\xa9":\n "\xed\xa0\x80"}',
        NOT_JSON + "invalid UTF-8 (byte 0xED) at line 2 column 3 (character 8)",
    ),
    (b"[1, 2]", "the body must be a JSON object, not an array"),
    (b'"x"', "the body must be a JSON object, not a string"),
    (b"7.5", "the body must be a JSON object, not a number"),
    (b"true", "the body must be a JSON object, not a boolean"),
    (b"null", "the body must be a JSON object, not null"),
]

# Every route of each service that reads a JSON body, with what it needs to get that far.
WORKER_ROUTES: list[tuple[str, dict[str, str]]] = [("/v1/completions", {}), ("/blocks/pin", AUTH)]
# /route without a query string is the router's raw fast path, which hands every one of these
# bodies to the FastAPI route; ?explain=true and the others are FastAPI's from the start.
ROUTER_ROUTES: list[tuple[str, dict[str, str]]] = [
    ("/route", {}),
    ("/route?explain=true", {}),
    ("/route/explain", {}),
    ("/v1/completions", {}),
]


def _invalid(message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    }


@pytest.mark.parametrize(("body", "message"), BODY_ERRORS)
async def test_worker_body_errors(clean_redis_url: str, body: bytes, message: str) -> None:
    async with worker_client(worker_settings(clean_redis_url)) as (client, runtime):
        for path, headers in WORKER_ROUTES:
            response = await client.post(path, content=body, headers={**JSON, **headers})
            assert (path, response.status_code) == (path, 400)
            assert response.json() == _invalid(message), path
        assert runtime.engine.stats.submitted == 0


@pytest.mark.parametrize(("body", "message"), BODY_ERRORS)
async def test_router_body_errors(clean_redis_url: str, body: bytes, message: str) -> None:
    async with router_client(router_settings(clean_redis_url)) as (client, runtime):
        for path, headers in ROUTER_ROUTES:
            response = await client.post(path, content=body, headers={**JSON, **headers})
            assert (path, response.status_code) == (path, 400)
            assert response.json() == _invalid(message), path
        assert runtime.core.inflight == {}


NOT_SENT_AS_JSON = [
    ({}, "no content-type"),
    ({"content-type": "text/plain"}, "content-type: text/plain"),
    (
        {"content-type": "application/x-www-form-urlencoded"},  # curl -d without -H
        "content-type: application/x-www-form-urlencoded",
    ),
]


@pytest.mark.parametrize(("headers", "has"), NOT_SENT_AS_JSON)
async def test_a_body_not_sent_as_json_is_refused_by_both_services(
    clean_redis_url: str, headers: dict[str, str], has: str
) -> None:
    """A valid JSON object without a JSON content type is refused (FastAPI's strict content
    type) with a message saying so; the router's fast path refuses it too, even with a worker
    up, where it would otherwise have answered the decision itself."""
    message = (
        "the body must be a JSON object sent with content-type: application/json; this request "
        f"has {has}"
    )
    body = b'{"prompt": [1, 2, 3]}'
    async with (
        worker_client(worker_settings(clean_redis_url)) as (worker, _),
        router_client(router_settings(clean_redis_url)) as (router, runtime),
    ):
        answers = {"worker": await worker.post("/v1/completions", content=body, headers=headers)}
        await eventually(lambda: runtime.readiness()["ready"])
        ok = await router.post("/route", content=body, headers=JSON)
        assert ok.status_code == 200, ok.text
        for path, _ in ROUTER_ROUTES:
            answers[path] = await router.post(path, content=body, headers=headers)
    for where, response in answers.items():
        assert (where, response.status_code) == (where, 400)
        assert response.json() == _invalid(message), where


# -- the model's window: which field to change -------------------------------------------------


@pytest.mark.parametrize(
    ("num_prompt", "max_tokens", "message", "param"),
    [
        (
            9_000,
            16,
            "prompt: 9000 tokens; this model's window is 8192 tokens (prompt + max_tokens), so a "
            "prompt takes at most 8191",
            "prompt",
        ),
        (  # no max_tokens would make room: the prompt is what to shorten
            8_192,
            1,
            "prompt: 8192 tokens; this model's window is 8192 tokens (prompt + max_tokens), so a "
            "prompt takes at most 8191",
            "prompt",
        ),
        (
            8_000,
            500,
            "max_tokens: this model's maximum context length is 8192 tokens; you requested 8500 "
            "tokens (8000 in the prompt, 500 in the completion): lower max_tokens to at most 192",
            "max_tokens",
        ),
        (  # max_tokens' default (16) counts too
            8_180,
            None,
            "max_tokens: this model's maximum context length is 8192 tokens; you requested 8196 "
            "tokens (8180 in the prompt, 16 in the completion): lower max_tokens to at most 12",
            "max_tokens",
        ),
    ],
)
async def test_the_tiny_models_window_names_the_field_to_change(
    clean_redis_url: str, num_prompt: int, max_tokens: int | None, message: str, param: str
) -> None:
    """The tiny preset's window (8,192 tokens), on a cache large enough for any of these."""
    settings = worker_settings(clean_redis_url, max_seq_len=None, num_gpu_blocks=1_024)
    assert settings.shape.max_seq_len == 8_192
    body: dict[str, Any] = {"prompt": [1] * num_prompt}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    async with worker_client(settings) as (client, runtime):
        response = await client.post("/v1/completions", json=body)
        fits = await client.post("/v1/completions", json={"prompt": [1] * 8_191, "max_tokens": 1})
        assert runtime.engine.stats.submitted == 1
    assert response.status_code == 400
    assert response.json() == _invalid(message, param)
    assert fits.status_code == 200, fits.text
