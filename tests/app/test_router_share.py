"""Router replicas of one mind (``app.router.share``), over a real Redis: each router's flights
reach the other's core (in-flight load and predicted blocks), end with their end, and with their
router's death; malformed entries are counted and skipped. Then two ``kvmesh router`` processes
behind an alternating client: a burst of same-prefix requests lands on one worker, each router's
``/workers`` shows the other's load, and a router killed mid-burst leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from app.core.embedded_redis import EmbeddedRedis
from app.core.net import free_port
from app.router.core import RouterCore
from app.router.share import DecisionShare
from events import keys
from events.index import PrefixIndex
from tests.support.processes import service_process, sim_worker_args, wait_ready
from tests.support.wait import eventually, wait_for

TPB = 16


def _core() -> RouterCore:
    core = RouterCore(PrefixIndex(), tokens_per_block=TPB)
    for worker in ("w0", "w1"):
        core.upsert_worker(worker, url=f"http://{worker}", capacity_blocks=1_000)
        core.set_load(worker, {"free_blocks_0": 1_000, "used_blocks_0": 0})
    return core


@contextlib.asynccontextmanager
async def _shares(
    redis_url: str, alive_ttl_s: float = 3.0
) -> AsyncIterator[tuple[DecisionShare, DecisionShare]]:
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(2)]
    a = DecisionShare(clients[0], "ra", _core(), alive_ttl_s=alive_ttl_s)
    b = DecisionShare(clients[1], "rb", _core(), alive_ttl_s=alive_ttl_s)
    await a.start()
    await b.start()
    try:
        # Each has said hello and heard the other's (a router alone publishes nothing).
        await eventually(lambda: a.others == {b.instance} and b.others == {a.instance})
        yield a, b
    finally:
        for share, client in ((a, clients[0]), (b, clients[1])):
            await share.aclose()
            await client.aclose()


async def test_a_routers_flights_reach_the_other(clean_redis_url: str) -> None:
    async with _shares(clean_redis_url) as (a, b):
        prompt = list(range(100))  # 6 full blocks
        hashes = a.core.hashes(prompt)
        decision = a.core.decide(hashes, 100, exclude=("w1",))
        a.core.begin("req-1", decision, hashes, 100)
        await eventually(lambda: (a.instance, "req-1") in b.core.remote)
        view = b.core.workers["w0"]
        assert (view.remote_prefill_tokens, view.remote_running, view.remote_blocks) == (100, 1, 7)
        assert view.as_dict()["other_routers"] == {"prefill_tokens": 100, "running": 1, "blocks": 7}
        assert view.as_dict()["inflight"] == {"prefill_tokens": 0, "running": 0, "blocks": 0}
        # b now places the same prefix where a sent it, and counts a's load there.
        candidates = {c.worker: c for c in b.core.candidates(hashes)}
        assert (candidates["w0"].matched_blocks, candidates["w1"].matched_blocks) == (6, 0)
        assert (candidates["w0"].queued_prefill_tokens, candidates["w0"].running) == (100, 1)
        assert b.core.decide(hashes, 100).worker == "w0"

        a.core.prefilled("req-1")
        await eventually(lambda: view.remote_prefill_tokens == 0)
        assert view.remote_running == 1
        a.core.finish("req-1")
        await eventually(lambda: not b.core.remote)
        assert (view.remote_prefill_tokens, view.remote_running, view.remote_blocks) == (0, 0, 0)
        assert a.core.remote == {}  # its own flights never come back to it
        assert b.stats()["applied"] == 3
        # a counts its batch once the pipeline's answer is back, which b may read before.
        await eventually(lambda: a.stats()["published"] == 3)
        assert (a.stats()["dropped"], b.stats()["malformed"]) == (0, 0)

        # A malformed entry is counted and skipped: a field missing, or a count that is not
        # an integer from 0 to 2**63-1 (past it the costs were inf, or NaN with a load weight
        # of 0).
        client: Any = aioredis.Redis.from_url(clean_redis_url)
        await client.xadd(keys.DECISIONS_KEY, {"r": "rx", "k": "b", "q": "x"})
        flight = {"r": "rx", "k": "b", "w": "w0", "t": "100", "n": "7", "h": b""}
        for i, bad in enumerate(({"t": str(10**400)}, {"t": "-1"}, {"n": str(1 << 63)})):
            await client.xadd(keys.DECISIONS_KEY, {**flight, "q": f"bad-{i}", **bad})
        await client.xadd(keys.DECISIONS_KEY, {**flight, "q": "good", "n": str((1 << 63) - 1)})
        await client.aclose()
        await eventually(lambda: b.stats()["applied"] == 4)
        assert b.stats()["malformed"] == 4
        assert list(b.core.remote) == [("rx", "good")]
        assert view.remote_prefill_tokens == 100


async def test_a_router_alone_publishes_nothing(clean_redis_url: str) -> None:
    clients: list[Any] = [aioredis.Redis.from_url(clean_redis_url) for _ in range(2)]
    a = DecisionShare(clients[0], "ra", _core())
    await a.start()
    b: DecisionShare | None = None
    try:
        stream: list[Any] = []
        while not stream:  # its hello, once written
            await asyncio.sleep(0.01)
            stream = await clients[0].xrange(keys.DECISIONS_KEY)
        hashes = a.core.hashes(list(range(64)))
        a.core.begin("alone", a.core.decide(hashes, 64), hashes, 64)
        a.core.prefilled("alone")
        await asyncio.sleep(0.1)  # fifty flush intervals
        stream = await clients[0].xrange(keys.DECISIONS_KEY)
        assert [fields[b"k"] for _, fields in stream] == [b"h"]  # its hello, no flight
        assert a.stats()["published"] == 0

        b = DecisionShare(clients[1], "rb", _core())
        await b.start()
        await eventually(lambda: a.others == {b.instance} and b.others == {a.instance})
        a.core.begin("shared", a.core.decide(hashes, 64), hashes, 64)
        await eventually(lambda: (a.instance, "shared") in b.core.remote)
        # The flight begun alone was never seen to begin: its end is not published.
        a.core.finish("alone")
        a.core.finish("shared")
        await eventually(lambda: not b.core.remote)
        stream = await clients[0].xrange(keys.DECISIONS_KEY)
        entries = [(f[b"r"].decode(), f[b"k"], f.get(b"a"), f.get(b"q")) for _, f in stream]
        assert entries == [
            (a.instance, b"h", b"0", None),
            (b.instance, b"h", b"0", None),  # b's start
            (a.instance, b"h", b"1", None),  # a's answer
            (a.instance, b"b", None, b"shared"),
            (a.instance, b"p", None, b"shared"),
            (a.instance, b"f", None, b"shared"),
        ]
        await eventually(lambda: a.stats()["published"] == 3)  # counted after the write, above
        assert (a.stats()["published"], a.stats()["hellos"], b.stats()["hellos"]) == (3, 2, 1)
        assert b.stats()["applied"] == 3
    finally:
        for share in (a, b):
            if share is not None:
                await share.aclose()
        for client in clients:
            await client.aclose()


async def test_a_dead_routers_flights_end(clean_redis_url: str) -> None:
    async with _shares(clean_redis_url, alive_ttl_s=0.6) as (a, b):
        hashes = a.core.hashes(list(range(64)))
        a.core.begin("req-1", a.core.decide(hashes, 64), hashes, 64)
        await eventually(lambda: (a.instance, "req-1") in b.core.remote)
        for task in a._tasks[1:]:  # a dies: no more entries, no heartbeat
            task.cancel()
        await eventually(lambda: not b.core.remote, timeout_s=5.0)
        assert b.stats()["forgotten"] == 1
        assert b.stats()["other_routers"] == []


# -- two router processes ------------------------------------------------------------------------


def _post(base: str, body: dict[str, Any], out: list[str]) -> None:
    """The worker that answered, or why none did (a router killed mid-request)."""
    try:
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    except httpx.HTTPError as exc:
        out.append(type(exc).__name__)
        return
    out.append(answer.headers.get("x-kvmesh-worker", f"HTTP {answer.status_code}"))


def _inflight(base: str) -> dict[str, dict[str, int]]:
    workers = httpx.get(f"{base}/workers").json()["workers"]
    return {w["worker"]: w["other_routers"] for w in workers}


@pytest.mark.timeout(180)
def test_two_router_processes_choose_as_one(embedded_redis: EmbeddedRedis) -> None:
    redis_url = embedded_redis.url
    with contextlib.ExitStack() as stack:
        workers = {}
        for worker in ("w0", "w1"):
            port = free_port()
            # Slow prefill (3 ms a token): the burst is placed before any stored event arrives.
            args = sim_worker_args(worker, port, redis_url, num_blocks=512, heartbeat_ttl_s=5)
            args += ["--sim-prefill-us-per-token", "3000", "--sim-step-overhead-ms", "5"]
            proc = stack.enter_context(service_process("worker", args))
            workers[worker] = (f"http://127.0.0.1:{port}", proc)
        routers = {}
        for name in ("ra", "rb"):
            base = f"http://127.0.0.1:{free_port()}"
            args = ["--port", base.rpartition(":")[2], "--redis-url", redis_url]
            args += ["--router-id", name, "--load-interval-s", "0.05"]
            routers[name] = (base, stack.enter_context(service_process("router", args)))
        for url, proc in [*workers.values(), *routers.values()]:
            wait_ready(url, proc)

        def all_see_both() -> bool:
            return all(
                sorted(w["worker"] for w in httpx.get(f"{b}/workers").json()["workers"])
                == ["w0", "w1"]
                for b, _ in routers.values()
            )

        wait_for(all_see_both)
        prefix = list(range(100, 196))  # 6 blocks every request shares
        bodies = [
            {"prompt": prefix + list(range(200 + 20 * i, 220 + 20 * i)), "max_tokens": 60}
            for i in range(8)
        ]
        # One request through ra: before its worker's events could arrive (its prefill takes
        # 0.35 s), rb counts it and places the same prefix on the same worker. Its 200 tokens
        # (1 s of decoding) keep it in flight while rb is asked, on a loaded machine too.
        first: list[str] = []
        long_first = {**bodies[0], "max_tokens": 200}
        thread = threading.Thread(target=_post, args=(routers["ra"][0], long_first, first))
        thread.start()

        def rb_counts_it() -> bool:
            return any(v["running"] == 1 for v in _inflight(routers["rb"][0]).values())

        wait_for(rb_counts_it, timeout_s=1.0)
        where = next(w for w, v in _inflight(routers["rb"][0]).items() if v["running"] == 1)
        explained = httpx.post(
            f"{routers['rb'][0]}/route/explain", json={"prompt": bodies[1]["prompt"]}
        ).json()
        assert explained["worker"] == where
        matched = {w["worker"]: w["matched_blocks"] for w in explained["workers"]}
        assert matched == {where: 6, ("w1" if where == "w0" else "w0"): 0}
        thread.join(timeout=30)
        assert first == [where]

        chosen: list[str] = []
        threads = []
        for i, body in enumerate(bodies):  # alternating routers, 30 ms apart
            base = routers["ra" if i % 2 == 0 else "rb"][0]
            thread = threading.Thread(target=_post, args=(base, body, chosen))
            thread.start()
            threads.append(thread)
            asyncio.run(asyncio.sleep(0.03))

        # While they run, each router counts the other's requests (shared through Redis: soon).
        def running(name: str) -> int:
            return sum(v["running"] for v in _inflight(routers[name][0]).values())

        wait_for(lambda: running("ra") > 0 and running("rb") > 0)
        routers["ra"][1].send_signal(signal.SIGKILL)  # mid-burst
        for thread in threads:
            thread.join(timeout=60)
        assert len(chosen) == 8
        ok = [w for w in chosen if w in ("w0", "w1")]
        assert len(ok) >= 4 and set(ok) == {where}, chosen  # one worker for the whole burst
        # ra died with requests in flight: rb's view of them is gone within its heartbeat TTL.
        wait_for(lambda: all(v["running"] == 0 for v in _inflight(routers["rb"][0]).values()))
        stats = httpx.get(f"{routers['rb'][0]}/index/stats").json()["sharing"]
        assert stats["router_id"] == "rb"
        assert stats["dropped"] == 0
        assert stats["other_routers"] == []
