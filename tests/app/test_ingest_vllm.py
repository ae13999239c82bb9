"""``kvmesh ingest vllm|sglang``: the decoder, the re-keying, and a real ZeroMQ publisher.

Payloads are built by hand in vLLM's field order (vllm/distributed/kv_events.py):
``KVEventBatch = [ts, events, data_parallel_rank]``, ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, ...]``, ``["BlockRemoved",
block_hashes, medium]``, ``["AllBlocksCleared"]``; messages ``(topic, seq 8 bytes BE, payload)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq
from redis.asyncio import Redis

from app.cli import build_parser, main
from app.core.net import free_port
from app.ingest.vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Rekeyer,
    UnknownParentError,
    VllmDecodeError,
    VllmIngest,
    decode_batch,
    lora_name_id,
    multimodal_hash,
    offset_endpoint,
)
from cache import (
    MultimodalItem,
    RemovedData,
    StoredBlock,
    StoredData,
    block_hashes_for_tokens,
    cache_salt_id,
)
from cache.events import EventDiff, UpdatedData
from events import keys
from tests.app.router_support import router_client, router_settings
from tests.events.support import make_consumer
from tests.support.wait import eventually

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


def test_salted_and_multimodal_blocks_are_keyed_as_the_same_request_is() -> None:
    salt, ident = "tenant-a", "ab" * 32  # vLLM's identifiers are 64-hex-digit content hashes
    tokens = list(range(200, 212))  # three blocks; the image is tokens 2..8 (blocks 0, 1, 2)
    rekeyer = Rekeyer(block_size=BS)
    # vLLM's extra keys per block: [mm_identifier, item start - block start] for each item the
    # block overlaps, then the salt (a request's first block only).
    first = apply_all(
        rekeyer,
        batch(
            stored([1, 2], None, tokens[:8], None, "GPU", None, [[[ident, 2], salt], [[ident, -2]]])
        ),
    )
    second = apply_all(
        rekeyer, batch(stored([3], 2, tokens[8:], None, "GPU", None, [[[ident, -6]]]))
    )
    item = MultimodalItem(bytes.fromhex(ident), 2, 7)
    same_request = block_hashes_for_tokens(
        tokens, BS, cache_salt_id=cache_salt_id(salt), multimodal=[item]
    )
    blocks = [b for event in first + second for b in event.data.blocks]
    assert [b.block_hash for b in blocks] == same_request
    assert not set(same_request) & set(block_hashes_for_tokens(tokens, BS))
    image = bytes.fromhex(ident)
    assert [b.mm_keys for b in blocks] == [((image, 0),), ((image, 2),), ((image, 6),)]
    assert [b.cache_salt for b in blocks] == [salt, None, None]
    assert multimodal_hash(ident) == image
    assert multimodal_hash("img-7") == hashlib.sha256(b"img-7").digest()

    # The salt alone; the LoRA name among the keys is the key's LoRA id already.
    salted = apply_all(
        Rekeyer(), batch(stored([1, 2, 3], None, PROMPT, None, "GPU", None, [[salt], None, None]))
    )
    assert [b.block_hash for b in salted[0].data.blocks] == block_hashes_for_tokens(
        PROMPT, BS, cache_salt_id=cache_salt_id(salt)
    )
    lora = apply_all(Rekeyer(), batch(stored([1], None, PROMPT[:4], None, "GPU", "sql", [["sql"]])))
    assert (
        lora[0].data.blocks[0].block_hash
        == block_hashes_for_tokens(PROMPT[:4], BS, lora_task_id=lora_name_id("sql"))[0]
    )


def test_keys_kvmesh_cannot_carry_make_blocks_of_their_own() -> None:
    rekeyer = Rekeyer(block_size=BS)
    embeds = b"\x07" * 32  # a prompt-embedding hash: no kvmesh request carries one
    out = apply_all(
        rekeyer, batch(stored([1, 2], None, PROMPT[:8], None, "GPU", None, [None, [embeds]]))
    )
    again = apply_all(
        Rekeyer(), batch(stored([1, 2], None, PROMPT[:8], None, "GPU", None, [None, [embeds]]))
    )
    hashes = [b.block_hash for b in out[0].data.blocks]
    assert hashes[0] == KV[0]  # the block without keys is the plain one
    assert hashes[1] not in (KV[1], block_hashes_for_tokens(PROMPT[:8], BS, cache_salt_id=0)[1])
    assert [b.block_hash for b in again[0].data.blocks] == hashes  # and the same every time
    below = apply_all(rekeyer, batch(stored([3], 2, PROMPT[8:])))
    assert below[0].data.parent_hash == hashes[1]
    with pytest.raises(VllmDecodeError, match="multimodal offset 4 is past the block"):
        apply_all(rekeyer, batch(stored([5], None, PROMPT[:4], None, "GPU", None, [[["x", 4]]])))


def test_a_store_without_tokens_adds_a_medium_to_known_blocks() -> None:
    # vLLM's CPU offload announces blocks it already announced, by hash only.
    rekeyer = Rekeyer(block_size=BS)
    apply_all(rekeyer, batch(stored([11, 12], None, PROMPT[:8])))
    assert apply_all(rekeyer, batch(stored([12], 11, [], None, "CPU"))) == []
    out = apply_all(rekeyer, batch(removed([12])))
    assert [e.data for e in out] == [UpdatedData(KV[1], EventDiff(0, 1))]
    back = apply_all(rekeyer, batch(stored([12], 11, [], None, "GPU")))
    assert [e.data for e in back] == [UpdatedData(KV[1], EventDiff(1, 0))]
    with pytest.raises(UnknownParentError, match="without tokens, unknown block 99"):
        apply_all(rekeyer, batch(stored([99], None, [], None, "CPU")))
    assert rekeyer.num_blocks() == 2


def test_consecutive_removals_are_coalesced() -> None:
    payload = batch(
        removed([11]),
        removed([12]),
        removed([13], "CPU"),
        removed([14], "CPU"),
        ["AllBlocksCleared"],
        removed([15]),
        ["BlockRemoved", ["x"]],
        ["BlockRemoved", [16], "GPU", 1],
    )
    one_by_one = decode_batch(payload)
    assert len(one_by_one.events) == one_by_one.num_events == 7
    coalesced = decode_batch(payload, coalesce=True)
    assert coalesced.events == (
        BlockRemoved((11, 12), "GPU"),
        BlockRemoved((13, 14), "CPU"),
        AllBlocksCleared(),
        BlockRemoved((15,), "GPU"),
        BlockRemoved((16,), "GPU", 1),
    )
    assert coalesced.num_events == 7
    assert (
        coalesced.errors
        == one_by_one.errors
        == ("event 6: BlockRemoved.block_hashes must be a list of int or bytes hashes",)
    )
    rekeyer = Rekeyer(block_size=BS)
    apply_all(rekeyer, batch(stored([11, 12, 13], None, PROMPT)))
    merged = decode_batch(batch(removed([13]), removed([12]), removed([11])), coalesce=True)
    out, refused = rekeyer.apply_all(merged.events)
    assert ([e.data for e in out], refused) == ([RemovedData([KV[2], KV[1], KV[0]])], [])


def test_rank_endpoints_are_offset_as_vllm_offsets_them() -> None:
    assert offset_endpoint("tcp://gpu3:5557", 0) == "tcp://gpu3:5557"
    assert offset_endpoint("tcp://gpu3:5557", 3) == "tcp://gpu3:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    with pytest.raises(ValueError, match="need tcp:// or inproc://"):
        offset_endpoint("ipc:///tmp/kv", 1)
    with pytest.raises(ValueError, match="no port to offset"):
        offset_endpoint("tcp://gpu3", 1)


# -- a real ZeroMQ publisher -------------------------------------------------------------------


class FakeVllm:
    """vLLM's ZmqEventPublisher, by its wire format: PUB + a replay ROUTER with a buffer (on the
    given ports, or on free ones). The PUB is an XPUB (the same wire for a subscriber), so that
    the test sends only once the ingester's SUB is subscribed: every batch published reaches it,
    and none is sent twice -- a second sequence 0 would be a publisher restart."""

    def __init__(self, pub_port: int | None = None, replay_port: int | None = None) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.router = self.ctx.socket(zmq.ROUTER)
        try:
            if pub_port is None:
                pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            else:
                self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
            if replay_port is None:
                replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
            else:
                self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        except zmq.ZMQError:
            self.pub.close(0)
            self.router.close(0)
            self.ctx.term()
            raise
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

    async def subscribed(self, timeout_s: float = 10.0) -> None:
        """Wait for the subscriber's subscription to topic ``kv``."""
        deadline = time.monotonic() + timeout_s
        while not self.pub.poll(0):
            assert time.monotonic() < deadline, "nobody subscribed"
            await asyncio.sleep(0.005)
        assert self.pub.recv() == b"\x01kv"

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
    return index.worker_blocks(worker_id)


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
            # The consumer follows the stream from its (empty) first snapshot on, so that what
            # it does with each entry is what is checked.
            await eventually(lambda: consumer.stats()["synced_workers"] == 1)
            await vllm.subscribed()
            vllm.send(0, batch(stored([11, 12], None, PROMPT[:8])))
            vllm.send(1, batch(stored([13], 12, PROMPT[8:]), stored([21], None, [1, 2, 3, 4])))
            vllm.send(2, batch(removed([21])), publish=False)  # lost on the PUB socket
            vllm.send(3, batch(stored([14], 13, [7, 7, 7, 7], None, "CPU")))
            try:
                await eventually(lambda: ingest.last_seq == 3)
            except AssertionError as exc:
                raise AssertionError(f"the ingester is at {ingest.stats()}") from exc
            await ingest.publisher.flush(5)
            tail = block_hashes_for_tokens([*PROMPT, 7, 7, 7, 7], BS)[3]
            expected = {KV[0]: 0, KV[1]: 0, KV[2]: 0, tail: 1}
            await eventually(lambda: index_of(consumer, "vl0") == expected)
            assert ingest.local_blocks() == expected
            assert (ingest.num_replayed, ingest.num_lost, ingest.num_malformed) == (1, 0, 0)
            stats = consumer.stats()
            # No gap left: the consumer applied the five kvmesh events, one by one.
            assert (stats["resync_reasons"], stats["events"]) == ({}, 5)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_an_unrecoverable_gap_and_a_restart(vllm: FakeVllm, clean_redis_url: str) -> None:
    ingest = VllmIngest(vllm.endpoint, "vl0", clean_redis_url, topic="kv", block_size=BS, **FAST)
    async with ingest, make_consumer(clean_redis_url) as consumer:
        task = asyncio.create_task(ingest.run())
        try:
            await eventually(lambda: consumer.stats()["synced_workers"] == 1)
            await vllm.subscribed()
            vllm.send(0, batch(stored([11], None, PROMPT[:4])))
            # No replay endpoint: batch 1 is lost, and batch 2's parent with it.
            vllm.send(1, batch(stored([12], 11, PROMPT[4:8])), publish=False)
            vllm.send(2, batch(stored([13], 12, PROMPT[8:]), stored([31], None, [5, 5, 5, 5])))
            await eventually(lambda: ingest.last_seq == 2)
            await ingest.publisher.flush(5)
            lone = block_hashes_for_tokens([5, 5, 5, 5], BS)[0]
            await eventually(lambda: index_of(consumer, "vl0") == {KV[0]: 0, lone: 0})
            assert ingest.num_lost == 2  # batch 1, then the orphan stored event
            # Both losses are reported on the batch that revealed them: one resync.
            assert consumer.stats()["resync_reasons"] == {"dropped": 1}
            # The publisher restarts: sequence 0 again, a new epoch, an empty index.
            epoch = ingest.publisher.epoch
            vllm.send(0, batch(stored([41], None, PROMPT[:4])))
            await eventually(lambda: ingest.num_restarts == 1)
            await ingest.publisher.flush(5)
            await eventually(lambda: index_of(consumer, "vl0") == {KV[0]: 0})
            assert ingest.publisher.epoch != epoch
            assert consumer.stats()["resync_reasons"] == {"dropped": 1, "epoch": 1}
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@contextlib.contextmanager
def ranked_vllm(size: int) -> Iterator[list[FakeVllm]]:
    """``size`` publishers on consecutive ports (PUB and replay), as a vLLM server with
    ``--data-parallel-size size`` binds them: rank r on the base ports + r."""
    servers: list[FakeVllm] = []
    for _ in range(50):
        pub, replay = free_port(), free_port()
        try:
            for rank in range(size):
                servers.append(FakeVllm(pub + rank, replay + rank))
            break
        except zmq.ZMQError:  # a port taken meanwhile: another base
            for server in servers:
                server.close()
            servers = []
    assert servers, "no free consecutive ports"
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


async def test_each_data_parallel_rank_is_a_worker_of_its_own(clean_redis_url: str) -> None:
    with ranked_vllm(2) as (rank0, rank1):
        ingest = VllmIngest(
            rank0.endpoint,
            "vl0",
            clean_redis_url,
            replay_endpoint=rank0.replay_endpoint,
            topic="kv",
            url="http://gpu3:8000",
            block_size=BS,
            window_size=4096,
            data_parallel_size=2,
            **FAST,
        )
        assert ingest.endpoints() == {
            "vl0-dp0": (rank0.endpoint, rank0.replay_endpoint),
            "vl0-dp1": (rank1.endpoint, rank1.replay_endpoint),
        }
        async with ingest, make_consumer(clean_redis_url) as consumer:
            task = asyncio.create_task(ingest.run())
            try:
                await eventually(lambda: consumer.stats()["synced_workers"] == 2)
                await rank0.subscribed()
                await rank1.subscribed()
                # The same vLLM hash on two ranks: two caches, two kvmesh workers.
                rank0.send(0, batch(stored([11, 12], None, PROMPT[:8]), rank=0))
                rank1.send(0, batch(stored([11], None, [5, 5, 5, 5]), rank=1))
                # Rank 1 loses a batch on its PUB socket: its own replay endpoint brings it.
                rank1.send(1, batch(stored([12], 11, [6, 6, 6, 6]), rank=1), publish=False)
                rank1.send(2, batch(removed([11]), rank=1))
                # A batch that names another rank: applied to its endpoint's stream, counted.
                rank0.send(1, batch(removed([12]), rank=1))
                await eventually(lambda: ingest.stats()["streams"] == {"vl0-dp0": 1, "vl0-dp1": 2})
                for publisher in ingest.publishers().values():
                    await publisher.flush(5)
                fives = block_hashes_for_tokens([5, 5, 5, 5, 6, 6, 6, 6], BS)
                expected = {"vl0-dp0": {KV[0]: 0}, "vl0-dp1": {fives[1]: 0}}
                await eventually(lambda: {w: index_of(consumer, w) for w in expected} == expected)
                assert {w: ingest.local_blocks(w) for w in expected} == expected
                stats = ingest.stats()
                assert (stats["replayed"], stats["lost"], stats["rank_mismatches"]) == (1, 0, 1)
                assert consumer.stats()["resyncs"] == 0
                async with Redis.from_url(clean_redis_url) as redis:
                    registry = await redis.hgetall(keys.WORKERS_KEY)
                entries = {
                    str(k, "utf-8") if isinstance(k, bytes) else k: json.loads(v)
                    for k, v in registry.items()
                }
                assert {w: (e["data_parallel_rank"], e["url"]) for w, e in entries.items()} == {
                    "vl0-dp0": (0, "http://gpu3:8000"),
                    "vl0-dp1": (1, "http://gpu3:8000"),
                }
                assert {e["tokens_per_block"] for e in entries.values()} == {BS}
                # The window the ingester was given is on the events.
                assert {e.window_size for e in consumer.index.dump_events("vl0-dp0")} == {4096}
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def test_the_router_routes_to_the_vllm_worker_holding_the_prompt(
    clean_redis_url: str,
) -> None:
    """Two simulated vLLM servers behind two ingesters and an in-process router: the router's
    index is what each vLLM holds, keyed by kvmesh hashes of the tokens, and ``POST /route``
    sends each prompt to the server that holds it."""
    prompt_a = list(range(300, 318))  # four full blocks of 4, and two tokens more
    prompt_b = list(range(500, 514))  # three full blocks, two tokens more
    with contextlib.ExitStack() as stack:
        vllm_a, vllm_b = FakeVllm(), FakeVllm()
        stack.callback(vllm_a.close)
        stack.callback(vllm_b.close)
        ingests = {
            name: VllmIngest(
                server.endpoint,
                name,
                clean_redis_url,
                replay_endpoint=server.replay_endpoint,
                topic="kv",
                url=f"http://{name}:8000",
                block_size=BS,
                **FAST,
            )
            for name, server in (("vllm-a", vllm_a), ("vllm-b", vllm_b))
        }
        settings = router_settings(clean_redis_url, tokens_per_block=BS)
        async with (
            ingests["vllm-a"],
            ingests["vllm-b"],
            router_client(settings) as (router, runtime),
        ):
            tasks = [asyncio.create_task(i.run()) for i in ingests.values()]
            try:
                # vLLM a: prompt a's blocks in two steps, and a block it evicts again.
                await vllm_a.subscribed()
                await vllm_b.subscribed()
                vllm_a.send(0, batch(stored([1, 2], None, prompt_a[:8])))
                vllm_a.send(
                    1, batch(stored([3, 4], 2, prompt_a[8:16]), stored([9], None, prompt_b[:4]))
                )
                vllm_a.send(2, batch(removed([9])))
                # vLLM b: prompt b's blocks, the last one offloaded to the CPU and dropped on
                # the GPU (the host tier).
                vllm_b.send(0, batch(stored([1, 2, 3], None, prompt_b[:12])))
                vllm_b.send(1, batch(stored([3], 2, prompt_b[8:12], None, "CPU"), removed([3])))
                await eventually(
                    lambda: (
                        [i.stats()["streams"] for i in ingests.values()]
                        == [{"vllm-a": 2}, {"vllm-b": 1}]
                    )
                )
                a = block_hashes_for_tokens(prompt_a, BS)
                b = block_hashes_for_tokens(prompt_b, BS)
                expected = {
                    "vllm-a": {h: 0 for h in a},
                    "vllm-b": {b[0]: 0, b[1]: 0, b[2]: 1},
                }

                def router_index() -> dict[str, dict[int, int]]:
                    index = runtime.index
                    return {w: index.worker_blocks(w) for w in expected if w in index.workers()}

                # The index and the workers' registry reach the core by different tasks.
                await eventually(
                    lambda: (
                        router_index() == expected and set(expected) <= set(runtime.core.workers)
                    )
                )
                assert {w: i.local_blocks() for w, i in ingests.items()} == expected
                for prompt, worker, cached in ((prompt_a, "vllm-a", 16), (prompt_b, "vllm-b", 12)):
                    response = await router.post("/route", json={"prompt_token_ids": prompt})
                    assert response.status_code == 200
                    body = response.json()
                    assert (body["worker"], body["url"]) == (worker, f"http://{worker}:8000")
                    assert body["expected_cached_tokens"] == cached
                    assert body["num_blocks"] == len(prompt) // BS
            finally:
                for task in tasks:
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
    assert (sglang.topic, sglang.data_parallel_size, sglang.window_size) == ("", 1, 0)
    ranked = build_parser().parse_args(
        [
            "ingest",
            "vllm",
            "--worker-id",
            "v3",
            "--data-parallel-size",
            "4",
            "--window-size",
            "8192",
        ]
    )
    assert (ranked.data_parallel_size, ranked.window_size) == (4, 8192)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-parallel-size", "0"], "--data-parallel-size must be positive, got 0"),
        (["--window-size", "-1"], "--window-size must be >= 0, got -1"),
        (["--block-size", "0"], "--block-size must be positive, got 0"),
    ],
)
def test_cli_refuses_bad_numbers_before_connecting(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["ingest", "vllm", "--worker-id", "v3", "--redis-url", "redis://nowhere:1", *flags]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"kvmesh ingest: {message}"
