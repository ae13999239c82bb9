"""Hypothesis strategies for fuzzing a service from its own OpenAPI schema: JSON values (odd
strings, edge integers), the operations of a schema, schema-valid (or nearly valid) values,
prompts of the tiny model, bodies that are not JSON and content types that are not JSON, and
the check of OpenAI's error shape. ``tests/app/test_worker_fuzz.py`` and
``tests/app/test_router_fuzz.py`` drive them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import strategies as st

VOCAB = 512  # the tiny model's vocabulary
MAX_U64 = 2**64 - 1


# -- JSON values -------------------------------------------------------------------------------

WEIRD_STRINGS = [
    "",
    " ",
    "\x00",
    "\ud800",  # a lone surrogate: json.dumps escapes it, the server decodes it back
    "\udfff\ud800",
    "é",
    "💥",
    "\u202e",
    "a" * 300,
    "../",
    "%2F",
    "null",
    "1e400",
    "NaN",
    "-0",
    "0x10",
]
EDGE_INTS = [
    -1,
    0,
    1,
    VOCAB - 1,
    VOCAB,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    MAX_U64,
    MAX_U64 + 1,
    -(2**63),
    -(2**64),
    10**30,
    2**200,
]


def strings(max_size: int = 20) -> st.SearchStrategy[str]:
    return st.one_of(st.text(max_size=max_size), st.sampled_from(WEIRD_STRINGS))


def ints() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(-(2**70), 2**70), st.sampled_from(EDGE_INTS))


def json_scalars() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        ints(),
        st.floats(allow_nan=False, allow_infinity=False),  # NaN and Infinity are not JSON
        strings(),
    )


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON value: scalars, and lists and objects nested a few levels."""
    return st.recursive(
        json_scalars(),
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.dictionaries(strings(10), children, max_size=4),
        ),
        max_leaves=12,
    )


@st.composite
def mostly(
    draw: st.DrawFn, valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any], tenths: int
) -> Any:
    """``valid`` in ``tenths`` of ten draws (shrinking towards it), else ``invalid``."""
    if draw(st.integers(0, 9)) < tenths:
        return draw(valid)
    return draw(invalid)


# -- the OpenAPI schema --------------------------------------------------------------------------


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    path_params: tuple[tuple[str, str], ...]  # (name, schema as JSON)
    query_params: tuple[tuple[str, str], ...]
    body_schema: str | None  # JSON
    admin: bool  # takes the Authorization header

    @property
    def name(self) -> str:
        return f"{self.method} {self.path}"


def operations(openapi: dict[str, Any]) -> list[Operation]:
    ops: list[Operation] = []
    for path, methods in openapi["paths"].items():
        for method, op in methods.items():
            params = op.get("parameters", [])
            by_place: dict[str, list[tuple[str, str]]] = {"path": [], "query": [], "header": []}
            for param in params:
                by_place[param["in"]].append((param["name"], json.dumps(param["schema"])))
            body = op.get("requestBody")
            body_schema = None
            if body is not None:
                body_schema = json.dumps(body["content"]["application/json"]["schema"])
            ops.append(
                Operation(
                    method=method.upper(),
                    path=path,
                    path_params=tuple(by_place["path"]),
                    query_params=tuple(by_place["query"]),
                    body_schema=body_schema,
                    admin=any(name.lower() == "authorization" for name, _ in by_place["header"]),
                )
            )
    return ops


class SchemaValues:
    """Strategies for values of a JSON schema (``$ref`` into ``components.schemas``).

    ``strict``: every property schema-valid (roughly: bounds as given, sizes capped), optional
    ones sometimes missing. Otherwise each property is schema-valid in eight draws of ten, else
    an invalid value or any JSON value; required ones are sometimes missing, extra ones
    sometimes added. ``hints``: (valid, invalid) strategies by property name, that keep
    values meaningful (short completions, prompts in the vocabulary, block hashes in the reuse
    tree)."""

    def __init__(
        self,
        components: dict[str, Any],
        hints: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] | None = None,
    ) -> None:
        self.components = components
        self.hints = dict(hints or {})

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.components[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def valid(
        self, schema: dict[str, Any], name: str | None = None, *, strict: bool = False
    ) -> st.SearchStrategy[Any]:
        """Schema-valid at the top (its parts too when ``strict``)."""
        if name is not None and name in self.hints:
            return self.hints[name][0]
        schema = self.resolve(schema)
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        if "anyOf" in schema:
            return st.one_of([self.valid(sub, strict=strict) for sub in schema["anyOf"]])
        kind = schema.get("type")
        if kind == "integer":
            low = int(schema["minimum"]) if "minimum" in schema else None
            high = int(schema["maximum"]) if "maximum" in schema else None
            if high is None:
                base = 0 if low is None else low
                return st.one_of(st.integers(base, base + 8), st.integers(min_value=low))
            return st.integers(low, high)
        if kind == "number":
            return st.floats(
                schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False
            )
        if kind == "string":
            return st.text(
                min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 30), 30)
            )
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            return st.lists(
                self.value(schema.get("items", {}), strict=strict),
                min_size=schema.get("minItems", 0),
                max_size=min(schema.get("maxItems", 6), 6),
            )
        if kind == "object" or "properties" in schema:
            return self.object(schema, strict=strict)
        return json_values()

    def value(
        self, schema: dict[str, Any], name: str | None = None, *, strict: bool = False
    ) -> st.SearchStrategy[Any]:
        valid = self.valid(schema, name, strict=strict)
        if strict:
            return valid
        invalid = json_values()
        if name is not None and name in self.hints:
            invalid = st.one_of(self.hints[name][1], invalid)
        return mostly(valid, invalid, 8)

    def object(
        self, schema: dict[str, Any], *, strict: bool = False
    ) -> st.SearchStrategy[dict[str, Any]]:
        properties: dict[str, dict[str, Any]] = schema.get("properties", {})
        required = set(schema.get("required", ()))
        values = {name: self.value(sub, name, strict=strict) for name, sub in properties.items()}

        @st.composite
        def build(draw: st.DrawFn) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for name, value in values.items():
                if name in required:
                    keep = strict or draw(st.integers(0, 19)) > 0
                else:
                    keep = draw(st.booleans())
                if keep:
                    out[name] = draw(value)
            if not strict and draw(st.integers(0, 9)) < 2:  # extra properties
                extra = draw(st.dictionaries(strings(10), json_values(), min_size=1, max_size=2))
                for key, item in extra.items():
                    out.setdefault(key, item)
            return out

        return build()


def valid_prompts() -> st.SearchStrategy[list[int]]:
    """Short lists of token ids, some sharing a prefix (so that blocks are reused)."""
    prefix = list(range(64))
    shared = st.builds(
        lambda n, tail: prefix[:n] + tail,
        st.sampled_from([16, 32, 48]),
        st.lists(st.integers(0, VOCAB - 1), max_size=8),
    )
    return st.one_of(shared, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))


def invalid_prompts() -> st.SearchStrategy[Any]:
    """Prompts the worker must refuse."""
    return st.one_of(
        st.just([]),
        st.lists(st.sampled_from([-1, VOCAB, 2**64, -(2**70), 10**30]), min_size=1, max_size=3),
        st.lists(st.one_of(st.integers(0, 9), st.sampled_from([1.5, True, "1", None, []]))),
        st.lists(st.lists(st.integers(0, 9), max_size=3), min_size=1, max_size=2),
        st.lists(strings(5), min_size=1, max_size=2),
        strings(),
        st.just([[]]),
        st.just([1.0, 2.0]),
    )


CONTENT_TYPES: list[str | None] = [
    None,
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=utf-16",
    "application/vnd.kvmesh+json",
    "application/jsonx",
    "",
]
RAW_BODIES = [
    b"",
    b"{",
    b"[1, 2",
    b"not json",
    b"\xff\xfe\xfa\x00",
    b'{"prompt": [1, 2, 3], "max_tokens": 2',
    b'{"prompt": [1, 2, 3], "max_tokens": 2}garbage',
    b'{"prompt": [1, 2, 3], "max_tokens": NaN}',
    b'{"prompt": [1, 2, 3], "retention": {"decode_duration_s": Infinity}}',
    b'{"block_hashes": [1e400]}',
    b'{"max_blocks": -Infinity}',
    b'{"prompt": [1], "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": [1], "prompt": "x"}',
    b'\xef\xbb\xbf{"prompt": [1], "max_tokens": 1}',
    b'{"prompt": [1], "max_tokens": 1, "x": "\xc3\x28"}',
    b"[" * 3000 + b"]" * 3000,
    b"{}",
    b"[]",
    b"null",
    b'"x"',
    b"0",
]


def check_error_shape(response: httpx.Response, context: str) -> None:
    """OpenAI's error shape: {"error": {"message": <non-empty str>, "type": <str>, ...}}."""
    assert response.headers.get("content-type", "").startswith("application/json"), context
    body = response.json()
    assert isinstance(body, dict), context
    error = body.get("error")
    assert isinstance(error, dict), context
    assert isinstance(error.get("message"), str), context
    assert error["message"].strip(), context
    assert isinstance(error.get("type"), str), context
    if response.status_code == 401:
        assert response.headers.get("www-authenticate") == "Bearer", context
    if response.status_code == 429:
        assert response.headers.get("retry-after"), context


def completion_hints() -> dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]:
    """(valid, invalid) values by property name for completion-like bodies: short completions,
    prompts in the vocabulary, retention ranges inside them, a few request ids and salts."""
    nothing: st.SearchStrategy[Any] = st.nothing()
    return {
        "prompt": (valid_prompts(), invalid_prompts()),
        "max_tokens": (st.integers(1, 16), st.sampled_from([0, -1, 1.5, 10**6, 2**64])),
        "request_id": (
            st.one_of(st.sampled_from(["fuzz-a", "fuzz-b", "fuzz-c"]), st.text(min_size=1)),
            st.sampled_from(["", "x" * 129, "\ud800", 1]),
        ),
        "start": (st.integers(0, 40), st.just(-1)),
        "end": (st.one_of(st.none(), st.integers(0, 60)), st.just(-1)),
        "priority": (st.integers(0, 100), st.sampled_from([-1, 101, 10**7])),
        "cache_salt": (
            st.one_of(st.none(), st.sampled_from(["a", "b"]), st.text(min_size=1)),
            st.sampled_from(["", "x" * 257, "\ud800"]),
        ),
        "lora_task_id": (
            st.one_of(st.none(), st.integers(0, 3), st.just(MAX_U64)),
            st.sampled_from([-1, MAX_U64 + 1]),
        ),
        "duration_s": (st.one_of(st.none(), st.floats(0, 1e9)), st.just(-1.0)),
        "decode_duration_s": (st.one_of(st.none(), st.floats(0, 1e9)), st.just(-0.5)),
        "stream": (st.booleans(), nothing),
    }
