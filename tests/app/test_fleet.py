"""Fleet admin through the router: cordon, drain and uncordon, kept in Redis for every router.

In-process: two workers and two router replicas on one private Redis (a cordon told to one
router is honoured by the other, and by a router started later). As processes: ``kvmesh
router`` and two ``kvmesh worker`` sharing an admin token, a drain while a request is in flight
on the worker, reported until done, then undone.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import redis

from app.core.embedded_redis import EmbeddedRedis
from app.router.runtime import RouterRuntime
from events import keys
from tests.app.router_support import router_client, router_settings
from tests.app.worker_support import ADMIN_TOKEN, AUTH, worker_client, worker_settings
from tests.support.processes import two_workers_and_a_router
from tests.support.wait import eventually, wait_for

PROMPT = list(range(100, 200))  # 100 tokens: 6 full blocks of 16


@contextlib.asynccontextmanager
async def two_workers(redis_url: str) -> AsyncIterator[None]:
    """w0 and w1 in-process; w0 has served PROMPT, so it holds the prefix. Their heartbeats last
    6 s, not the tests' usual 2: they beat on the event loop the routers and the test share. On a
    busy CI host a router once dropped w0 in the middle of a check, most likely after a stall of
    over 1.3 s (two beats missed)."""
    async with (
        worker_client(worker_settings(redis_url, worker_id="w0", heartbeat_ttl_s=6.0)) as (w0, _),
        worker_client(worker_settings(redis_url, worker_id="w1", heartbeat_ttl_s=6.0)),
    ):
        assert (await w0.post("/v1/completions", json={"prompt": PROMPT})).status_code == 200
        yield


async def _ready(runtime: RouterRuntime) -> None:
    def holds_prefix() -> bool:
        blocks = runtime.index.stats()["per_worker"].get("w0", {}).get("blocks", 0)
        return blocks >= 6 and "w1" in runtime.core.workers

    await eventually(holds_prefix)
    await eventually(lambda: runtime.readiness()["ready"])


def _states(body: dict[str, Any]) -> dict[str, str]:
    return {w["worker"]: w["state"] for w in body["workers"]}


def _metric_lines(text: str, name: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith(name + "{"))


async def test_a_cordon_is_honoured_by_every_router_and_outlives_them(
    clean_redis_url: str,
) -> None:
    async with (
        two_workers(clean_redis_url),
        router_client(router_settings(clean_redis_url)) as (a, runtime_a),
        router_client(router_settings(clean_redis_url)) as (b, runtime_b),
    ):
        await _ready(runtime_a)
        await _ready(runtime_b)
        assert (await a.post("/route", json={"prompt": PROMPT})).json()["worker"] == "w0"

        # The admin token, and a worker the router knows.
        assert (await a.post("/workers/w0/cordon")).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (await a.post("/workers/w0/cordon", headers=wrong)).status_code == 403
        unknown = await a.post("/workers/w9/cordon", headers=AUTH)
        assert unknown.status_code == 404
        assert unknown.json() == {
            "error": {
                "message": "no worker 'w9': GET /workers lists the workers this router follows",
                "type": "not_found_error",
                "param": "worker_id",
                "code": None,
            }
        }

        before = time.time()
        answer = await a.post("/workers/w0/cordon", headers=AUTH)
        assert answer.status_code == 200, answer.text
        entry = answer.json()
        assert (entry["worker"], entry["state"]) == ("w0", "cordoned")
        assert entry["cordon"]["state"] == "cordoned"
        assert before <= entry["cordon"]["since"] <= time.time()
        # Kept in Redis, where every router reads it.
        with redis.Redis.from_url(clean_redis_url) as client:
            stored = json.loads(client.hget(keys.CORDONS_KEY, "w0") or b"{}")
        assert stored == entry["cordon"]
        # Cordoning again keeps the first time.
        again = (await a.post("/workers/w0/cordon", headers=AUTH)).json()
        assert again["cordon"] == entry["cordon"]

        # This router at once, the other at its next load tick: w1 gets the prefix's requests.
        routed = (await a.post("/route", json={"prompt": PROMPT})).json()
        assert (routed["worker"], [c["worker"] for c in routed["costs"]]) == ("w1", ["w1"])
        await eventually(lambda: runtime_b.core.workers["w0"].state == "cordoned")
        assert (await b.post("/route", json={"prompt": PROMPT})).json()["worker"] == "w1"
        assert _states((await b.get("/workers")).json()) == {"w0": "cordoned", "w1": "up"}
        metrics = (await b.get("/metrics")).text
        assert 'kvmesh_router_workers{state="cordoned"} 1.0' in metrics
        assert _metric_lines(metrics, "kvmesh_router_worker_cordon") == [
            'kvmesh_router_worker_cordon{state="cordoned",worker="w0"} 1.0'
        ]
        # No worker left to take a request: a 503 that says why.
        assert (await b.post("/workers/w1/cordon", headers=AUTH)).status_code == 200
        refused = await b.post("/route", json={"prompt": PROMPT})
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == "every worker is draining or cordoned"
        # An entry someone else wrote that does not parse is skipped, not obeyed.
        with redis.Redis.from_url(clean_redis_url) as client:
            client.hset(keys.CORDONS_KEY, "w1", b"{not json")
        # Counted before a's view drops the cordon it read before (after a Redis round trip).
        await eventually(
            lambda: (
                runtime_a.view.num_bad_cordons == 1 and runtime_a.core.workers["w1"].state == "up"
            )
        )
        assert (await a.post("/route", json={"prompt": PROMPT})).json()["worker"] == "w1"
        assert (await a.post("/workers/w1/uncordon", headers=AUTH)).status_code == 200

    # A router started afterwards finds the cordon in Redis.
    async with (
        two_workers(clean_redis_url),
        router_client(router_settings(clean_redis_url)) as (c, runtime_c),
    ):
        await eventually(
            lambda: (
                {w: v.state for w, v in runtime_c.core.workers.items()}
                == {"w0": "cordoned", "w1": "up"}
            )
        )
        assert _states((await c.get("/workers")).json()) == {"w0": "cordoned", "w1": "up"}
        back = await c.post("/workers/w0/uncordon", headers=AUTH)
        assert (back.status_code, back.json()["state"], back.json()["cordon"]) == (200, "up", None)
        assert "worker_answer" not in back.json()  # only a drain asks the worker to resume
        await _ready(runtime_c)
        assert (await c.post("/route", json={"prompt": PROMPT})).json()["worker"] == "w0"
        with redis.Redis.from_url(clean_redis_url) as client:
            assert client.hgetall(keys.CORDONS_KEY) == {}


async def test_a_cordon_outlives_a_redis_restart(embedded_redis: EmbeddedRedis) -> None:
    """Redis needs no persistence, so a restart empties the cordons hash: the routers write
    back what they knew, and the cordoned worker stays out of rotation."""
    url = embedded_redis.url
    async with two_workers(url), router_client(router_settings(url)) as (router, runtime):
        await _ready(runtime)
        assert (await router.post("/workers/w0/cordon", headers=AUTH)).status_code == 200
        since = runtime.view.cordons["w0"].since
        restarts = runtime.consumer.num_redis_restarts
        embedded_redis.kill()
        embedded_redis.start()

        def written_back() -> bool:
            with redis.Redis.from_url(url) as client:
                return client.hget(keys.CORDONS_KEY, "w0") is not None

        await eventually(written_back)
        await eventually(lambda: runtime.consumer.num_redis_restarts == restarts + 1)
        with redis.Redis.from_url(url) as client:
            stored = json.loads(client.hget(keys.CORDONS_KEY, "w0") or b"{}")
        assert stored == {"state": "cordoned", "since": since}
        assert runtime.core.workers["w0"].state == "cordoned"
        await eventually(lambda: runtime.readiness()["ready"])
        assert (await router.post("/route", json={"prompt": PROMPT})).json()["worker"] == "w1"


def test_a_drain_through_the_router_is_reported_until_done_then_undone(
    clean_redis_url: str,
) -> None:
    env = {"KVMESH_ADMIN_TOKEN": ADMIN_TOKEN}
    # 20 ms steps: a 40-token answer stays in flight for most of a second.
    with two_workers_and_a_router(
        clean_redis_url, num_blocks=64, heartbeat_ttl_s=2.0, step_ms=20.0, env=env
    ) as (base, _, urls):
        w0 = urls["w0"]
        # A request in flight on w0 when the drain starts.
        done: dict[str, httpx.Response] = {}

        def long_request() -> None:
            done["answer"] = httpx.post(
                f"{w0}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 40}, timeout=30
            )

        thread = threading.Thread(target=long_request)
        thread.start()
        wait_for(lambda: httpx.get(f"{w0}/drain").json()["running"] == 1)
        drained = httpx.post(f"{base}/workers/w0/drain", headers=AUTH)
        assert drained.status_code == 200, drained.text
        body = drained.json()
        assert (body["state"], body["cordon"]["state"]) == ("draining", "draining")
        assert body["worker_answer"] == {
            "status": 200,
            "body": {
                "draining": True,
                "shutting_down": False,
                "running": 1,
                "waiting": 0,
                "done": False,
            },
        }
        # The worker itself refuses new requests meanwhile, saying why.
        refused = httpx.post(f"{w0}/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == (
            "the worker is draining (an operator asked for it)"
        )
        # Through the router, everything goes to w1.
        routed = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert routed.headers["x-kvmesh-worker"] == "w1"

        thread.join(30)
        assert done["answer"].status_code == 200  # the one in flight finished

        def finished() -> bool:
            entry = httpx.get(f"{base}/workers").json()["workers"][0]
            return bool(entry["cordon"]["done"])

        wait_for(finished)
        entry = httpx.get(f"{base}/workers").json()["workers"][0]
        assert entry["cordon"]["in_flight"] == {"running": 0, "waiting": 0, "this_router": 0}
        rows = httpx.get(f"{base}/dashboard/state").json()["workers"]
        assert [(r["worker"], r["state"]) for r in rows] == [("w0", "drained"), ("w1", "up")]
        assert 'kvmesh_router_worker_cordon{state="drained",worker="w0"} 1.0' in (
            httpx.get(f"{base}/metrics").text
        )

        # A cordon in place of the drain: the worker still drains (its registry says so), and
        # lifting the cordon asks it to admit again all the same. The router reads the registry
        # once a second, and until then only the drain's cordon said "draining" (a full run
        # of the suite had this cordon answered "cordoned"): it is asked again until it says so.
        def cordon_says_draining() -> bool:
            cordoned = httpx.post(f"{base}/workers/w0/cordon", headers=AUTH).json()
            assert "worker_answer" not in cordoned  # a cordon does not ask the worker
            return bool(cordoned["state"] == "draining")

        wait_for(cordon_says_draining)
        back = httpx.post(f"{base}/workers/w0/uncordon", headers=AUTH)
        assert back.status_code == 200
        assert back.json()["worker_answer"]["body"]["draining"] is False
        again = httpx.post(f"{w0}/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert again.status_code == 200
        wait_for(lambda: _states(httpx.get(f"{base}/workers").json()) == {"w0": "up", "w1": "up"})


async def test_a_worker_drains_and_resumes_but_not_out_of_a_shutdown(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url)) as (client, runtime):
        idle = {"draining": False, "shutting_down": False, "running": 0, "waiting": 0}
        assert (await client.get("/drain")).json() == {**idle, "done": False}
        drained = await client.post("/drain", headers=AUTH)
        assert drained.json() == {**idle, "draining": True, "done": True}
        refused = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert (refused.status_code, refused.headers["retry-after"]) == (503, "5")
        resumed = await client.post("/resume", headers=AUTH)
        assert resumed.json() == {**idle, "done": False}
        ok = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert ok.status_code == 200
        await runtime.drain()  # what SIGTERM does
        conflict = await client.post("/resume", headers=AUTH)
        assert conflict.status_code == 409
        assert conflict.json()["error"] == {
            "message": "the worker is shutting down; it cannot resume",
            "type": "conflict_error",
            "param": None,
            "code": None,
        }
        refused = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert refused.json()["error"]["message"] == "the worker is shutting down"
