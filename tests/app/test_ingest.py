"""``kvmesh ingest trtllm`` against a real local HTTP server playing back TensorRT-LLM event JSON.

The recorded stream is the worked example of TRTLLM_EVENTS.md section 4 (the C++ test
``KVCacheManagerEventStream``): tokens per block 4, 8 primary + 2 secondary blocks, window 16.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from app.cli import build_parser, main
from app.ingest.trtllm import TrtllmIngest
from events import keys
from tests.events.support import make_consumer
from tests.support.json_server import JsonServer
from tests.support.wait import eventually

WINDOW = 16
# Block hashes of the worked stream (V1 block key; LoRA 42 for the first request).
B0, B1, B2 = 12106754553835128565, 5617127532119243971, 7092498913842505426
R2 = (916751715089631, 16955605079875586289, 6725517949602612192)
R3 = (35232537392298, 18060640999673525243, 3499009167702446897)


def tokens(*ids: int) -> list[dict[str, Any]]:
    return [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids]


def block(block_hash: int, *token_ids: int) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": block_hash,
        "tokens": tokens(*token_ids),
        "cache_level": 0,
        "priority": 35,
        "mm_keys": [],
        "cache_salt": None,
    }


def created(event_id: int) -> dict[str, Any]:
    data = {"type": "created", "num_blocks_per_cache_level": [8, 2]}
    return {"event_id": event_id, "data": data, "window_size": WINDOW}


def stored(event_id: int, parent: int | None, *blocks: dict[str, Any]) -> dict[str, Any]:
    data = {"type": "stored", "parent_hash": parent, "blocks": list(blocks)}
    return {"event_id": event_id, "data": data, "window_size": WINDOW}


def offloaded(event_id: int, block_hash: int) -> dict[str, Any]:
    diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
    data = {"type": "updated", "block_hash": block_hash, "cache_level": diff, "priority": None}
    return {"event_id": event_id, "data": data, "window_size": WINDOW}


def removed(event_id: int, *hashes: int) -> dict[str, Any]:
    data = {"type": "removed", "block_hashes": list(hashes)}
    return {"event_id": event_id, "data": data, "window_size": WINDOW}


# Steps 0-5 of the worked stream, cut into the answers of successive polls.
STEP_0_TO_2 = [
    created(0),
    stored(1, None, block(B0, 0, 1, 2, 3), block(B1, 4, 5, 6, 7)),
    stored(2, B1, block(B2, 8, 9)),
]
STEP_4 = [offloaded(3, B2), offloaded(4, B1), offloaded(5, B0), removed(6, B2)]
STEP_5 = [
    stored(
        7,
        None,
        block(R2[0], 1, 1, 2, 3),
        block(R2[1], 4, 5, 6, 7),
        block(R2[2], 8, 9, 10, 11),
    ),
    stored(
        8,
        None,
        block(R3[0], 2, 1, 2, 3),
        block(R3[1], 4, 5, 6, 7),
        block(R3[2], 8, 9, 10, 11),
    ),
]
AFTER_STEP_5 = {B0: 1, B1: 1} | dict.fromkeys(R2, 0) | dict.fromkeys(R3, 0)


class TrtllmServer(JsonServer):
    """A real HTTP server on a free loopback port that answers ``POST /kv_cache_events`` with
    the next queued JSON answer (an empty list once the queue is empty), as trtllm-serve does."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, Any]] = []
        super().__init__(self._answer)

    def _answer(self, path: str, body: Any) -> tuple[int, Any]:
        status, reply = self.answers.pop(0) if self.answers else (200, [])
        if path != "/kv_cache_events":
            return 404, {"detail": "Not Found"}
        return status, reply

    def queue(self, *answers: Any, status: int = 200) -> None:
        with self.lock:
            self.answers.extend((status, answer) for answer in answers)

    def pending(self) -> int:
        with self.lock:
            return len(self.answers)


@pytest.fixture
def trtllm() -> Iterator[TrtllmServer]:
    with TrtllmServer().running() as server:
        yield server


FAST: dict[str, Any] = {"heartbeat_interval_s": 0.05, "heartbeat_ttl_s": 0.5, "backoff_max_s": 0.1}


def index_of(consumer: Any, worker_id: str) -> dict[int, int]:
    index = consumer.index
    return index.worker_blocks(worker_id)


async def test_the_worked_stream_reaches_the_index_exactly(
    trtllm: TrtllmServer, clean_redis_url: str
) -> None:
    trtllm.queue(STEP_0_TO_2, [], [{}, *STEP_4, None], STEP_5)
    ingest = TrtllmIngest(
        trtllm.url, "trt0", clean_redis_url, tokens_per_block=4, poll_interval_s=0.01, **FAST
    )
    client: Any = aioredis.Redis.from_url(clean_redis_url)
    try:
        async with ingest, make_consumer(clean_redis_url) as consumer:
            await ingest.run(max_polls=5)
            await ingest.publishers()["trt0"].flush(5)
            await eventually(lambda: consumer.last_seq("trt0") == 8)
            assert index_of(consumer, "trt0") == AFTER_STEP_5
            assert ingest.local_blocks() == AFTER_STEP_5
            # update_registry() reaches Redis with the next heartbeat.
            for _ in range(200):
                entry = json.loads(await client.hget(keys.WORKERS_KEY, "trt0"))
                if "capacity" in entry:
                    break
                await asyncio.sleep(0.01)
            stats = consumer.stats()
    finally:
        await client.aclose()
    assert [path for path, _ in trtllm.requests] == ["/kv_cache_events"] * 5
    assert ingest.stats() == {
        "polls": 5,
        "events": 9,
        "skipped": 2,  # the {} and the null
        "duplicates": 0,
        "dropped": 0,
        "restarts": 0,
        "errors": 0,
        "streams": {"trt0": 8},
    }
    assert (entry["url"], entry["device"], entry["tokens_per_block"]) == (trtllm.url, "trtllm", 4)
    assert (entry["capacity"], entry["windows"]) == ([8, 2], {"16": [8, 2]})
    assert (stats["resyncs"], stats["malformed"]) == (0, 0)


async def test_a_restart_starts_a_new_epoch(trtllm: TrtllmServer, clean_redis_url: str) -> None:
    trtllm.queue(STEP_0_TO_2)
    ingest = TrtllmIngest(trtllm.url, "trt0", clean_redis_url, poll_interval_s=0.01, **FAST)
    async with ingest, make_consumer(clean_redis_url) as consumer:
        await ingest.run(max_polls=1)
        publisher = ingest.publishers()["trt0"]
        await publisher.flush(5)
        await eventually(lambda: consumer.last_seq("trt0") == 2)
        first_epoch = publisher.epoch
        # The engine restarts: ids start again at 0 with `created`, its cache is empty.
        trtllm.queue([created(0), stored(1, None, block(R2[0], 1, 1, 2, 3))])
        await ingest.run(max_polls=1)
        await publisher.flush(5)
        await eventually(
            lambda: (
                consumer.last_seq("trt0") == 1 and consumer.workers()["trt0"].epoch > first_epoch
            )
        )
        assert index_of(consumer, "trt0") == {R2[0]: 0}
        stats = consumer.stats()
    assert publisher.epoch > first_epoch
    assert ingest.stats()["restarts"] == 1
    assert stats["resync_reasons"]["epoch"] == 1


async def test_events_lost_upstream_are_reported_and_resynchronised(
    trtllm: TrtllmServer, clean_redis_url: str
) -> None:
    # Event 3 (an offload) never arrives: TensorRT-LLM's queue dropped it.
    trtllm.queue(STEP_0_TO_2, STEP_4[1:], [STEP_4[0]])
    ingest = TrtllmIngest(trtllm.url, "trt0", clean_redis_url, poll_interval_s=0.01, **FAST)
    async with ingest, make_consumer(clean_redis_url) as consumer:
        await ingest.run(max_polls=1)
        await ingest.publishers()["trt0"].flush(5)
        await eventually(lambda: consumer.last_seq("trt0") == 2)
        await ingest.run(max_polls=2)
        await ingest.publishers()["trt0"].flush(5)
        await eventually(lambda: consumer.last_seq("trt0") == 6)
        # Without event 3 nobody knows B2 went to the host tier; it was removed anyway.
        expected = {B0: 1, B1: 1}
        assert ingest.local_blocks() == expected
        assert index_of(consumer, "trt0") == expected
        stats = consumer.stats()
    assert (ingest.stats()["dropped"], ingest.stats()["duplicates"]) == (1, 1)
    assert stats["resync_reasons"]["dropped"] == 1


async def test_attention_dp_ranks_get_their_own_streams(
    trtllm: TrtllmServer, clean_redis_url: str
) -> None:
    rank1 = [
        {**created(0), "attention_dp_rank": 1},
        {**stored(1, None, block(R3[0], 2, 1, 2, 3)), "attention_dp_rank": 1},
    ]
    trtllm.queue([*STEP_0_TO_2, *rank1])
    ingest = TrtllmIngest(trtllm.url, "trt0", clean_redis_url, poll_interval_s=0.01, **FAST)
    async with ingest, make_consumer(clean_redis_url) as consumer:
        await ingest.run(max_polls=1)
        for publisher in ingest.publishers().values():
            await publisher.flush(5)
        await eventually(
            lambda: consumer.last_seq("trt0") == 2 and consumer.last_seq("trt0-dp1") == 1
        )
        assert index_of(consumer, "trt0") == {B0: 0, B1: 0, B2: 0}
        assert index_of(consumer, "trt0-dp1") == {R3[0]: 0}
        assert consumer.workers()["trt0-dp1"].info["attention_dp_rank"] == 1


async def test_http_errors_are_logged_and_retried(
    trtllm: TrtllmServer, clean_redis_url: str
) -> None:
    trtllm.queue({"detail": "engine busy"}, status=500)
    trtllm.queue({"not": "a list"})
    trtllm.queue(STEP_0_TO_2)
    ingest = TrtllmIngest(
        trtllm.url, "trt0", clean_redis_url, poll_interval_s=0.01, backoff_max_s=0.05
    )
    async with ingest:
        await ingest.run(max_polls=3)
        assert ingest.local_blocks() == {B0: 0, B1: 0, B2: 0}
    assert (ingest.stats()["errors"], ingest.stats()["polls"]) == (2, 1)


def test_cli_parses_the_trtllm_subcommand() -> None:
    args = build_parser().parse_args(
        ["ingest", "trtllm", "--url", "http://gpu3:8000", "--worker-id", "trt3"]
    )
    assert (args.command, args.source, args.url, args.worker_id) == (
        "ingest",
        "trtllm",
        "http://gpu3:8000",
        "trt3",
    )
    assert (args.redis_url, args.tokens_per_block, args.max_polls) == (None, None, None)


@pytest.mark.parametrize(
    "argv",
    [["ingest"], ["ingest", "trtllm", "--worker-id", "w0"], ["ingest", "file", "x.json"]],
)
def test_cli_bad_ingest_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: kvmesh ingest" in capsys.readouterr().err


def test_cli_needs_a_redis(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("KVMESH_REDIS_URL", raising=False)
    argv = ["ingest", "trtllm", "--url", "http://127.0.0.1:1", "--worker-id", "w0"]
    assert main(argv) == 2
    assert "give --redis-url or set REDIS_URL" in capsys.readouterr().err
    assert main([*argv[:-1], "w{0}", "--redis-url", "redis://127.0.0.1:1/0"]) == 2


def test_cli_runs_the_ingester(
    trtllm: TrtllmServer, clean_redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trtllm.queue(STEP_0_TO_2, STEP_4)
    argv = ["ingest", "trtllm", "--url", trtllm.url, "--worker-id", "trt0"]
    argv += ["--redis-url", clean_redis_url, "--max-polls", "3", "--poll-interval-s", "0.01"]
    assert main(argv) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (stats["polls"], stats["events"], stats["streams"]) == (3, 7, {"trt0": 6})
