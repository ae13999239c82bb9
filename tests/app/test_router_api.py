"""The router's HTTP API in-process, against a private Redis and two in-process workers that
publish real events: decisions, explanations, policies, errors, metrics, agreeing routers."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.cluster.members import Member, parse_load
from app.core.embedded_redis import EmbeddedCluster, EmbeddedRedis
from app.router.policies import Decision
from app.router.runtime import RouterRuntime
from events import keys
from events.consumer import WorkerState
from tests.app.router_support import router_client, router_settings
from tests.app.worker_support import AUTH, worker_client, worker_settings
from tests.support.wait import eventually

PROMPT = list(range(100, 200))  # 100 tokens: 6 full blocks of 16


@contextlib.asynccontextmanager
async def cluster(
    redis_url: str, **router_overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, RouterRuntime, list[httpx.AsyncClient]]]:
    """Two workers (w0, w1) and a router, all in-process; w0 has served PROMPT once."""
    async with (
        worker_client(worker_settings(redis_url, worker_id="w0")) as (w0, _),
        worker_client(worker_settings(redis_url, worker_id="w1")) as (w1, _),
        router_client(router_settings(redis_url, **router_overrides)) as (router, runtime),
    ):
        response = await w0.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
        assert response.status_code == 200
        await eventually(lambda: _blocks(runtime, "w0") >= 6 and "w1" in runtime.core.workers)
        await eventually(lambda: runtime.readiness()["ready"])
        yield router, runtime, [w0, w1]


def _blocks(runtime: RouterRuntime, worker: str) -> int:
    blocks: int = runtime.index.stats()["per_worker"].get(worker, {}).get("blocks", 0)
    return blocks


async def test_route_picks_the_worker_holding_the_prefix(clean_redis_url: str) -> None:
    async with cluster(clean_redis_url) as (router, runtime, _):
        response = await router.post("/route", json={"prompt_token_ids": PROMPT})
        assert response.status_code == 200
        body = response.json()
        assert (body["worker"], body["expected_cached_tokens"], body["fresh"]) == ("w0", 96, True)
        assert (body["policy"], body["num_tokens"], body["num_blocks"]) == ("kv_aware", 100, 6)
        assert body["url"] == runtime.core.workers["w0"].url
        assert [(c["worker"], c["cost"], c["cached_tokens"]) for c in body["costs"]] == [
            ("w0", 4.0, 96),
            ("w1", 100.0, 0),
        ]
        # /route decides only: nothing is counted in flight, nothing predicted.
        assert runtime.core.inflight == {}
        assert runtime.core.num_predicted("w0") == 0

        explained = (await router.post("/route/explain", json={"prompt": PROMPT})).json()
        workers = {w["worker"]: w for w in explained["workers"]}
        assert {k: workers["w0"][k] for k in ("matched_blocks", "index_blocks", "gpu_blocks")} == {
            "matched_blocks": 6,
            "index_blocks": 6,
            "gpu_blocks": 6,
        }
        assert (workers["w0"]["host_blocks"], workers["w0"]["predicted_blocks"]) == (0, 0)
        assert (workers["w1"]["matched_blocks"], workers["w1"]["state"]) == (0, "up")
        assert workers["w1"]["free_blocks"] == 256
        same = (await router.post("/route?explain=true", json={"prompt": PROMPT})).json()
        assert [w["worker"] for w in same["workers"]] == ["w0", "w1"]

        # A salted or LoRA prompt lives in another namespace: nobody holds it.
        for extra in ({"cache_salt": "tenant-a"}, {"lora_task_id": 7}):
            salted = (await router.post("/route", json={"prompt": PROMPT, **extra})).json()
            assert [c["cached_tokens"] for c in salted["costs"]] == [0, 0]


async def test_policy_per_request_and_per_router(clean_redis_url: str) -> None:
    async with cluster(clean_redis_url) as (router, runtime, _):
        body = {"prompt": PROMPT, "routing": {"weights": {"load": 0.0}, "policy": "least_loaded"}}
        decision = (await router.post("/route", json=body)).json()
        assert decision["policy"] == "least_loaded"
        assert decision["expected_cached_tokens"] == 0 or decision["worker"] == "w0"

        update = {"policy": "round_robin", "weights": {"decode": 2.0}}
        assert (await router.put("/policy", json=update)).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (await router.put("/policy", json=update, headers=wrong)).status_code == 403
        response = await router.put("/policy", json=update, headers=AUTH)
        assert response.status_code == 200
        assert response.json()["policy"] == "round_robin"
        assert response.json()["weights"]["decode"] == 2.0
        assert response.json()["weights"]["load"] == 0.1
        assert (await router.get("/policy")).json() == response.json()
        workers = [
            (await router.post("/route", json={"prompt": PROMPT})).json()["worker"]
            for _ in range(4)
        ]
        assert workers == ["w0", "w1", "w0", "w1"]
        bad = await router.put("/policy", json={"policy": "nope"}, headers=AUTH)
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "policy"
        assert runtime.core.policy == "round_robin"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, None, "give exactly one of prompt_token_ids, prompt and messages"),
        (
            {"prompt": [1], "prompt_token_ids": [1]},
            None,
            "give exactly one of prompt_token_ids, prompt and messages",
        ),
        ({"prompt": []}, "prompt", "prompt: must hold at least one token"),
        ({"prompt": [1, -2]}, "prompt", "prompt: token ids must be within 0..2**32-1"),
        (
            {"prompt": [1], "routing": {"policy": "fastest"}},
            "routing.policy",
            None,
        ),
        (
            {"prompt": [1], "routing": {"weights": {"load": -1}}},
            "routing.weights.load",
            None,
        ),
        (
            {"prompt": [1], "routing": {"weights": {"decode": 1e300}}},
            "routing.weights.decode",
            None,
        ),
        ({"prompt": [1], "lora_task_id": -1}, "lora_task_id", None),
        ({"prompt": [1], "surprise": 1}, "surprise", None),
    ],
)
async def test_bad_route_requests_get_400_naming_the_field(
    clean_redis_url: str, body: dict[str, Any], param: str | None, message: str | None
) -> None:
    async with router_client(router_settings(clean_redis_url)) as (router, _):
        response = await router.post("/route", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert error["type"] == "invalid_request_error"
        if message is not None:
            assert error["message"] == message


async def test_no_worker_is_a_503_with_retry_after(clean_redis_url: str) -> None:
    async with router_client(router_settings(clean_redis_url, retry_after_s=3)) as (
        router,
        runtime,
    ):
        await eventually(lambda: runtime.view.synced_once and runtime.view.redis_ok)
        for path, body in (
            ("/route", {"prompt": [1, 2]}),
            ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
        ):
            response = await router.post(path, json=body)
            assert response.status_code == 503
            assert response.headers["retry-after"] == "3"
            assert response.json()["error"]["message"] == "no worker is up"
        ready = await router.get("/ready")
        assert ready.status_code == 503
        assert ready.json()["reasons"] == ["no worker is up with fresh data"]
        assert (await router.get("/health")).json() == {"status": "ok"}


async def test_the_view_reads_loads_heartbeats_and_the_first_unread_entry(
    clean_redis_url: str,
) -> None:
    """Each worker's load hash, heartbeat TTL and the first stream entry its consumer has not
    read (none when up to date), with no stream entry's payload (XINFO STREAM sent two)."""
    async with cluster(clean_redis_url) as (_, runtime, _):
        view = runtime.view
        redis: Any = view.redis
        w0, w1 = (view.members[worker] for worker in ("w0", "w1"))
        # A member read from the start of w0's stream: its first entry is not read yet.
        behind = Member("w0", copy.copy(w0.follow))
        behind.follow.pos = "0-0"
        members = [w0, w1, behind]
        first = (await redis.xrange(w0.follow.key, count=1))[0][0]
        _, replies = await view._read_members(members)
        assert [reply[2] for reply in replies] == [None, None, first]  # w1 has no stream yet
        for member, (load, pttl, _) in zip(members, replies, strict=True):
            fields = await redis.hkeys(keys.load_key(member.worker))
            assert sorted(load) == sorted(fields) and b"free_blocks_0" in load
            assert 0 < pttl <= 10_000  # the heartbeat's, in ms


def test_a_load_field_past_64_bits_is_left_out() -> None:
    """A load hash's fields are read as 64-bit integers, as Redis holds them: one that is not an
    integer, or past the range (a speed of 10**308 ns per token made kv_aware's cost NaN), is
    left out, and the rest of the report is kept."""
    raw = {
        b"queued_prefill_tokens": b"12",
        b"prefill_ns_per_token": str(10**308).encode(),
        b"step_overhead_us": str(1 << 63).encode(),
        b"decode_ns_per_sequence": str((1 << 63) - 1).encode(),
        b"max_tokens_per_step": str(-(1 << 63)).encode(),
        b"free_blocks_0": str(-(1 << 63) - 1).encode(),
        b"running_requests": b"two",
    }
    assert parse_load(raw) == {
        "queued_prefill_tokens": 12,
        "decode_ns_per_sequence": (1 << 63) - 1,
        "max_tokens_per_step": -(1 << 63),
    }
    assert parse_load([b"not", b"a hash"]) == {}


@pytest.mark.parametrize(
    ("info", "capacity", "tokens_per_block"),
    [
        ({"capacity": [4096, 0], "tokens_per_block": 16}, 4096, 16),
        ({"capacity": [float("inf")], "tokens_per_block": 0}, 0, None),
        ({"capacity": ["many"], "tokens_per_block": True}, 0, None),
        ({"capacity": [], "tokens_per_block": -16}, 0, None),
        ({"capacity": [-5]}, 0, None),
        ({"capacity": [1e300], "tokens_per_block": 1}, (1 << 63) - 1, 1),
    ],
)
def test_a_registry_entry_is_read_without_raising(
    info: dict[str, Any], capacity: int, tokens_per_block: int | None
) -> None:
    """What a worker's registry entry says of its capacity and block size (JSON: Infinity
    parses as a float that int() cannot take); a block size below 1 is none, and the router
    leaves that worker out as incompatible."""
    member = Member("w0", WorkerState("w0", b"kv:w0", info=info))
    assert (member.capacity_blocks, member.tokens_per_block) == (capacity, tokens_per_block)


async def test_a_large_body_is_refused(clean_redis_url: str) -> None:
    async with router_client(router_settings(clean_redis_url, max_body_bytes=1_024)) as (
        router,
        _,
    ):
        response = await router.post("/route", json={"prompt": list(range(1_000))})
        assert response.status_code == 413
        assert response.json()["error"]["message"] == "request body is larger than 1024 bytes"


async def test_workers_index_stats_and_metrics(clean_redis_url: str) -> None:
    async with cluster(clean_redis_url) as (router, runtime, _):
        await router.post("/route", json={"prompt": PROMPT})
        workers = {w["worker"]: w for w in (await router.get("/workers")).json()["workers"]}
        assert sorted(workers) == ["w0", "w1"]
        w0 = workers["w0"]
        assert (w0["state"], w0["alive"], w0["synced"], w0["capacity_blocks"]) == (
            "up",
            True,
            True,
            256,
        )
        assert w0["blocks"] == {"gpu": _blocks(runtime, "w0"), "host": 0}
        assert w0["load"]["free_blocks_0"] == 256
        assert 0 <= w0["heartbeat_age_s"] < 2.0
        stats = (await router.get("/index/stats")).json()
        assert stats["tokens_per_block"] == 16
        assert stats["index"]["per_worker"]["w0"]["blocks"] == _blocks(runtime, "w0")
        assert stats["consumer"]["synced_workers"] == 2
        text = (await router.get("/metrics")).text
        assert 'kvmesh_router_decisions_total{policy="kv_aware",worker="w0"} 1.0' in text
        assert 'kvmesh_router_expected_cached_tokens_total{worker="w0"} 96.0' in text
        assert 'kvmesh_router_workers{state="up"} 2.0' in text
        assert "kvmesh_router_decision_seconds_count 1.0" in text
        assert "kvmesh_router_consumer_resyncs_total 0.0" in text

        # Decisions are counted at each scrape, and every 64 between scrapes (what waits
        # stays bounded: 1,024 of these 1,030 before the scrape).
        stale = Decision("w1", "kv_aware", 32, (), fresh=False)
        for _ in range(1_030):
            runtime.metrics.observe_decision(stale, 1e-4, 64)
        counted = [
            (sample.labels["worker"], sample.value)
            for family in runtime.metrics.decisions.collect()
            for sample in family.samples
            if sample.name.endswith("_total")
        ]
        assert sorted(counted) == [("w0", 1.0), ("w1", 1_024.0)]
        text = (await router.get("/metrics")).text
        assert 'kvmesh_router_decisions_total{policy="kv_aware",worker="w1"} 1030.0' in text
        assert 'kvmesh_router_stale_decisions_total{worker="w1"} 1030.0' in text
        assert "kvmesh_router_decision_seconds_count 1031.0" in text
        assert "kvmesh_router_prompt_tokens_total 66020.0" in text


async def test_two_routers_agree(clean_redis_url: str) -> None:
    async with (
        cluster(clean_redis_url) as (first, _, _),
        router_client(router_settings(clean_redis_url)) as (second, runtime2),
    ):
        await eventually(lambda: _blocks(runtime2, "w0") >= 6 and runtime2.readiness()["ready"])
        prompts = [PROMPT, PROMPT[:50], list(range(7, 90)), *([i] * 40 for i in range(12))]
        answers = []
        for router in (first, second):
            answers.append(
                [
                    (await router.post("/route", json={"prompt": p})).json()["worker"]
                    for p in prompts
                ]
            )
        assert answers[0] == answers[1]
        assert answers[0][:2] == ["w0", "w0"]
        assert set(answers[0]) == {"w0", "w1"}


async def test_text_prompts_use_the_tokenizer(clean_redis_url: str, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(200)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    text = " ".join(f"w{t - 1}" for t in PROMPT)  # ids 100..199 again
    async with cluster(clean_redis_url, tokenizer=str(path)) as (router, _, _):
        body = (await router.post("/route", json={"prompt": text})).json()
        assert (body["num_tokens"], body["worker"], body["expected_cached_tokens"]) == (
            100,
            "w0",
            96,
        )


async def test_without_redis_the_router_routes_on_what_it_knew_and_says_so(
    embedded_redis: EmbeddedRedis,
) -> None:
    async with cluster(embedded_redis.url) as (router, runtime, _):
        embedded_redis.kill()
        await eventually(
            lambda: {v.stale_reason for v in runtime.core.workers.values()} == {"redis_unreachable"}
        )
        body = (await router.post("/route", json={"prompt": PROMPT})).json()
        assert (body["worker"], body["expected_cached_tokens"], body["fresh"]) == ("w0", 96, False)
        ready = (await router.get("/ready")).json()
        assert ready["stale"] == {"w0": "redis_unreachable", "w1": "redis_unreachable"}
        assert "redis is not answering" in ready["reasons"]
        embedded_redis.start()
        # Ready once one worker is fresh; every one is once its load is written again too.
        await eventually(
            lambda: runtime.readiness()["ready"] and not runtime.readiness()["stale"],
            timeout_s=20,
        )
        assert (await router.post("/route", json={"prompt": PROMPT})).json()["fresh"] is True


async def test_the_fast_path_answers_as_the_full_route(clean_redis_url: str) -> None:
    """A plain body takes the fast path; a query string sends the same body through FastAPI."""
    async with cluster(clean_redis_url) as (router, runtime, _):
        seen: list[tuple[Any, ...]] = []  # every decision reaches the hooks (the dashboard's)
        runtime.decision_hooks.append(lambda *decision: seen.append(decision))
        bodies: list[dict[str, Any]] = [
            {"prompt_token_ids": PROMPT},
            {"prompt": PROMPT[:40], "cache_salt": "s"},
            {"prompt": PROMPT, "lora_task_id": 3},
        ]
        for body in bodies:
            fast = (await router.post("/route", json=body)).json()
            full = (await router.post("/route?explain=false", json=body)).json()
            fast.pop("decision_us")
            full.pop("decision_us")
            assert fast == full
        assert [d[1] for d in seen] == ["route"] * (2 * len(bodies))
        # Bodies the fast path leaves alone get the full route's errors.
        bad = await router.post("/route", json={"prompt_token_ids": [1, 2**32]})
        assert bad.json()["error"]["message"] == (
            "prompt_token_ids: token ids must be within 0..2**32-1"
        )
        assert (await router.post("/route", content=b"{not json")).status_code == 400


async def test_the_router_and_workers_on_a_redis_cluster() -> None:
    with EmbeddedCluster(3) as redis_cluster:
        async with cluster(redis_cluster.url) as (router, runtime, _):
            body = (await router.post("/route", json={"prompt": PROMPT})).json()
            assert (body["worker"], body["expected_cached_tokens"], body["fresh"]) == (
                "w0",
                96,
                True,
            )
            assert runtime.readiness()["ready"]
            workers = {w["worker"]: w for w in (await router.get("/workers")).json()["workers"]}
            assert [workers[w]["state"] for w in ("w0", "w1")] == ["up", "up"]
