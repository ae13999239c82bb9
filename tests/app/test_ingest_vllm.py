"""``kvmesh ingest vllm|sglang``: the decoder, the re-keying, and a real ZeroMQ publisher.

Payloads are built by hand in vLLM's field order (vllm/distributed/kv_events.py):
``KVEventBatch = [ts, events, data_parallel_rank]``, ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, ...]``, ``["BlockRemoved",
block_hashes, medium]``, ``["AllBlocksCleared"]``; messages ``(topic, seq 8 bytes BE, payload)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from app.cli import build_parser
from app.ingest_vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Rekeyer,
    UnknownParentError,
    VllmDecodeError,
    VllmIngest,
    decode_batch,
    lora_name_id,
)
from cache import RemovedData, StoredBlock, StoredData, block_hashes_for_tokens
from cache.events import EventDiff, UpdatedData
from tests.events.support import make_consumer, wait_until

BS = 4
PROMPT = list(range(100, 112))  # three blocks of 4
KV = block_hashes_for_tokens(PROMPT, BS)


def stored(
    hashes: list[Any], parent: Any, tokens: list[int], *rest: Any, block_size: int = BS
) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, block_size, *(rest or (None, "GPU"))]


def removed(hashes: list[Any], medium: str | None = "GPU") -> list[Any]:
    return ["BlockRemoved", hashes, medium]


def batch(*events: Any, ts: float = 1.5, rank: int | None = 0) -> bytes:
    data: bytes = msgpack.packb([ts, list(events), rank])
    return data


# -- decoding ----------------------------------------------------------------------------------


def test_decodes_vllm_array_like_batches_exactly() -> None:
    payload = batch(
        stored([11, 12], None, PROMPT[:8], 7, "GPU", "sql-lora", [None, ["mm", 3]], 0),
        stored([b"\x01" * 32], 12, PROMPT[8:], None),  # an older vLLM: no medium field
        removed([11], None),
        ["BlockRemoved", [12]],
        ["AllBlocksCleared"],
    )
    assert decode_batch(payload).events == (
        BlockStored(
            (11, 12), None, tuple(PROMPT[:8]), BS, 7, "GPU", "sql-lora", (None, ["mm", 3]), 0
        ),
        BlockStored((b"\x01" * 32,), 12, tuple(PROMPT[8:]), BS, None),
        BlockRemoved((11,)),
        BlockRemoved((12,)),
        AllBlocksCleared(),
    )
    decoded = decode_batch(payload)
    assert (decoded.ts, decoded.data_parallel_rank, decoded.errors) == (1.5, 0, ())


def test_decodes_the_map_encoding_too() -> None:
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
    event |= {"token_ids": PROMPT[:4], "block_size": 4, "lora_id": None, "medium": "CPU"}
    payload = msgpack.packb({"ts": 2, "events": [event, {"type": "AllBlocksCleared"}]})
    decoded = decode_batch(payload)
    assert decoded.events == (
        BlockStored((1,), None, tuple(PROMPT[:4]), 4, None, "CPU"),
        AllBlocksCleared(),
    )
    assert (decoded.ts, decoded.data_parallel_rank) == (2.0, None)


def test_malformed_events_are_skipped_and_named() -> None:
    payload = batch(
        ["BlockStored", [1], None, [1, 2, 3], 4, None],
        ["BlockMoved", [1]],
        ["BlockRemoved", ["x"]],
        "junk",
        ["BlockStored", [1], None, [1, 2, 3, 4], 0, None],
        ["BlockRemoved", [5], 3],
        removed([9]),
    )
    decoded = decode_batch(payload)
    assert decoded.events == (BlockRemoved((9,), "GPU"),)
    assert decoded.errors == (
        "event 0: BlockStored.token_ids has 3 tokens for 1 blocks of 4",
        "event 1: unknown event tag 'BlockMoved'",
        "event 2: BlockRemoved.block_hashes must be a list of int or bytes hashes",
        "event 3: event must be an array or a map, got str",
        "event 4: BlockStored.block_size must be a positive int, got 0",
        "event 5: BlockRemoved.medium must be str or nil, got int",
    )


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "payload is not msgpack"),
        (msgpack.packb([1.0]), "batch has 1 fields, expected 2 or 3"),
        (msgpack.packb(["t", []]), "batch ts must be a number, got str"),
        (msgpack.packb([1.0, {}]), "batch events must be an array, got dict"),
        (msgpack.packb(7), "batch must be an array or a map, got int"),
        (msgpack.packb({"ts": 1}), "batch map lacks ts or events"),
    ],
)
def test_a_malformed_batch_raises(payload: bytes, message: str) -> None:
    with pytest.raises(VllmDecodeError, match=message):
        decode_batch(payload)


# -- re-keying ---------------------------------------------------------------------------------


def apply_all(rekeyer: Rekeyer, payload: bytes) -> list[Any]:
    return [e for ev in decode_batch(payload).events for e in rekeyer.apply(ev)]


def test_stored_chains_are_keyed_by_kvmesh_hashes_of_their_tokens() -> None:
    rekeyer = Rekeyer(block_size=BS)
    first = apply_all(rekeyer, batch(stored([11, 12], None, PROMPT[:8])))
    second = apply_all(rekeyer, batch(stored([13], 12, PROMPT[8:])))
    assert [e.event_id for e in first + second] == [0, 1]
    assert first[0].data == StoredData(
        None, [StoredBlock(KV[0], tuple(PROMPT[:4])), StoredBlock(KV[1], tuple(PROMPT[4:8]))]
    )
    assert second[0].data.parent_hash == KV[1]
    assert [b.block_hash for b in second[0].data.blocks] == [KV[2]]
    assert [rekeyer.kv_hash(h) for h in (11, 12, 13)] == KV


def test_lora_enters_the_key() -> None:
    by_id = apply_all(Rekeyer(), batch(stored([1], None, PROMPT[:4], 7, "GPU")))
    by_name = apply_all(Rekeyer(), batch(stored([1], None, PROMPT[:4], None, "GPU", "sql")))
    assert (
        by_id[0].data.blocks[0].block_hash
        == block_hashes_for_tokens(PROMPT[:4], BS, lora_task_id=7)[0]
    )
    assert (
        by_name[0].data.blocks[0].block_hash
        == block_hashes_for_tokens(PROMPT[:4], BS, lora_task_id=lora_name_id("sql"))[0]
    )
    assert by_id[0].data.blocks[0].block_hash != KV[0]


def test_removals_tiers_and_clears_are_translated() -> None:
    rekeyer = Rekeyer(block_size=BS)
    apply_all(rekeyer, batch(stored([11, 12, 13], None, PROMPT)))
    offloaded = apply_all(rekeyer, batch(stored([13], 12, PROMPT[8:], None, "CPU")))
    assert offloaded[0].data.blocks[0].cache_level == 0  # still on the GPU too
    out = apply_all(rekeyer, batch(removed([13]), removed([12]), removed([99])))
    assert [e.data for e in out] == [
        UpdatedData(KV[2], EventDiff(0, 1)),  # its GPU copy went; the CPU copy stays
        RemovedData([KV[1]]),
    ]
    assert rekeyer.num_unknown_removals == 1
    assert [e.data for e in apply_all(rekeyer, batch(["AllBlocksCleared"]))] == [
        RemovedData([KV[0], KV[2]])
    ]
    assert rekeyer.num_blocks() == 0


def test_unknown_parents_and_bad_media_refuse_before_any_change() -> None:
    rekeyer = Rekeyer(block_size=BS)
    with pytest.raises(UnknownParentError, match="unknown block 12"):
        apply_all(rekeyer, batch(stored([13], 12, PROMPT[8:])))
    with pytest.raises(VllmDecodeError, match="medium 'DISK' is not GPU or CPU"):
        apply_all(rekeyer, batch(stored([11], None, PROMPT[:4], None, "DISK")))
    with pytest.raises(VllmDecodeError, match="block_size is 8, the ingester's is 4"):
        apply_all(rekeyer, batch(stored([11], None, PROMPT[:8], block_size=8)))
    assert (rekeyer.num_blocks(), rekeyer.next_event_id) == (0, 0)


# -- a real ZeroMQ publisher -------------------------------------------------------------------


class FakeVllm:
    """vLLM's ZmqEventPublisher, by its wire format: PUB + a replay ROUTER with a buffer."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{pub_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def send(self, seq: int, payload: bytes, *, publish: bool = True) -> None:
        with self.lock:
            self.buffer.append((seq, payload))
        if publish:
            self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    def resend(self, seq: int) -> None:
        payload = dict(self.buffer)[seq]
        self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= first]
            for seq, payload in items:
                self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def vllm() -> Iterator[FakeVllm]:
    server = FakeVllm()
    try:
        yield server
    finally:
        server.close()


FAST: dict[str, Any] = {"heartbeat_interval_s": 0.05, "heartbeat_ttl_s": 0.5, "backoff_max_s": 0.1}


def index_of(consumer: Any, worker_id: str) -> dict[int, int]:
    index = consumer.index
    return index.worker_blocks(worker_id) if worker_id in index.workers() else {}


async def test_a_real_publisher_reaches_the_index_with_a_gap_replayed(
    vllm: FakeVllm, clean_redis_url: str
) -> None:
    ingest = VllmIngest(
        vllm.endpoint,
        "vl0",
        clean_redis_url,
        replay_endpoint=vllm.replay_endpoint,
        topic="kv",
        block_size=BS,
        **FAST,
    )
    async with ingest, make_consumer(clean_redis_url) as consumer:
        task = asyncio.create_task(ingest.run())
        try:
            vllm.send(0, batch(stored([11, 12], None, PROMPT[:8])))
            for _ in range(400):  # PUB/SUB joins late: send again until it is through
                if ingest.last_seq == 0:
                    break
                vllm.resend(0)
                await asyncio.sleep(0.01)
            vllm.send(1, batch(stored([13], 12, PROMPT[8:]), stored([21], None, [1, 2, 3, 4])))
            vllm.send(2, batch(removed([21])), publish=False)  # lost on the PUB socket
            vllm.send(3, batch(stored([14], 13, [7, 7, 7, 7], None, "CPU")))
            await wait_until(lambda: ingest.last_seq == 3)
            await ingest.publisher.flush(5)
            tail = block_hashes_for_tokens([*PROMPT, 7, 7, 7, 7], BS)[3]
            expected = {KV[0]: 0, KV[1]: 0, KV[2]: 0, tail: 1}
            await wait_until(lambda: index_of(consumer, "vl0") == expected)
            assert ingest.local_blocks() == expected
            assert (ingest.num_replayed, ingest.num_lost, ingest.num_malformed) == (1, 0, 0)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_an_unrecoverable_gap_and_a_restart(vllm: FakeVllm, clean_redis_url: str) -> None:
    ingest = VllmIngest(vllm.endpoint, "vl0", clean_redis_url, topic="kv", block_size=BS, **FAST)
    async with ingest, make_consumer(clean_redis_url) as consumer:
        task = asyncio.create_task(ingest.run())
        try:
            vllm.send(0, batch(stored([11], None, PROMPT[:4])))
            for _ in range(400):
                if ingest.last_seq == 0:
                    break
                vllm.resend(0)
                await asyncio.sleep(0.01)
            # No replay endpoint: batch 1 is lost, and batch 2's parent with it.
            vllm.send(1, batch(stored([12], 11, PROMPT[4:8])), publish=False)
            vllm.send(2, batch(stored([13], 12, PROMPT[8:]), stored([31], None, [5, 5, 5, 5])))
            await wait_until(lambda: ingest.last_seq == 2)
            await ingest.publisher.flush(5)
            lone = block_hashes_for_tokens([5, 5, 5, 5], BS)[0]
            await wait_until(lambda: index_of(consumer, "vl0") == {KV[0]: 0, lone: 0})
            assert ingest.num_lost == 2  # batch 1, then the orphan stored event
            # The publisher restarts: sequence 0 again, a new epoch, an empty index.
            epoch = ingest.publisher.epoch
            vllm.send(0, batch(stored([41], None, PROMPT[:4])))
            await wait_until(lambda: ingest.num_restarts == 1)
            await ingest.publisher.flush(5)
            await wait_until(lambda: index_of(consumer, "vl0") == {KV[0]: 0})
            assert ingest.publisher.epoch != epoch
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- the CLI -----------------------------------------------------------------------------------


def test_cli_parses_the_vllm_and_sglang_subcommands() -> None:
    replay = ["--replay-endpoint", "tcp://gpu3:5558", "--topic", "kv", "--url", "http://gpu3:8000"]
    args = build_parser().parse_args(
        ["ingest", "vllm", "--endpoint", "tcp://gpu3:5557", "--worker-id", "v3", *replay]
    )
    assert (args.endpoint, args.replay_endpoint, args.topic, args.worker_id, args.url) == (
        "tcp://gpu3:5557",
        "tcp://gpu3:5558",
        "kv",
        "v3",
        "http://gpu3:8000",
    )
    assert (args.block_size, args.source, args.redis_url) == (16, "vllm", None)
    sglang = build_parser().parse_args(["ingest", "sglang", "--worker-id", "s1"])
    assert (sglang.endpoint, sglang.block_size, sglang.source) == (
        "tcp://localhost:5557",
        1,
        "sglang",
    )
