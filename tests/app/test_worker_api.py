"""The worker's HTTP API in-process (httpx ASGITransport inside the lifespan), on a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from cache import block_hashes_for_tokens
from events import keys
from tests.app.worker_support import (
    AUTH,
    VOCAB,
    complete,
    expected_output,
    tree,
    worker_client,
    worker_settings,
)
from tests.events.support import index_blocks, make_consumer
from tests.support.wait import eventually

TPB = 16


# -- completions -------------------------------------------------------------------------------


async def test_completion_reports_cached_tokens_and_deterministic_output(
    clean_redis_url: str,
) -> None:
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    async with worker_client(worker_settings(clean_redis_url)) as (client, runtime):
        first = await complete(client, prompt=prompt, max_tokens=5, request_id="a")
        second = await complete(client, prompt=prompt, max_tokens=5, request_id="b")
        other = await complete(client, prompt=[*prompt[:32], 1, 2, 3], max_tokens=2)
        assert runtime.mgr.get_num_free_blocks() == 256

    assert first["id"] == "a"
    assert first["object"] == "text_completion"
    assert first["choices"][0]["token_ids"] == expected_output(prompt, 5)
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"] == {
        "prompt_tokens": 40,
        "completion_tokens": 5,
        "total_tokens": 45,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # The whole prompt is cached but its last token is never matched (as TensorRT-LLM).
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 39}
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    # Two full blocks shared; the third differs from its first token on.
    assert other["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    timings = second["kvmesh"]
    assert timings["worker_id"] == "w0"
    assert timings["request_id"] == "b"
    assert timings["preemptions"] == 0
    assert 0 <= timings["queue_ms"] <= timings["ttft_ms"] <= timings["e2e_ms"]


async def test_streaming_sends_a_chunk_per_step_then_usage_then_done(clean_redis_url: str) -> None:
    prompt = list(range(50))
    async with (
        worker_client(worker_settings(clean_redis_url)) as (client, _),
        client.stream(
            "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "stream": True}
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [orjson.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    streamed = [t for chunk in chunks[:-1] for t in chunk["choices"][0]["token_ids"]]
    assert streamed == expected_output(prompt, 4)
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 4
    assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_chunked_prefill_gives_the_same_tokens(clean_redis_url: str) -> None:
    prompt = list(range(7, 107))  # 100 tokens in chunks of 32 (a multiple of the block size)
    settings = worker_settings(clean_redis_url, max_tokens_per_step=32)
    async with worker_client(settings) as (client, runtime):
        data = await complete(client, prompt=prompt, max_tokens=3)
        # 100 prompt tokens in 4 steps (32, 32, 32, 4), then 2 decode steps.
        assert runtime.engine.stats.steps == 6
        assert runtime.engine.stats.prefill_tokens == 100
    assert data["choices"][0]["token_ids"] == expected_output(prompt, 3)


async def test_events_rebuild_the_worker_tree_exactly(clean_redis_url: str) -> None:
    prompts = [[base + i for i in range(70)] for base in (0, 0, 100, 200)]
    async with (
        worker_client(worker_settings(clean_redis_url, num_gpu_blocks=16)) as (client, runtime),
        make_consumer(clean_redis_url) as consumer,
    ):
        for prompt in prompts:
            await complete(client, prompt=prompt, max_tokens=20)
        await runtime.publisher.flush(5.0)
        assert runtime.mgr.events is not None
        last = runtime.mgr.events.next_event_id - 1
        await eventually(lambda: consumer.last_seq("w0") == last)
        assert index_blocks(consumer.index, "w0") == tree(runtime)
        # The router's lookup: the hashes of a request's full blocks, matched in the index.
        hashes = block_hashes_for_tokens(prompts[3], TPB)
        assert consumer.index.find_matches(hashes) == {"w0": len(hashes)}


async def test_registry_load_and_heartbeat_are_published(clean_redis_url: str) -> None:
    import redis.asyncio as aioredis

    settings = worker_settings(clean_redis_url, advertise_url="http://gpu7:8001")
    async with worker_client(settings) as (client, runtime):
        await complete(client, prompt=list(range(20)), max_tokens=2)
        redis = aioredis.Redis.from_url(clean_redis_url)
        try:
            entry = orjson.loads(await redis.hget(keys.WORKERS_KEY, "w0") or b"{}")
            assert await redis.exists(keys.alive_key("w0")) == 1
            await eventually(lambda: runtime.engine.load["free_blocks_0"] == 256)
        finally:
            await redis.aclose()
    assert entry["url"] == "http://gpu7:8001"
    assert entry["tokens_per_block"] == TPB
    assert entry["capacity"] == [256, 0]
    assert (entry["engine"], entry["model"], entry["vocab_size"]) == ("sim", "tiny", VOCAB)


# -- bad input: a 4xx naming the problem, and no trace --------------------------------------------


BAD_INPUTS: list[tuple[dict[str, Any], int, str, str | None]] = [
    ({"prompt": []}, 400, "prompt: must hold at least one token id", "prompt"),
    (
        {"prompt": [1, 2, 512]},
        400,
        "prompt: token id 512 at index 2 is outside the vocabulary 0..511",
        "prompt",
    ),
    (
        {"prompt": [1, -1]},
        400,
        "prompt: token id -1 at index 1 is outside the vocabulary 0..511",
        "prompt",
    ),
    (
        {"prompt": "hello"},
        400,
        "prompt: this worker has no tokenizer (--tokenizer); send token ids, or text to the router",
        "prompt",
    ),
    ({"prompt": [[1, 2]]}, 400, "prompt: one prompt per request (a list of token ids)", "prompt"),
    (
        {"prompt": [1] * 1000, "max_tokens": 25},
        400,
        "max_tokens: this model's maximum context length is 1024 tokens; you requested 1025 "
        "tokens (1000 in the prompt, 25 in the completion): lower max_tokens to at most 24",
        "max_tokens",
    ),
    (
        {"prompt": [1] * 1025, "max_tokens": 1},
        400,
        "prompt: 1025 tokens; this model's window is 1024 tokens (prompt + max_tokens), so a "
        "prompt takes at most 1023",
        "prompt",
    ),
    (  # the prompt fits the window but leaves no room for a single generated token
        {"prompt": [1] * 1024, "max_tokens": 1},
        400,
        "prompt: 1024 tokens; this model's window is 1024 tokens (prompt + max_tokens), so a "
        "prompt takes at most 1023",
        "prompt",
    ),
    (
        {"prompt": [1], "max_tokens": 0},
        400,
        "max_tokens: Input should be greater than or equal to 1",
        "max_tokens",
    ),
    (
        {
            "prompt": [1, 2, 3],
            "retention": {
                "ranges": [
                    {"start": 0, "end": 32, "priority": 80},
                    {"start": 16, "end": 64, "priority": 90},
                ]
            },
        },
        400,
        "retention: token ranges [0, 32) and [16, 64) overlap",
        "retention",
    ),
    (
        {"prompt": [1], "retention": {"ranges": [{"start": 0, "priority": 101}]}},
        400,
        "retention.ranges.0.priority: Input should be less than or equal to 100",
        "retention.ranges.0.priority",
    ),
    ({"max_tokens": 3}, 400, "prompt: Field required", "prompt"),
]


@pytest.mark.parametrize(("body", "status", "message", "param"), BAD_INPUTS)
async def test_bad_completion_requests_get_a_4xx_and_leave_no_trace(
    clean_redis_url: str, body: dict[str, Any], status: int, message: str, param: str | None
) -> None:
    async with worker_client(worker_settings(clean_redis_url)) as (client, runtime):
        assert runtime.mgr.events is not None
        events_before = runtime.mgr.events.next_event_id
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == status
        assert response.json() == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": None,
            }
        }
        assert runtime.engine.jobs == {}
        assert runtime.engine.stats.submitted == 0
        assert runtime.mgr.get_num_free_blocks() == 256
        assert runtime.mgr.events.next_event_id == events_before


async def test_a_request_bigger_than_the_cache_is_refused(clean_redis_url: str) -> None:
    """4 blocks of 16 tokens: 63 prompt tokens and 2 generated need 5 (max_tokens is what to
    lower), 64 and even 1 generated need 5 too (the prompt is what to shorten)."""
    async with worker_client(worker_settings(clean_redis_url, num_gpu_blocks=4)) as (client, _):
        completion = await client.post(
            "/v1/completions", json={"prompt": [1] * 63, "max_tokens": 2}
        )
        prompt = await client.post("/v1/completions", json={"prompt": [1] * 64, "max_tokens": 1})
        fits = await client.post("/v1/completions", json={"prompt": [1] * 63, "max_tokens": 1})
    assert completion.status_code == 400
    assert completion.json()["error"] == {
        "message": "max_tokens: the request needs 5 KV cache blocks, the worker has 4",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": None,
    }
    assert prompt.status_code == 400
    assert prompt.json()["error"] == {
        "message": "prompt: 64 tokens and one generated need 5 KV cache blocks, the worker has 4",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }
    assert fits.status_code == 200, fits.text


async def test_malformed_json_and_oversized_bodies(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url, max_body_bytes=1_000)) as (
        client,
        _,
    ):
        broken = await client.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        big = await client.post("/v1/completions", json={"prompt": [1] * 600})
    assert broken.status_code == 400
    assert broken.json()["error"] == {
        "message": "the body is not valid JSON: unexpected character, expected a string key at "
        "line 1 column 2 (character 1)",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    assert big.status_code == 413
    assert big.json()["error"]["message"] == "request body is larger than 1000 bytes"


async def test_a_chunked_body_over_the_limit_is_413(clean_redis_url: str) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": ['
        for _ in range(300):
            yield b"1, "
        yield b"1]}"

    async with worker_client(worker_settings(clean_redis_url, max_body_bytes=500)) as (client, _):
        response = await client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert "content-length" not in response.request.headers
    assert response.status_code == 413
    assert response.json()["error"] == {
        "message": "request body is larger than 500 bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


async def test_unknown_sequence_and_block_are_404(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url)) as (client, _):
        sequence = await client.get("/sequences/nope")
        block = await client.get("/blocks/12345")
        cancel = await client.post("/requests/nope/cancel", headers=AUTH)
        pin = await client.post("/blocks/pin", json={"block_hashes": [7]}, headers=AUTH)
    assert (sequence.status_code, sequence.json()["error"]["message"]) == (
        404,
        "no live request with id 'nope'",
    )
    assert (block.status_code, block.json()["error"]["message"]) == (
        404,
        "no block with hash 12345 in the reuse tree",
    )
    assert cancel.status_code == 404
    assert (pin.status_code, pin.json()["error"]["message"]) == (
        404,
        "no block with hash 7 in the reuse tree (window 1024)",
    )


# -- in-flight requests: duplicates, a full queue, cancellation, draining -------------------------

SLOW = {"sim_step_overhead_ms": 20.0, "max_batch_size": 1}


async def test_duplicate_request_id_is_409_while_in_flight(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url, **SLOW)) as (client, runtime):
        first = asyncio.create_task(
            client.post(
                "/v1/completions", json={"prompt": [1, 2], "max_tokens": 5, "request_id": "x"}
            )
        )
        await eventually(lambda: "x" in runtime.engine.jobs)
        duplicate = await client.post(
            "/v1/completions", json={"prompt": [3], "max_tokens": 1, "request_id": "x"}
        )
        assert (await first).status_code == 200
    assert duplicate.status_code == 409
    assert duplicate.json()["error"] == {
        "message": "request_id 'x' is already in flight",
        "type": "conflict_error",
        "param": "request_id",
        "code": None,
    }


async def test_full_queue_is_429_with_retry_after(clean_redis_url: str) -> None:
    settings = worker_settings(clean_redis_url, max_queue_len=1, **SLOW)
    async with worker_client(settings) as (client, runtime):
        running = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": [1], "max_tokens": 4})
        )
        await eventually(lambda: len(runtime.engine.running) == 1)
        waiting = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": [2], "max_tokens": 1})
        )
        await eventually(lambda: runtime.engine.num_waiting == 1)
        refused = await client.post("/v1/completions", json={"prompt": [3], "max_tokens": 1})
        assert [(await running).status_code, (await waiting).status_code] == [200, 200]
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"] == "the queue is full (1 of 1 waiting)"


async def test_cancel_frees_the_blocks_and_ends_the_request(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url, **SLOW)) as (client, runtime):
        pending = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"prompt": list(range(40)), "max_tokens": 500, "request_id": "long"},
            )
        )

        def generated() -> int:
            job = runtime.engine.jobs.get("long")
            return len(job.output) if job is not None else 0

        await eventually(lambda: generated() >= 2)
        sequence = (await client.get("/sequences/long")).json()
        cancelled = await client.post("/requests/long/cancel", headers=AUTH)
        response = await pending
        assert runtime.mgr.get_num_free_blocks() == 256
        assert runtime.engine.jobs == {}
    assert sequence["state"] == "decode"
    assert sequence["num_blocks"] == 3
    assert cancelled.json() == {"request_id": "long", "cancelled": True}
    data = response.json()
    assert data["choices"][0]["finish_reason"] == "cancelled"
    assert 2 <= data["usage"]["completion_tokens"] < 500


async def test_draining_worker_refuses_with_503(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url)) as (client, runtime):
        runtime.engine.draining = True
        response = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        ready = await client.get("/ready")
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert ready.status_code == 503
    assert ready.json()["checks"] == {"engine": True, "redis": True, "admitting": False}


# -- admin API ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "headers", "status", "message"),
    [
        (None, AUTH, 403, "admin calls are disabled: the worker has no admin token"),
        ("secret", {}, 401, "admin calls need 'Authorization: Bearer <token>'"),
        ("secret", {"Authorization": "Basic secret"}, 401, None),
        ("secret", {"Authorization": "Bearer wrong"}, 403, "wrong admin token"),
        ("secret", {"Authorization": "Bearer secret"}, 200, None),
    ],
)
async def test_admin_token_rules(
    clean_redis_url: str,
    token: str | None,
    headers: dict[str, str],
    status: int,
    message: str | None,
) -> None:
    settings = worker_settings(clean_redis_url, admin_token=token)
    async with worker_client(settings) as (client, _):
        response = await client.post("/cache/clear", headers=headers)
        reads = [await client.get(path) for path in ("/stats", "/config", "/blocks", "/events")]
    assert response.status_code == status
    if message is not None:
        assert response.json()["error"]["message"] == message
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    assert [r.status_code for r in reads] == [200, 200, 200, 200]  # reads need no token


async def test_blocks_snapshot_events_and_stats(clean_redis_url: str) -> None:
    prompt = list(range(36))  # blocks of 16: two full, then 3 + 1 generated... stored at release
    async with worker_client(worker_settings(clean_redis_url)) as (client, runtime):
        await complete(client, prompt=prompt, max_tokens=2)
        page = (await client.get("/blocks", params={"tokens": "true"})).json()
        first = page["blocks"][0]
        one = (await client.get(f"/blocks/{first['hash']}")).json()
        snapshot = (await client.get("/snapshot")).json()
        events = (await client.get("/events", params={"since": 0})).json()
        stats = (await client.get("/stats")).json()
        config = (await client.get("/config")).json()
        expected_tree = tree(runtime)
    hashes = block_hashes_for_tokens(prompt + expected_output(prompt, 1), TPB)
    assert page["total"] == 3
    assert [b["hash"] for b in page["blocks"]] == [*hashes, page["blocks"][2]["hash"]]
    assert {b["hash"] for b in page["blocks"]} == set(expected_tree)
    assert first["tokens"] == prompt[:16]
    assert (first["parent_hash"], first["level"], first["ref_count"]) == (None, 0, 0)
    assert page["blocks"][1]["parent_hash"] == hashes[0]
    assert page["blocks"][2]["num_tokens"] == 36 + 1 - 32  # the partial block at release
    assert one == {**first, "tokens": None}
    assert snapshot["num_blocks"] == 3
    # After the prefill, the prompt's full blocks; at release, the partial tail.
    stored = [
        (e["event_id"], e["data"]["parent_hash"], [b["block_hash"] for b in e["data"]["blocks"]])
        for e in events["events"]
    ]
    assert stored == [(1, None, hashes), (2, hashes[1], [page["blocks"][2]["hash"]])]
    assert events["oldest_event_id"] == 0
    assert events["truncated"] is False
    assert stats["engine"]["reused_prompt_tokens"] == 0
    assert stats["engine"]["computed_prompt_tokens"] == 36
    assert stats["kv_cache"]["free_num_blocks"] == 256
    assert config["worker_id"] == "w0"
    assert config["admin_token_set"] is True
    assert "admin_token" not in config
    assert config["blocks_per_level"] == [256, 0]


async def test_pin_offload_clear(clean_redis_url: str) -> None:
    prompt = list(range(48))
    settings = worker_settings(clean_redis_url, num_host_blocks=8)
    async with worker_client(settings) as (client, runtime):
        await complete(client, prompt=prompt, max_tokens=1)
        hashes = block_hashes_for_tokens(prompt, TPB)  # the 3 blocks stored at release
        pinned = await client.post("/blocks/pin", json={"block_hashes": hashes[:1]}, headers=AUTH)
        assert runtime.mgr.get_num_free_blocks() == 255
        offloaded = await client.post("/cache/offload", json={"max_blocks": 2}, headers=AUTH)
        levels = {b["hash"]: b["level"] for b in (await client.get("/blocks")).json()["blocks"]}
        cleared = await client.post("/cache/clear", headers=AUTH)
        left = (await client.get("/blocks")).json()
        unpinned = await client.post(
            "/blocks/unpin", json={"block_hashes": hashes[:1]}, headers=AUTH
        )
        assert runtime.mgr.get_num_free_blocks() == 256
        again = await complete(client, prompt=prompt, max_tokens=1)
    assert pinned.status_code == 200
    assert offloaded.json() == {"count": 2}
    # Eviction order: the pinned block is not free, so the two next ones move to the host.
    assert [levels[h] for h in hashes] == [0, 1, 1]
    assert cleared.json() == {"count": 2}  # all but the pinned block
    assert [b["hash"] for b in left["blocks"]] == hashes[:1]
    assert unpinned.json() == pinned.json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


async def test_metrics_in_prometheus_format(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url)) as (client, _):
        await complete(client, prompt=list(range(40)), max_tokens=2)
        await complete(client, prompt=list(range(40)), max_tokens=2)
        response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = set(response.text.splitlines())
    for line in (
        'kvmesh_worker_blocks{level="0",state="free"} 256.0',
        'kvmesh_worker_blocks{level="0",state="used"} 0.0',
        'kvmesh_worker_prompt_tokens_total{kind="reused"} 39.0',
        'kvmesh_worker_prompt_tokens_total{kind="computed"} 41.0',
        'kvmesh_worker_requests_total{outcome="finished"} 2.0',
        "kvmesh_worker_queue_depth 0.0",
        "kvmesh_worker_running_sequences 0.0",
        "kvmesh_worker_cache_hit_rate 0.5",
        "kvmesh_worker_time_to_first_token_seconds_count 2.0",
    ):
        assert line in lines, line
    assert any(line.startswith("kvmesh_worker_step_seconds_count") for line in lines)
    assert any(
        line.startswith('kvmesh_worker_events_total{outcome="published",worker="w0"}')
        for line in lines
    )


async def test_openapi_describes_every_route(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url)) as (client, _):
        spec = (await client.get("/openapi.json")).json()
        docs = await client.get("/docs")
    assert docs.status_code == 200
    assert set(spec["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/health",
        "/ready",
        "/stats",
        "/config",
        "/sequences",
        "/sequences/{request_id}",
        "/blocks",
        "/blocks/{block_hash}",
        "/events",
        "/snapshot",
        "/cache/clear",
        "/cache/offload",
        "/blocks/pin",
        "/blocks/unpin",
        "/requests/{request_id}/cancel",
        "/drain",
        "/resume",
        "/metrics",
    }
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}


async def test_the_events_ring_is_bounded_in_blocks(clean_redis_url: str) -> None:
    async with worker_client(worker_settings(clean_redis_url, events_ring_blocks=3)) as (
        client,
        runtime,
    ):
        for base in (0, 100):  # each: 2 full blocks after the prefill, a partial at release
            await complete(client, prompt=list(range(base, base + 40)), max_tokens=2)
        page = (await client.get("/events", params={"since": -1})).json()
        assert runtime.mgr.events is not None
        last = runtime.mgr.events.next_event_id - 1
    blocks = [len(e["data"]["blocks"]) for e in page["events"]]
    # created (0), then stored 2 + 1 for each request: the ring keeps the last 3 blocks.
    assert [e["event_id"] for e in page["events"]] == [last - 1, last]
    assert blocks == [2, 1]
    assert (page["oldest_event_id"], page["latest_event_id"]) == (last - 1, last)
    assert page["truncated"] is True
