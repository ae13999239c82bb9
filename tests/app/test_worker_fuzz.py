"""Property-based fuzz of the worker's HTTP API, driven by the worker's own OpenAPI schema.

Each Hypothesis example starts a fresh worker (in-process, through httpx's ASGITransport; its
settings drawn: scheduler, host blocks, queue length, model time, and a tight 16-block cache
where requests are preempted or wait), fetches ``/openapi.json`` and sends a program: rounds of
requests, each round's requests at once. Every request is built from its operation's schema:
path and query parameters (valid, huge, negative, odd unicode, missing, repeated, unknown),
and JSON bodies whose properties are schema-valid (``$ref`` followed) or arbitrary JSON, some
missing, some extra; or a body that is not JSON, or a wrong content type; with the admin
token, without it, or a wrong one. Completions come short (prompts of a few ids under the
vocabulary of 512, ``max_tokens`` <= 16, some prompts invalid), sometimes in bursts, sometimes
abandoned by their client mid-flight, sometimes followed by ``GET /sequences/{id}`` or a cancel
while live. Values that depend on the worker's state (the hash of a block in the reuse tree or
of a pinned one, a live request's id) are markers resolved when the request is sent.

The property: no request gets a 5xx (but the documented 503s: those of a drained worker, and
a completion that does not fit an idle cache whose room pinned blocks take), raises out of the
app or hangs; every 4xx is
OpenAI's error shape; and after the program every completion has finished (``engine.jobs``
empty), the manager holds no sequence, the free primary blocks are the capacity less the
distinct pinned primary blocks (secondary alike), every pinned block stays in the reuse tree
with its parent pinned at least as often, and once the pins are undone through
``/blocks/unpin`` and the cache cleared, every block is free and no engine step failed.

No shrinking (a worker per try would outlast the 120 s test timeout): a failure prints every
draw of its program. Plain tests below pin down edge cases (bodies that are not objects, deep
nesting, a 100k-token prompt, bodies over ``max_body_bytes``, bytes that are not UTF-8), the
and regressions of the bugs the fuzz found (see their docstrings).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings, target
from hypothesis import strategies as st

from app.worker.runtime import WorkerRuntime
from cache.window import WindowBlockManager
from tests.app.worker_support import ADMIN_TOKEN, AUTH, worker_client, worker_settings
from tests.support.openapi import (
    CONTENT_TYPES,
    MAX_U64,
    RAW_BODIES,
    Operation,
    SchemaValues,
    check_error_shape,
    completion_hints,
    ints,
    json_values,
    mostly,
    operations,
    strings,
)

REQUEST_TIMEOUT_S = 10.0  # one request; longer is a hang
SETTLE_TIMEOUT_S = 10.0  # for the engine to finish every job after the program

# -- markers resolved against the worker's state when a request is sent ------------------------


@dataclass(frozen=True)
class KnownHash:
    """The hash of a block in the reuse tree (``index`` modulo their number; of a pinned block
    when ``pinned`` and there is one), else ``fallback``."""

    index: int
    fallback: int
    pinned: bool = False


@dataclass(frozen=True)
class KnownRequestId:
    """A live request's id (when ``live`` and there is one) or one sent before (``index``
    modulo their number), else ``fallback``."""

    index: int
    fallback: str
    live: bool = True


@dataclass
class WorkerState:
    """What the markers resolve against: read from the runtime just before each send."""

    hashes: list[int]
    pinned_hashes: list[int]
    live_ids: list[str]
    request_ids: list[str]


def _window(runtime: WorkerRuntime) -> WindowBlockManager:
    windows = list(runtime.mgr.windows.values())
    assert len(windows) == 1, "the worker has one attention window"
    return windows[0]


def _state(runtime: WorkerRuntime, sent_ids: list[str]) -> WorkerState:
    window = _window(runtime)
    hashes = [block.hash for block in window.tree_blocks()]
    pinned = [window.blocks[block_id].hash for block_id in window.pins]
    live = list(runtime.engine.jobs)
    return WorkerState(hashes, pinned, live, [*live, *sent_ids])


def _resolve(value: Any, state: WorkerState) -> Any:
    if isinstance(value, KnownHash):
        hashes = (value.pinned and state.pinned_hashes) or state.hashes
        return hashes[value.index % len(hashes)] if hashes else value.fallback
    if isinstance(value, KnownRequestId):
        ids = (value.live and state.live_ids) or state.request_ids
        return ids[value.index % len(ids)] if ids else value.fallback
    if isinstance(value, list):
        return [_resolve(item, state) for item in value]
    if isinstance(value, dict):
        return {key: _resolve(item, state) for key, item in value.items()}
    return value


def worker_hints() -> dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]:
    """``completion_hints``, and block hashes in the reuse tree (markers resolved when sent)."""
    return {
        **completion_hints(),
        "block_hashes": (
            st.lists(known_hashes(), min_size=1, max_size=4),
            st.lists(st.one_of(known_hashes(), ints()), max_size=6),
        ),
        "max_blocks": (st.one_of(st.none(), st.integers(0, 8)), st.sampled_from([-1, 2**64])),
    }


def known_hashes() -> st.SearchStrategy[KnownHash]:
    """Hashes of blocks in the reuse tree, or of pinned ones."""
    return st.builds(KnownHash, st.integers(0, 63), st.integers(0, MAX_U64), st.booleans())


# -- requests ----------------------------------------------------------------------------------

BodyKind = Literal["none", "json", "raw"]
QueryValue = str | int | float | bool | None
FollowUp = Literal["sequence", "cancel"]
WRONG_AUTH: list[str | bytes] = [
    "Bearer wrong-token",
    f"Bearer {ADMIN_TOKEN}x",
    f"Bearer {ADMIN_TOKEN[:-1]}",
    "Bearer",
    "Bearer ",
    f"Bearer  {ADMIN_TOKEN}",
    f"Basic {ADMIN_TOKEN}",
    ADMIN_TOKEN,
    "",
    b"Bearer \xff\xfe",
    "Bearer " + "x" * 5000,
]


@dataclass
class RequestSpec:
    method: str
    path: str  # the template, e.g. /blocks/{block_hash}
    path_values: dict[str, Any]
    query: list[tuple[str, Any]]
    body_kind: BodyKind
    body: Any  # the JSON value (with markers), or the raw bytes
    content_type: str | None
    auth: str | bytes | None
    abandon_after: int | None = None  # the client goes away after this many loop ticks
    delay: int = 0  # loop ticks before it is sent (and its markers resolved)
    copies: int = 1  # sent this many times at once (the copies without its request_id)
    follow_up: FollowUp | None = None  # then this, on the job it submitted, while it is live


@dataclass
class Sent:
    """A request as sent, for failure messages."""

    method: str
    url: str
    params: list[tuple[str, QueryValue]]
    headers: list[tuple[bytes, bytes]]
    content: bytes | None

    def __str__(self) -> str:
        body = None if self.content is None else self.content[:600]
        return (
            f"{self.method} {self.url} params={self.params!r} headers={self.headers!r} "
            f"body={body!r}"
        )


def _path_value(schema: dict[str, Any], name: str) -> st.SearchStrategy[Any]:
    if name == "request_id":
        valid: st.SearchStrategy[Any] = st.one_of(
            st.builds(KnownRequestId, st.integers(0, 7), st.just("fuzz-a"), st.booleans()),
            st.sampled_from(["fuzz-a", "fuzz-b"]),
            st.text(min_size=1, max_size=20),
        )
    elif schema.get("type") == "integer":
        valid = st.one_of(known_hashes(), ints())
    else:
        valid = st.text(min_size=1, max_size=20)
    weird = st.one_of(
        st.sampled_from(["", ".", "..", "1.5", "1e3", "-0", "+1", " 1", "0x1f", "true", "null"]),
        strings(),
        st.floats(allow_nan=False),
    )
    return mostly(valid, weird, 8)


def _query_value(schema: dict[str, Any], values: SchemaValues) -> st.SearchStrategy[Any]:
    valid = values.valid(schema)
    invalid = st.one_of(
        strings(),
        ints(),
        st.floats(allow_nan=True),
        st.sampled_from(["true", "false", "1", "0", "yes", "on", "TRUE", "", "1.0"]),
    )
    return mostly(valid, invalid, 7)


def _auth(admin: bool) -> st.SearchStrategy[str | bytes | None]:
    good = st.sampled_from([AUTH["Authorization"], f"bearer {ADMIN_TOKEN}"])
    anything: st.SearchStrategy[str | bytes | None] = st.one_of(
        st.none(), st.sampled_from(WRONG_AUTH)
    )
    # Admin operations mostly with the token, so that their bodies are reached.
    return mostly(good, anything, 6 if admin else 3)


def request_specs(op: Operation, values: SchemaValues) -> st.SearchStrategy[RequestSpec]:
    path_strategies = {
        name: _path_value(json.loads(schema), name) for name, schema in op.path_params
    }
    query_strategies = [
        (name, _query_value(json.loads(schema), values)) for name, schema in op.query_params
    ]
    body_schema = json.loads(op.body_schema) if op.body_schema is not None else None
    strict_body = values.valid(body_schema, strict=True) if body_schema is not None else None
    loose_body = values.valid(body_schema) if body_schema is not None else None

    @st.composite
    def build(draw: st.DrawFn) -> RequestSpec:
        path_values = {name: draw(strategy) for name, strategy in path_strategies.items()}
        query: list[tuple[str, Any]] = []
        for name, strategy in query_strategies:
            for _ in range(draw(st.sampled_from([1, 1, 0, 2]))):  # sometimes missing or repeated
                query.append((name, draw(strategy)))
        if draw(st.integers(0, 9)) == 0:
            query.append((draw(st.text(min_size=1, max_size=8)), draw(strings())))
        mode = draw(st.integers(0, 19))
        body_kind: BodyKind = "json"
        content_type: str | None = "application/json"
        body: Any = None
        if strict_body is not None and loose_body is not None and mode < 14:
            body = draw(strict_body if mode < 9 else loose_body)
        elif mode < 16:
            body = draw(json_values())
        elif mode < 17 or body_schema is None:
            body_kind, content_type = "none", None
        else:
            body_kind = "raw"
            body = draw(st.one_of(st.sampled_from(RAW_BODIES), st.binary(max_size=40)))
        if body_kind != "none" and draw(st.integers(0, 9)) == 0:
            content_type = draw(st.sampled_from(CONTENT_TYPES))
        if body_schema is None and body_kind != "none" and draw(st.integers(0, 2)):
            body_kind, content_type = "none", None  # mostly no body where none is taken
        abandon, copies = None, 1
        follow: FollowUp | None = None
        if op.path == "/v1/completions":
            follows: list[FollowUp | None] = [None, None, None, "sequence", "cancel"]
            follow = draw(st.sampled_from(follows))
            if draw(st.integers(0, 9)) == 0:
                abandon = draw(st.integers(0, 30))
            if isinstance(body, dict) and draw(st.integers(0, 2)) == 0:
                copies = draw(st.integers(2, 8))  # a burst: preemptions, waiting for blocks
        return RequestSpec(
            method=op.method,
            path=op.path,
            path_values=path_values,
            query=query,
            body_kind=body_kind,
            body=body,
            content_type=content_type,
            auth=draw(_auth(op.admin)),
            abandon_after=abandon,
            delay=draw(st.sampled_from([0, 0, 1, 3, 10, 30, 100, 300, 1000])),
            copies=copies,
            follow_up=follow,
        )

    return build()


def stray_specs(ops: list[Operation]) -> st.SearchStrategy[RequestSpec]:
    """Wrong methods and unknown paths: 404/405 in OpenAI's shape."""
    return st.builds(
        RequestSpec,
        method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
        path=st.one_of(
            st.sampled_from([op.path for op in ops if not op.path_params]),
            st.sampled_from(["/", "/v1", "/v1/chat/completions", "/nope", "/blocks/1/x"]),
        ),
        path_values=st.just({}),
        query=st.just([]),
        body_kind=st.sampled_from(["none", "json"]),
        body=json_values(),
        content_type=st.just("application/json"),
        auth=_auth(False),
        abandon_after=st.none(),
    )


_SPEC_CACHE: dict[str, st.SearchStrategy[RequestSpec]] = {}
# How often each operation is drawn, against 2 for the others and the stray requests.
WEIGHTS = {"POST /v1/completions": 8, "POST /blocks/pin": 3, "POST /cache/clear": 1}


def any_request(openapi: dict[str, Any]) -> st.SearchStrategy[RequestSpec]:
    """One request to any operation of ``openapi`` (by ``WEIGHTS``), or a stray one."""
    key = json.dumps(openapi, sort_keys=True)
    if key not in _SPEC_CACHE:
        ops = [op for op in operations(openapi) if op.path != "/openapi.json"]
        values = SchemaValues(openapi.get("components", {}).get("schemas", {}), worker_hints())
        choices = [stray_specs(ops)] * 2
        for op in ops:
            choices += [request_specs(op, values)] * WEIGHTS.get(op.name, 2)
        _SPEC_CACHE[key] = st.sampled_from(choices).flatmap(lambda strategy: strategy)
    return _SPEC_CACHE[key]


def _render(spec: RequestSpec, state: WorkerState) -> Sent:
    url = spec.path
    for name, raw in spec.path_values.items():
        value = _resolve(raw, state)
        text = value if isinstance(value, str) else json.dumps(value)
        url = url.replace("{" + name + "}", quote(text.encode("utf-8", "surrogatepass"), safe=""))
    params: list[tuple[str, QueryValue]] = []
    for name, raw in spec.query:
        value = _resolve(raw, state)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = value
        else:
            text = json.dumps(value)
        params.append((name, text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")))
    content: bytes | None = None
    if spec.body_kind == "json":
        content = json.dumps(_resolve(spec.body, state), allow_nan=False).encode()
    elif spec.body_kind == "raw":
        content = spec.body
    headers: list[tuple[bytes, bytes]] = []
    if spec.content_type is not None:
        headers.append((b"Content-Type", spec.content_type.encode()))
    if spec.auth is not None:
        auth = spec.auth
        headers.append((b"Authorization", auth if isinstance(auth, bytes) else auth.encode()))
    return Sent(spec.method, url, params, headers, content)


# -- checks ------------------------------------------------------------------------------------


def is_no_room(response: httpx.Response) -> bool:
    """The one documented 5xx a fuzz can provoke: a completion that does not fit even an idle
    cache, its room taken by pinned blocks (docs/worker.md), is refused with 503."""
    if response.status_code != 503 or not response.headers.get("retry-after"):
        return False
    check_error_shape(response, response.text)
    message: str = response.json()["error"]["message"]
    return message.startswith("no room in the KV cache")


def is_drained(sent: Sent, response: httpx.Response) -> bool:
    """The other documented 503s: after an operator's ``POST /drain`` (which a fuzz may send
    with the right token) the worker refuses completions and says it is not ready, until
    ``POST /resume``."""
    if response.status_code != 503:
        return False
    if sent.url == "/ready":
        checks = response.json()["checks"]
        return bool(checks == {"engine": True, "redis": True, "admitting": False})
    if sent.url != "/v1/completions" or not response.headers.get("retry-after"):
        return False
    check_error_shape(response, response.text)
    message: str = response.json()["error"]["message"]
    return message == "the worker is draining (an operator asked for it)"


def check_response(sent: Sent, response: httpx.Response) -> None:
    context = f"{sent}\n-> {response.status_code} {response.text[:1000]}"
    if sent.url == "/v1/completions" and is_no_room(response):
        return
    if is_drained(sent, response):
        return
    assert response.status_code < 500, f"5xx: {context}"
    if response.status_code >= 400:
        check_error_shape(response, context)
        return
    if sent.url == "/v1/completions" and response.status_code == 200:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            assert response.text.endswith("data: [DONE]\n\n"), context
        else:
            choice = response.json()["choices"][0]
            # "aborted": cancelled while the worker drains (a fuzz may send POST /drain).
            assert choice["finish_reason"] in ("length", "cancelled", "aborted"), context


async def send(client: httpx.AsyncClient, runtime: WorkerRuntime, sent: Sent) -> httpx.Response:
    """The answer, or an AssertionError for a hang or an exception raised out of the app."""
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            return await client.request(
                sent.method,
                sent.url,
                params=sent.params,
                headers=sent.headers,
                content=sent.content,
            )
    except TimeoutError:
        engine = runtime.engine
        raise AssertionError(
            f"hang: no answer in {REQUEST_TIMEOUT_S} s to {sent} ({len(engine.jobs)} live jobs, "
            f"{engine.num_waiting} waiting, {engine.stats.errors} failed engine step(s), "
            f"{runtime.mgr.get_num_free_blocks()} free blocks)"
        ) from None
    except Exception as exc:  # raised out of the app: a 500 behind a real server
        trace = "".join(traceback.format_exception(exc))
        raise AssertionError(f"5xx (the app raised) for {sent}:\n{trace}") from exc


async def follow_up(
    client: httpx.AsyncClient, runtime: WorkerRuntime, kind: FollowUp, before: set[str]
) -> None:
    """Once a job submitted after ``before`` is live, look it up or cancel it (200, or 404 when
    it finished meanwhile)."""
    for _ in range(1_000):
        new = [job_id for job_id in runtime.engine.jobs if job_id not in before]
        if new:
            break
        await asyncio.sleep(0)
    else:
        return
    segment = quote(new[0].encode("utf-8", "surrogatepass"), safe="")
    if kind == "sequence":
        sent = Sent("GET", f"/sequences/{segment}", [], [], None)
    else:
        auth = [(b"Authorization", AUTH["Authorization"].encode())]
        sent = Sent("POST", f"/requests/{segment}/cancel", [], auth, None)
    response = await send(client, runtime, sent)
    check_response(sent, response)
    assert response.status_code in (200, 404), f"{sent}\n-> {response.status_code} {response.text}"


async def exchange(
    client: httpx.AsyncClient, runtime: WorkerRuntime, spec: RequestSpec, sent_ids: list[str]
) -> None:
    """Send one request and check its answer (nothing to check when the client gave up), and
    its follow-up."""
    for _ in range(spec.delay):
        await asyncio.sleep(0)
    sent = _render(spec, _state(runtime, sent_ids))
    if spec.body_kind == "json" and isinstance(spec.body, dict):
        request_id = spec.body.get("request_id")
        if isinstance(request_id, str) and request_id not in sent_ids:
            sent_ids.append(request_id)
    follow = None
    if spec.follow_up is not None:
        follow = asyncio.ensure_future(
            follow_up(client, runtime, spec.follow_up, set(runtime.engine.jobs))
        )
    task = asyncio.ensure_future(send(client, runtime, sent))
    try:
        if spec.abandon_after is not None:
            for _ in range(spec.abandon_after):
                await asyncio.sleep(0)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return
        check_response(sent, await task)
    finally:
        if follow is not None:
            await follow


async def settle(runtime: WorkerRuntime) -> None:
    """Wait for the engine to finish every job (cancelled ones at its next iteration)."""
    engine = runtime.engine
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT_S
    while engine.jobs or engine.running or engine.num_waiting:
        if loop.time() > deadline:
            live = {
                job_id: (job.state.value, len(job.prompt)) for job_id, job in engine.jobs.items()
            }
            raise AssertionError(
                f"hang: jobs still live {SETTLE_TIMEOUT_S} s after the last request: {live}, "
                f"{engine.num_waiting} waiting, {len(engine.running)} running, "
                f"{runtime.mgr.get_num_free_blocks()} free blocks, "
                f"{engine.stats.errors} failed engine step(s) (see the log)"
            )
        await asyncio.sleep(0.01)
    # One more engine iteration, so that any admin call or cancel queued last has run.
    await engine.call(lambda mgr: None)


def check_blocks(runtime: WorkerRuntime) -> None:
    """No sequence left; free primary blocks are the capacity less the pinned primary blocks
    (a block pinned twice is held once), and the same for the secondary level."""
    mgr = runtime.mgr
    window = _window(runtime)
    assert not mgr.sequences, f"sequences left: {list(mgr.sequences)}"
    assert mgr.verify_queue_integrity()
    pinned = [window.blocks[block_id] for block_id in window.pins]
    check_pins_hold_their_ancestors(window)
    primary = sum(1 for block in pinned if block.is_primary)
    secondary = len(pinned) - primary
    assert mgr.get_num_free_blocks() == mgr.get_max_num_blocks() - primary, (
        f"{mgr.get_num_free_blocks()} free primary blocks, expected "
        f"{mgr.get_max_num_blocks()} - {primary} pinned; pins {window.pins}"
    )
    assert window.get_num_free_secondary_blocks() == window.num_secondary_blocks - secondary, (
        f"{window.get_num_free_secondary_blocks()} free secondary blocks, expected "
        f"{window.num_secondary_blocks} - {secondary} pinned; pins {window.pins}"
    )


def check_pins_hold_their_ancestors(window: WindowBlockManager) -> None:
    """Every pinned block is in the reuse tree (else no hash reaches it: it is never unpinned)
    and its parent is pinned at least as often (else evicting the parent drops it from the
    tree), as ``pin_blocks_by_hash`` promises."""
    in_tree = {block.block_id for block in window.tree_blocks()}
    for block_id, count in window.pins.items():
        assert block_id in in_tree, f"pinned block {block_id} left the tree: pins {window.pins}"
        parent = window.blocks[block_id].prev_block
        if parent is not None and parent is not window.root:
            assert window.pins.get(parent.block_id, 0) >= count, (
                f"block {block_id} is pinned {count} time(s), its parent {parent.block_id} "
                f"{window.pins.get(parent.block_id, 0)}: pins {window.pins}"
            )


def _describe_pins(window: WindowBlockManager) -> str:
    """The pinned blocks with their chains and the tree blocks sharing their hashes."""
    tree = window.tree_blocks()
    lines = []
    for block_id, count in window.pins.items():
        block = window.blocks[block_id]
        chain, node = [], block.prev_block
        while node is not None and node is not window.root:
            chain.append(node.block_id)
            node = node.prev_block
        same = [other.block_id for other in tree if other.hash == block.hash]
        lines.append(
            f"block {block_id} x{count}: hash {block.hash}, ancestors {chain}, "
            f"tree blocks with that hash {same}"
        )
    return "; ".join(lines)


async def unpin_all(client: httpx.AsyncClient, runtime: WorkerRuntime) -> None:
    """Undo every pin through the API. ``/blocks/pin`` pins the named blocks with their
    ancestors, each block once per call, and ``/blocks/unpin`` undoes that for the same hashes.
    While the pins hold their ancestors (``check_pins_hold_their_ancestors``), unpinning the
    pinned blocks that have no pinned child, in one call, takes one pin off every pinned block;
    so repeat that until none is left."""
    window = _window(runtime)
    before = _describe_pins(window)
    for _ in range(max(window.pins.values(), default=0)):
        pinned_parents = {
            block.prev_block.block_id
            for block in (window.blocks[block_id] for block_id in window.pins)
            if block.prev_block is not None
        }
        leaves = [block_id for block_id in window.pins if block_id not in pinned_parents]
        hashes = [window.blocks[block_id].hash for block_id in leaves]
        response = await client.post("/blocks/unpin", json={"block_hashes": hashes}, headers=AUTH)
        assert response.status_code == 200, (
            f"could not unpin blocks {leaves} (hashes {hashes}): {response.status_code} "
            f"{response.text}; pins {_describe_pins(window)}; before: {before}"
        )
    assert not window.pins, f"pins left after unpinning: {_describe_pins(window)}"


# -- the property ------------------------------------------------------------------------------

TIGHT_BLOCKS = 16  # of 4 tokens, a 64-token window
WORKER_CONFIGS = st.fixed_dictionaries(
    {
        "scheduler": st.sampled_from(["guaranteed_no_evict", "max_utilization"]),
        "num_host_blocks": st.sampled_from([0, 16]),
        "max_queue_len": st.sampled_from([1_024, 2]),
        # Tight: requests are preempted (max_utilization) or wait for blocks.
        "num_gpu_blocks": st.sampled_from([256, 64, TIGHT_BLOCKS]),
        # A little model time per step, so that requests stay live while others arrive.
        "sim_step_overhead_ms": st.sampled_from([0.0, 1.0]),
    }
)


def _copies(spec: RequestSpec) -> list[RequestSpec]:
    if spec.copies == 1 or not isinstance(spec.body, dict):
        return [spec]
    body = {key: value for key, value in spec.body.items() if key != "request_id"}
    return [spec] + [dataclasses.replace(spec, body=body)] * (spec.copies - 1)


async def run_program(redis_url: str, data: st.DataObject) -> int:
    """One fuzz program against a fresh worker; returns the number of requests sent."""
    config = data.draw(WORKER_CONFIGS, label="worker settings")
    tight = config["num_gpu_blocks"] == TIGHT_BLOCKS
    if tight:
        config.update(tokens_per_block=4, max_seq_len=64)
    sent = 0
    async with worker_client(worker_settings(redis_url, **config)) as (client, runtime):
        response = await client.get("/openapi.json")
        assert response.status_code == 200
        strategy = any_request(response.json())
        sent_ids: list[str] = []
        for prompt in (list(range(40)), [*range(32), 500, 501, 502]):  # something to pin
            body = {"prompt": prompt, "max_tokens": 2}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
        for number in range(data.draw(st.integers(6, 14), label="rounds")):
            specs = data.draw(st.lists(strategy, min_size=1, max_size=4), label=f"round {number}")
            sends = [copy for spec in specs for copy in _copies(spec)]
            results = await asyncio.gather(
                *(exchange(client, runtime, spec, sent_ids) for spec in sends),
                return_exceptions=True,
            )
            sent += len(sends)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        await settle(runtime)
        check_blocks(runtime)
        await unpin_all(client, runtime)
        response = await client.post("/cache/clear", headers=AUTH)
        assert response.status_code == 200, response.text
        await settle(runtime)
        check_blocks(runtime)
        assert runtime.mgr.get_num_free_blocks() == runtime.mgr.get_max_num_blocks()
        assert not _window(runtime).tree_blocks(), "blocks left in the tree after /cache/clear"
        assert runtime.engine.stats.errors == 0, "an engine step failed (see the log)"
        target(float(runtime.engine.stats.preemptions), label="preemptions")
    return sent


@settings(
    max_examples=60,
    deadline=None,
    # No shrinking: each try runs a worker, and shrinking a program outlasts the 120 s test
    # timeout; the failure report prints every draw of the failing program instead. About
    # 1,400 requests in all, some 25 s on two cores.
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
def test_fuzz_worker_api_from_openapi(clean_redis_url: str, data: st.DataObject) -> None:
    asyncio.run(run_program(clean_redis_url, data))


# -- targeted examples ---------------------------------------------------------------------------

BODY_OPERATIONS = ["/v1/completions", "/blocks/pin", "/blocks/unpin", "/cache/offload"]
JSON = {"Content-Type": "application/json"}


@contextlib.asynccontextmanager
async def worker(
    redis_url: str, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, WorkerRuntime]]:
    async with worker_client(worker_settings(redis_url, **overrides)) as (client, runtime):
        yield client, runtime
        await settle(runtime)
        check_blocks(runtime)


async def post(
    client: httpx.AsyncClient, path: str, content: bytes | AsyncIterator[bytes], **headers: str
) -> httpx.Response:
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        return await client.post(path, content=content, headers={**JSON, **AUTH, **headers})


@pytest.mark.parametrize("body", [b"[]", b"null", b'"x"', b"0", b"true", b"{}"])
@pytest.mark.parametrize("path", BODY_OPERATIONS)
async def test_bodies_that_are_not_the_object_asked_for(
    clean_redis_url: str, path: str, body: bytes
) -> None:
    async with worker(clean_redis_url) as (client, _):
        response = await post(client, path, body)
    if path == "/cache/offload" and body in (b"null", b"{}"):
        assert response.status_code == 200, response.text  # the body is optional
    else:
        assert response.status_code == 400, response.text
        check_error_shape(response, response.text)


def _nested(depth: int, kind: Literal["list", "object"]) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("kind", ["list", "object"])
@pytest.mark.parametrize("path", BODY_OPERATIONS)
async def test_deeply_nested_body_is_a_4xx(clean_redis_url: str, path: str, kind: str) -> None:
    nested = _nested(10_000, "list" if kind == "list" else "object")
    async with worker(clean_redis_url) as (client, _):
        alone = await post(client, path, nested)
        # Inside an otherwise valid body too (an extra field, or the field itself).
        field_name = {"/v1/completions": "prompt", "/cache/offload": "max_blocks"}.get(
            path, "block_hashes"
        )
        inside = await post(client, path, b'{"%s": ' % field_name.encode() + nested + b"}")
    for response in (alone, inside):
        assert 400 <= response.status_code < 500, response.text
        check_error_shape(response, response.text)


async def test_prompt_over_the_window_is_400(clean_redis_url: str) -> None:
    async with worker(clean_redis_url) as (client, runtime):
        body = json.dumps({"prompt": [7] * 100_000, "max_tokens": 1}).encode()
        response = await post(client, "/v1/completions", body)
        assert not runtime.engine.jobs
    assert response.status_code == 400, response.text
    check_error_shape(response, response.text)
    assert "window" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", [*BODY_OPERATIONS, "/cache/clear", "/health"])
async def test_body_over_max_body_bytes_is_413(clean_redis_url: str, path: str) -> None:
    big = json.dumps({"prompt": list(range(400)), "max_tokens": 1}).encode()
    assert len(big) > 1_024
    async with worker(clean_redis_url, max_body_bytes=1_024) as (client, runtime):
        response = await post(client, path, big)
        small = await post(client, "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 1}')
        assert not runtime.engine.jobs
    assert response.status_code == 413, response.text
    check_error_shape(response, response.text)
    assert small.status_code == 200, small.text


async def _chunks(data: bytes, size: int = 256) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("path", BODY_OPERATIONS)
async def test_streamed_body_over_max_body_bytes_is_413(clean_redis_url: str, path: str) -> None:
    """A body over ``max_body_bytes`` sent without Content-Length (chunked) is a 413 too.

    Regression, found by this file at f224591: ``BodyLimit`` raised a private exception from
    ``receive`` while FastAPI read the body, and FastAPI turns any exception there into
    ``HTTPException(400, "There was an error parsing the body")`` (type "error")."""
    big = json.dumps({"prompt": list(range(400)), "max_tokens": 1}).encode()
    async with worker(clean_redis_url, max_body_bytes=1_024) as (client, _):
        response = await post(client, path, _chunks(big))
    check_error_shape(response, response.text)
    assert response.status_code == 413, response.text


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xfe\xfa",
        b'{"prompt": [1, 2], "max_tokens": 1, "model": "\xff"}',
        b'{"block_hashes": [1], "\xc3\x28": 1}',
        b'{"max_blocks": 1, "x": "\xed\xa0\x80"}',
    ],
)
@pytest.mark.parametrize("path", BODY_OPERATIONS)
async def test_non_utf8_body_is_400(clean_redis_url: str, path: str, body: bytes) -> None:
    async with worker(clean_redis_url) as (client, _):
        response = await post(client, path, body)
    assert response.status_code == 400, response.text
    check_error_shape(response, response.text)


async def test_pinned_blocks_do_not_wedge_admission(clean_redis_url: str) -> None:
    """A completion that fits the capacity but not the blocks left unpinned is answered (the
    documented 503 "no room in the KV cache"), and requests behind it are served.

    Regression, found by this file at f224591 (a hang): pins were not counted, such a request
    was queued for ever and, admission being FIFO with no overtaking, every request behind it
    too. 8 blocks of 16 tokens; a completion caches 3 blocks, which are pinned; a 100 + 20 token
    completion needs 8 blocks (8 <= capacity 8) and never found 8 free (5); a 1-token request
    sent after it never ran either."""
    async with worker_client(
        worker_settings(clean_redis_url, num_gpu_blocks=8, max_seq_len=128)
    ) as (client, runtime):
        response = await client.post(
            "/v1/completions", json={"prompt": list(range(40)), "max_tokens": 9}
        )
        assert response.status_code == 200, response.text
        hashes = [block["hash"] for block in (await client.get("/blocks")).json()["blocks"]]
        assert len(hashes) == 3
        response = await client.post("/blocks/pin", json={"block_hashes": hashes}, headers=AUTH)
        assert response.status_code == 200, response.text
        assert runtime.mgr.get_num_free_blocks() == 5

        big = asyncio.ensure_future(
            client.post("/v1/completions", json={"prompt": list(range(100, 200)), "max_tokens": 20})
        )
        small = asyncio.ensure_future(
            client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        )
        done, pending = await asyncio.wait((big, small), timeout=5.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await unpin_all(client, runtime)
        await settle(runtime)
        check_blocks(runtime)
        statuses = {
            name: task.result().status_code if task in done else "no answer in 5 s"
            for name, task in (("big", big), ("small", small))
        }
        assert not pending, f"hang: {statuses}"
        assert statuses["small"] == 200, statuses
        answer = big.result()
        assert answer.status_code < 500 or is_no_room(answer), answer.text
        if answer.status_code >= 400:
            check_error_shape(answer, answer.text)


# uvicorn (httptools) refuses to send a header value with these bytes: a 500 behind it.
INVALID_HEADER_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")


@pytest.mark.parametrize("request_id", ["é", "💥", "ĀX", "a\nb", "a\r\nSet-Cookie: x=1", "\x00"])
async def test_streamed_completion_with_any_request_id(
    clean_redis_url: str, request_id: str
) -> None:
    """Regression, found by this file (a 500): a streamed completion echoed ``request_id`` in an
    ``X-Request-Id`` header; an id outside latin-1 ("💥") made Starlette raise
    ``UnicodeEncodeError`` after the job was submitted, and control characters ("a\\nb") made
    uvicorn's httptools refuse the header. The id now travels in the body only."""
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True, "request_id": request_id}
    async with worker(clean_redis_url) as (client, _):
        try:
            response = await client.post("/v1/completions", json=body)
        except UnicodeEncodeError as exc:  # raised out of the app: a 500 behind a server
            raise AssertionError(f"5xx: the app raised {exc!r} for {body!r}") from exc
        plain = await client.post("/v1/completions", json={**body, "stream": False})
    assert plain.status_code == 200, plain.text
    assert response.status_code < 500, response.text
    for name, value in response.headers.raw:
        assert not INVALID_HEADER_VALUE.search(value), f"header {name!r}: {value!r}"


@pytest.mark.parametrize("unpinned", ["ancestor", "sibling"])
async def test_unpin_with_other_hashes_cannot_strand_a_pinned_block(
    clean_redis_url: str, unpinned: str
) -> None:
    """Regression, found by this file (a leak of blocks): ``/blocks/unpin`` with hashes other
    than those of a pin call took pins that held a pinned block's ancestors; the ancestor was
    then evictable, and evicting it dropped the still-pinned block out of the reuse tree, where
    no hash reached it any more (7 of 8 blocks free for good).

    Blocks A <- B and A <- C cached by two completions (8 blocks of 16 tokens):

    * ancestor: pin [B] pins A and B; unpin [A] must be refused;
    * sibling: pin [B, C] pins A, B and C once each; unpin [C] must be refused;

    with 409 and nothing changed; the unpin with the pin's own hashes then frees everything."""
    async with worker_client(
        worker_settings(clean_redis_url, num_gpu_blocks=8, max_seq_len=128)
    ) as (client, runtime):
        window = _window(runtime)
        for prompt in (list(range(32)), [*range(16), *[300] * 16]):  # A <- B, A <- C
            body = {"prompt": prompt, "max_tokens": 1}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
        blocks = (await client.get("/blocks")).json()["blocks"]
        root = next(block["hash"] for block in blocks if block["parent_hash"] is None)
        b, c = [block["hash"] for block in blocks if block["parent_hash"] == root]
        pinned, unpin = ([b], [root]) if unpinned == "ancestor" else ([b, c], [c])
        response = await client.post("/blocks/pin", json={"block_hashes": pinned}, headers=AUTH)
        assert response.status_code == 200, response.text
        pins_before = dict(window.pins)
        response = await client.post("/blocks/unpin", json={"block_hashes": unpin}, headers=AUTH)
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("conflict_error", "block_hashes")
        assert "unpin with the hashes the pin used" in error["message"]
        assert window.pins == pins_before
        check_pins_hold_their_ancestors(window)
        response = await client.post("/blocks/unpin", json={"block_hashes": pinned}, headers=AUTH)
        assert response.status_code == 200, response.text
        assert window.pins == {}
        for token in range(100, 104):  # evicts everything cached
            body = {"prompt": [token] * 60, "max_tokens": 40}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
        await settle(runtime)
        assert runtime.mgr.get_num_free_blocks() == runtime.mgr.get_max_num_blocks()


async def test_preempting_requests_of_equal_priority(clean_redis_url: str) -> None:
    """``max_utilization`` preempting two requests of the same priority in one step.

    Regression, found by this file at f224591 (a hang): ``Engine._preempt`` queued a job as
    ``(priority, -num_preemptions, job)``; two first preemptions of priority 0 tied on both, so
    ``heapq`` compared the ``Job`` objects and raised ``TypeError: '<' not supported between
    instances of 'Job' and 'Job'`` in ``_enqueue``, failing the engine step. The job had been
    pushed (heappush appends before it compares) but ``_num_waiting`` was not incremented: the
    engine then slept with a job in its queue (that request never got an answer) or, later,
    counted -1 waiting and spun for ever.

    4 GPU blocks of 16 tokens, ``max_utilization``, five concurrent completions of 16-token
    prompts: four answered 200, one never did, ``stats.errors == 1``."""
    settings_ = worker_settings(
        clean_redis_url, num_gpu_blocks=4, max_seq_len=64, scheduler="max_utilization"
    )
    async with worker_client(settings_) as (client, runtime):
        tasks = [
            asyncio.ensure_future(
                client.post("/v1/completions", json={"prompt": [i] * 16, "max_tokens": 4})
            )
            for i in range(1, 6)
        ]
        done, pending = await asyncio.wait(tasks, timeout=5.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        engine = runtime.engine
        state = (
            f"{len(done)} of 5 answered, {engine.stats.errors} failed engine step(s), "
            f"{engine.stats.preemptions} preemption(s), {engine.num_waiting} waiting"
        )
        assert not pending, f"hang: {state}"
        assert all(task.result().status_code == 200 for task in done), state
        assert engine.stats.errors == 0, state
        await settle(runtime)
        check_blocks(runtime)
