"""``DecisionShare``: router replicas of one mind. Every router publishes its own flights
(a request begun on a worker, its prefill done, its end) to one Redis stream, and applies the
other routers' to its ``RouterCore``: their requests count in each worker's in-flight load, and
their block hashes in its predicted cache. N routers behind a plain load balancer then choose
as one router would, instead of each knowing only its own burst (the failure Dynamo #11035 and
llm-d #1946 describe).

Wire: ``kvmesh:{routers}:decisions`` (``events.keys``), one entry per flight change, fields
``r`` (router id), ``k`` (``b`` begun, ``p`` prefilled, ``f`` finished, ``h`` hello), ``q``
(request id), ``a`` on a hello (1 when it answers one), and on ``b`` also ``w`` (worker), ``t``
(uncached prompt tokens), ``n`` (blocks) and ``h`` (the prompt's block hashes, 8 bytes each,
little-endian). ``XADD ... MAXLEN ~`` keeps it bounded. Publishing never waits on Redis: entries
queue in memory and a task writes them in one pipeline every ``flush_interval_s``; if Redis does
not answer they are dropped (counted), and the others' views heal as below.

Who listens: a router publishes its flights only while it knows another router is alive. A
router says hello (``k`` ``h``) when it starts and whenever its heartbeat key had vanished (Redis
restarted empty, or it stalled past the TTL), once its reader knows where the stream ends, and
every ``LONELY_HELLO_S`` while it knows no other router (a hello or an answer may be lost); a
router that reads one answers it (``a`` 1: an answer is not answered). A router alone (the
common case) thus writes nothing per request, where it wrote three entries and read them back.
A flight begun before the others were known is not shared, as a flight begun before a router
started is not: its end is not published either. Routers of a version before hellos count
them as malformed entries.

Liveness: each router refreshes ``kvmesh:{routers}:alive:<id>`` (TTL ``alive_ttl_s``); a router
whose key is gone (it died mid-request, or Redis restarted empty) is no longer listened for and
has its flights ended in every other router at the next check, and a flight older than
``max_flight_s`` ends anyway (its end was lost). A stream entry that does not parse is counted
and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from redis.asyncio import Redis

from app.cluster.members import MAX_I64
from app.router.core import InFlight, RouterCore
from events import keys
from events.redis_io import REDIS_ERRORS

__all__ = ["DecisionShare", "default_router_id"]

LONELY_HELLO_S = 10.0  # a router that knows no other says hello again this often

logger = logging.getLogger(__name__)


def default_router_id() -> str:
    """``<host>-<pid>``: unique among the routers of a fleet."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host or 'router'}-{os.getpid()}"


class DecisionShare:
    """See the module docstring."""

    def __init__(
        self,
        redis: Redis,
        router_id: str,
        core: RouterCore,
        *,
        flush_interval_s: float = 0.002,
        alive_ttl_s: float = 3.0,
        max_flight_s: float = 600.0,
        maxlen: int = 100_000,
    ) -> None:
        self.redis = redis
        self.router_id = keys.validate_worker_id(router_id)
        # What the others know this process by: the id and a nonce, so that a router restarted
        # under the same id (a container's pid, a fixed --router-id) within the heartbeat TTL
        # is a new one, and the flights of the one that died still end.
        self.instance = f"{self.router_id}.{secrets.token_hex(4)}"
        self.core = core
        self.flush_interval_s = flush_interval_s
        self.alive_ttl_s = alive_ttl_s
        self.max_flight_s = max_flight_s
        self.maxlen = maxlen
        self._queue: list[dict[Any, Any]] = []
        self._wake = asyncio.Event()
        self._last_id = "$"
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.num_published = 0
        self.num_hellos = 0
        self.bytes_published = 0
        self.num_dropped = 0
        self.num_applied = 0
        self.num_malformed = 0
        self.num_forgotten = 0
        self.others: set[str] = set()  # the other routers known alive: they listen
        self._heard_at: dict[str, float] = {}  # router -> when an entry of it was last read
        self._hello_due = True  # say hello (once the reader knows where the stream ends)
        self._next_lonely_hello = 0.0
        core.flight_hooks.append(self._on_flight)

    # -- publishing ----------------------------------------------------------------------------

    def _on_flight(self, kind: str, flight: InFlight, block_hashes: Sequence[int]) -> None:
        if kind == "begin":
            if not self.others:  # nobody listens
                return
            flight.shared = True
        elif not flight.shared:  # the others never saw it begin
            return
        entry: dict[Any, Any] = {"r": self.instance, "k": kind[0]}
        entry["q"] = flight.request_id
        if kind == "begin":
            entry.update(w=flight.worker, t=flight.prefill_tokens, n=flight.blocks)
            entry["h"] = np.asarray(block_hashes, dtype="<u8").tobytes()
        self._publish(entry)

    def _publish(self, entry: dict[Any, Any]) -> None:
        self._queue.append(entry)
        self._wake.set()

    def _hello(self, answer: bool = False) -> None:
        self.num_hellos += 1
        self._publish({"r": self.instance, "k": "h", "a": int(answer)})

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.flush_interval_s)  # gather what comes meanwhile
            batch, self._queue = self._queue, []
            if not batch:
                continue
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for entry in batch:
                        pipe.xadd(keys.DECISIONS_KEY, entry, maxlen=self.maxlen, approximate=True)
                    await pipe.execute()
            except REDIS_ERRORS as exc:
                self.num_dropped += len(batch)
                if any(entry["k"] == "h" for entry in batch):
                    self._hello_due = True  # the others must still hear of us
                logger.warning(
                    "router %s: sharing failed, %d dropped: %s", self.router_id, len(batch), exc
                )
                continue
            flights = [entry for entry in batch if entry["k"] != "h"]  # hellos are not counted
            self.num_published += len(flights)
            self.bytes_published += sum(
                len(k) + len(v if isinstance(v, (bytes, str)) else str(v))
                for entry in flights
                for k, v in entry.items()
            )

    # -- applying the others' ------------------------------------------------------------------

    async def _read_loop(self) -> None:
        # Ends when asked (``_closing``), between two reads: a blocking XREAD cancelled halfway
        # can leave redis-py's connection waiting for ever.
        while not self._closing:
            if self._last_id == "$":  # the start could not read where the stream ends
                await self._find_end()
            try:
                answer: Any = await self.redis.xread(
                    {keys.DECISIONS_KEY: self._last_id}, count=1_000, block=100
                )
            except REDIS_ERRORS as exc:
                logger.warning(
                    "router %s: reading shared decisions failed: %s", self.router_id, exc
                )
                await asyncio.sleep(0.5)
                continue
            for _key, entries in answer or ():
                for entry_id, fields in entries:
                    self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    self._apply(fields)

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        try:
            router = fields[b"r"].decode()
            if router == self.instance:
                return
            kind = fields[b"k"]
            if kind == b"h":  # a router that listens; unless answering ours, it may not know us
                self._hear(router)
                if fields[b"a"] == b"0":
                    self._hello(answer=True)
                return
            request_id = fields[b"q"].decode()
            core = self.core
            if kind == b"b":
                hashes = np.frombuffer(fields[b"h"], dtype="<u8").tolist()
                core.begin_remote(
                    router,
                    request_id,
                    fields[b"w"].decode(),
                    _count(fields[b"t"]),
                    _count(fields[b"n"]),
                    hashes,
                )
                self._hear(router)
            elif kind == b"p":
                core.prefilled_remote(router, request_id)
            elif kind == b"f":
                core.finish_remote(router, request_id)
            else:
                raise ValueError(f"kind {kind!r}")
        except (KeyError, ValueError, UnicodeDecodeError):
            self.num_malformed += 1
            return
        self.num_applied += 1

    def _hear(self, router: str) -> None:
        self.others.add(router)
        self._heard_at[router] = time.monotonic()

    async def _alive_loop(self) -> None:
        interval = self.alive_ttl_s / 3
        ttl_ms = int(self.alive_ttl_s * 1e3)
        alive_key = keys.router_alive_key(self.instance)
        while True:
            checked_at = time.monotonic()
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    # XX: refreshed only if it is there (a SET ... GET would need read access).
                    pipe.set(alive_key, 1, px=ttl_ms, xx=True)
                    others = sorted(self.others)
                    for other in others:
                        pipe.exists(keys.router_alive_key(other))
                    answers = await pipe.execute()
                if answers[0] is None:  # first beat, or our key was lost: say who we are
                    await self.redis.set(alive_key, 1, px=ttl_ms)
                    self._hello_due = True
            except REDIS_ERRORS as exc:
                logger.warning("router %s: heartbeat failed: %s", self.router_id, exc)
            else:
                for other, alive in zip(others, answers[1:], strict=True):
                    # (an entry read since the check was sent says it is alive after all)
                    if not alive and self._heard_at.get(other, 0.0) < checked_at:
                        # it died (or Redis restarted empty): its flights end
                        self.num_forgotten += self.core.forget_remote(router=other)
                        self.others.discard(other)
                        self._heard_at.pop(other, None)
                self.num_forgotten += self.core.forget_remote(older_than_s=self.max_flight_s)
            if not self.others and checked_at >= self._next_lonely_hello:
                # Alone: a hello, or an answer, may have been lost on the way. Ask again now
                # and then; nobody answers if there is nobody.
                self._hello_due = True
                self._next_lonely_hello = checked_at + LONELY_HELLO_S
            if self._hello_due and self._last_id != "$":  # the reader will see the answers
                self._hello_due = False
                self._hello()
            await asyncio.sleep(interval)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        # Read from the stream's end as it is now: an XREAD from "$" twice would miss what
        # was added between the two calls.
        await self._find_end()
        self._tasks = [  # the reader first: aclose lets it end by itself
            asyncio.create_task(loop(), name=f"kvmesh-share-{loop.__name__}")
            for loop in (self._read_loop, self._flush_loop, self._alive_loop)
        ]

    async def aclose(self) -> None:
        self._closing = True
        for task in self._tasks[1:]:  # not the reader (see _read_loop)
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, timeout=2.0)
        with contextlib.suppress(*REDIS_ERRORS):
            await self.redis.delete(keys.router_alive_key(self.instance))

    async def _find_end(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            last = cast(list[Any], await self.redis.xrevrange(keys.DECISIONS_KEY, count=1))
            self._last_id = last[0][0].decode() if last else "0-0"

    def stats(self) -> dict[str, Any]:
        per_request = self.bytes_published / max(self.num_published / 3, 1)
        return {
            "router_id": self.router_id,
            "instance": self.instance,
            "published": self.num_published,
            "hellos": self.num_hellos,
            "dropped": self.num_dropped,
            "applied": self.num_applied,
            "malformed": self.num_malformed,
            "forgotten": self.num_forgotten,
            "other_routers": sorted(self.others),
            "remote_inflight": len(self.core.remote),
            "bytes_published_per_request": round(per_request, 1),
        }


def _count(raw: bytes) -> int:
    """A flight's token or block count as another router wrote it: an integer from 0 to 2**63-1,
    as a worker's load fields are (``app.cluster.members.parse_load``), else a ValueError. A
    count past that would make the costs inf (the load term), or NaN with a load weight of 0."""
    value = int(raw)
    if not 0 <= value <= MAX_I64:
        raise ValueError(f"count {value!r} out of range")
    return value
