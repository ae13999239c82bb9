"""The worker's engine under load and under pressure, and the torch back-end end to end."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import httpx
import pytest

from app.worker.torch_backend import TinyDecoder, TinyDecoderConfig, dense_generate
from tests.app.worker_support import (
    AUTH,
    complete,
    expected_output,
    tree,
    worker_client,
    worker_settings,
)
from tests.events.support import index_blocks, make_consumer
from tests.support.wait import eventually


@pytest.mark.parametrize("scheduler", ["guaranteed_no_evict", "max_utilization"])
async def test_a_thousand_concurrent_completions_on_a_small_pool(
    clean_redis_url: str, scheduler: str
) -> None:
    """Every call completes (with the right tokens) or is refused with 429; none is lost; all
    blocks are free at the end; the published events rebuild the worker's tree exactly."""
    rng = random.Random(8)
    prefixes = [[rng.randrange(512) for _ in range(48)] for _ in range(5)]
    requests: list[dict[str, Any]] = []
    for i in range(1_000):
        prefix = prefixes[rng.randrange(5)][: rng.randrange(1, 49)]
        tail = [rng.randrange(512) for _ in range(rng.randrange(0, 40))]
        requests.append(
            {"prompt": prefix + tail, "max_tokens": rng.randrange(1, 24), "request_id": f"r{i}"}
        )
    settings = worker_settings(
        clean_redis_url,
        num_gpu_blocks=48,
        max_batch_size=16,
        max_queue_len=300,
        max_tokens_per_step=256,
        scheduler=scheduler,
    )
    async with (
        worker_client(settings) as (client, runtime),
        make_consumer(clean_redis_url) as consumer,
    ):
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for body in requests)
        )
        statuses = Counter(r.status_code for r in responses)
        assert set(statuses) <= {200, 429}
        assert statuses[200] >= 300
        for body, response in zip(requests, responses, strict=True):
            if response.status_code == 200:
                data = response.json()
                assert data["choices"][0]["token_ids"] == expected_output(
                    body["prompt"], body["max_tokens"]
                )
            else:
                assert response.headers["retry-after"] == "1"
        stats = runtime.engine.stats
        assert (stats.submitted, stats.finished, stats.cancelled, stats.failed, stats.errors) == (
            statuses[200],
            statuses[200],
            0,
            0,
            0,
        )
        assert runtime.engine.jobs == {}
        assert runtime.mgr.get_num_free_blocks() == 48
        assert runtime.mgr.verify_queue_integrity()
        await runtime.publisher.flush(5.0)
        assert runtime.mgr.events is not None
        last = runtime.mgr.events.next_event_id - 1
        await eventually(lambda: consumer.last_seq("w0") == last)
        assert index_blocks(consumer.index, "w0") == tree(runtime)
        assert runtime.publisher.stats()["dropped"] == 0
    if scheduler == "max_utilization":
        assert stats.preemptions > 0
    else:
        assert stats.preemptions == 0


TWO_LONG = {
    "num_gpu_blocks": 8,
    "max_batch_size": 4,
    "max_tokens_per_step": 1_024,
    "sim_step_overhead_ms": 2.0,  # both arrive before A is done
}


async def _two_long_requests(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """A and B, each 2 prompt blocks growing to 6: together they need 12 of the 8 blocks."""
    prompts = {"A": list(range(32)), "B": list(range(100, 132))}
    bodies: list[dict[str, Any]] = [
        {"prompt": prompt, "max_tokens": 64, "request_id": name} for name, prompt in prompts.items()
    ]
    first = asyncio.create_task(client.post("/v1/completions", json=bodies[0]))
    await asyncio.sleep(0)  # A arrives first
    second = asyncio.create_task(client.post("/v1/completions", json=bodies[1]))
    results = [(await first).json(), (await second).json()]
    for body, data in zip(bodies, results, strict=True):
        assert data["choices"][0]["token_ids"] == expected_output(prompts[body["request_id"]], 64)
    return results


async def test_max_utilization_preempts_the_newest_and_recomputes_it(clean_redis_url: str) -> None:
    settings = worker_settings(clean_redis_url, scheduler="max_utilization", **TWO_LONG)
    async with worker_client(settings) as (client, runtime):
        a, b = await _two_long_requests(client)
        assert runtime.engine.stats.preemptions == 1
        assert runtime.mgr.get_num_free_blocks() == 8
    assert (a["kvmesh"]["preemptions"], b["kvmesh"]["preemptions"]) == (0, 1)
    # B's recompute hit the blocks it stored when preempted, but its prompt shared nothing.
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert runtime.engine.stats.prefill_tokens > 64  # the recompute
    assert runtime.engine.stats.computed_tokens == 64


async def test_guaranteed_no_evict_makes_the_second_wait(clean_redis_url: str) -> None:
    settings = worker_settings(clean_redis_url, scheduler="guaranteed_no_evict", **TWO_LONG)
    async with worker_client(settings) as (client, runtime):
        a, b = await _two_long_requests(client)
        assert runtime.engine.stats.preemptions == 0
    assert (a["kvmesh"]["preemptions"], b["kvmesh"]["preemptions"]) == (0, 0)
    # B was admitted only when A finished.
    assert b["kvmesh"]["queue_ms"] >= a["kvmesh"]["e2e_ms"] - a["kvmesh"]["queue_ms"] - 1.0


async def test_preempted_jobs_of_one_priority_queue_in_order(clean_redis_url: str) -> None:
    """Three long requests on 3 blocks: two get preempted at once and wait side by side."""
    settings = worker_settings(
        clean_redis_url,
        scheduler="max_utilization",
        num_gpu_blocks=3,
        tokens_per_block=4,
        max_tokens_per_step=64,
        sim_step_overhead_ms=1.0,
    )
    async with worker_client(settings) as (client, runtime):
        prompts = [[i, i, i] for i in range(3)]
        bodies = [{"prompt": prompt, "max_tokens": 8} for prompt in prompts]
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for body in bodies)
        )
        stats = runtime.engine.stats
        assert (stats.finished, stats.errors, stats.preemptions > 0) == (3, 0, True)
        assert runtime.mgr.get_num_free_blocks() == 3
    for prompt, response in zip(prompts, responses, strict=True):
        assert response.json()["choices"][0]["token_ids"] == expected_output(prompt, 8)


async def test_a_request_that_cannot_fit_beside_pins_is_refused_not_left_waiting(
    clean_redis_url: str,
) -> None:
    settings = worker_settings(clean_redis_url, num_gpu_blocks=4)
    async with worker_client(settings) as (client, runtime):
        await complete(client, prompt=list(range(20)), max_tokens=1)
        first_block = (await client.get("/blocks")).json()["blocks"][0]["hash"]
        pin = await client.post("/blocks/pin", json={"block_hashes": [first_block]}, headers=AUTH)
        assert pin.json() == {"block_ids": [0]}
        refused = await client.post("/v1/completions", json={"prompt": [7] * 60, "max_tokens": 4})
        small = await complete(client, prompt=[7, 8], max_tokens=2)
        assert runtime.engine.jobs == {}
        assert runtime.engine.stats.failed == 1
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"] == (
        "no room in the KV cache for this request: needs 4 blocks, 3 can be had"
    )
    assert small["usage"]["completion_tokens"] == 2


async def test_priority_orders_the_queue(clean_redis_url: str) -> None:
    settings = worker_settings(clean_redis_url, max_batch_size=1, sim_step_overhead_ms=5.0)
    async with worker_client(settings) as (client, runtime):
        blocker = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": [1], "max_tokens": 5})
        )
        await eventually(lambda: len(runtime.engine.running) == 1)
        order: list[str] = []

        async def send(name: str, priority: int) -> None:
            body = {"prompt": [2], "max_tokens": 1, "priority": priority, "request_id": name}
            await client.post("/v1/completions", json=body)
            order.append(name)

        tasks = [asyncio.create_task(send(n, p)) for n, p in (("low", 5), ("high", -5), ("mid", 0))]
        await eventually(lambda: runtime.engine.num_waiting == 3)
        await asyncio.gather(blocker, *tasks)
    assert order == ["high", "mid", "low"]


# -- the torch back-end: reuse must give the same tokens as a dense run --------------------------


async def test_torch_engine_output_equals_dense_with_reuse_and_onboarding(
    clean_redis_url: str,
) -> None:
    settings = worker_settings(
        clean_redis_url,
        engine="torch",
        num_gpu_blocks=12,
        num_host_blocks=16,
        max_seq_len=256,
        max_tokens_per_step=48,  # chunked prefill
    )
    model = TinyDecoder(TinyDecoderConfig())
    rng = random.Random(1)
    shared = [rng.randrange(512) for _ in range(40)]
    a = [*shared, *(rng.randrange(512) for _ in range(30))]  # 70 tokens
    b = [*shared[:37], *(rng.randrange(512) for _ in range(20))]  # shares 37: mid-block
    expected = {name: dense_generate(model, p, 12) for name, p in (("a", a), ("b", b))}
    async with worker_client(settings) as (client, runtime):
        cold = await complete(client, prompt=a, max_tokens=12)
        warm = await complete(client, prompt=a, max_tokens=12)
        partial = await complete(client, prompt=b, max_tokens=12)
        offload = await client.post("/cache/offload", json={}, headers=AUTH)
        levels = {blk["level"] for blk in (await client.get("/blocks")).json()["blocks"]}
        onboarded = await complete(client, prompt=a, max_tokens=12)
        assert runtime.mgr.get_num_free_blocks() == 12
    assert cold["choices"][0]["token_ids"] == expected["a"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["token_ids"] == expected["a"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 69
    assert partial["choices"][0]["token_ids"] == expected["b"]
    assert partial["usage"]["prompt_tokens_details"]["cached_tokens"] == 37
    assert offload.json()["count"] > 0
    assert levels == {1}  # everything the tree holds went to the host
    assert onboarded["choices"][0]["token_ids"] == expected["a"]
    assert onboarded["usage"]["prompt_tokens_details"]["cached_tokens"] == 69


async def test_the_worker_publishes_the_speed_its_steps_had(clean_redis_url: str) -> None:
    """The load report carries the fitted speed of the steps the engine ran (here the sim's
    modelled times on a virtual clock, so that the fit has an exact answer to find)."""
    settings = worker_settings(
        clean_redis_url,
        virtual_clock=True,
        sim_step_overhead_ms=10.0,
        sim_prefill_us_per_token=100.0,
        sim_decode_us_per_sequence=150.0,
        max_tokens_per_step=256,
    )
    async with worker_client(settings) as (client, runtime):
        prompts = [[(i * 7 + j) % 500 + 1 for j in range(100 + 90 * i)] for i in range(8)]
        await asyncio.gather(
            *(complete(client, prompt=p, max_tokens=90 - 10 * i) for i, p in enumerate(prompts))
        )
        engine = runtime.engine
        assert engine.speed.steps == engine.stats.steps > 64
        load = engine.load
    assert load["max_tokens_per_step"] == 256
    # Refitted every 32 steps, within 0.2 % of the modelled speed (the ridge's pull).
    assert load["step_overhead_us"] == pytest.approx(10_000, rel=2e-3)
    assert load["prefill_ns_per_token"] == pytest.approx(100_000, rel=2e-3)
    assert load["decode_ns_per_sequence"] == pytest.approx(150_000, rel=2e-3)
