"""``kvmesh bench ingest``: vLLM KV events through ``kvmesh ingest vllm`` into the Redis stream.

The ingester is measured, not vLLM: the ZeroMQ messages are *pre-encoded*. A simulated vLLM
prefix cache (16 tokens a block, vLLM's builtin-hash style int block hashes) serves requests of
1,024 tokens: the first 512 are one of 10 shared documents (stored once, never evicted), the
other 512 are the request's own. Each scheduler step serves 4 requests and becomes one
``KVEventBatch``, in vLLM's current wire form (msgspec maps, ``omit_defaults``): a
``BlockStored`` per new chain (a document's 32 blocks the first time it is seen, each request's
32 tail blocks below its document), and -- once more than 96 tails are cached -- a
one-hash ``BlockRemoved`` per evicted block, oldest tail first, as vLLM's ``BlockPool`` emits
them. Not timed.

Timed: a sender process (fork) publishes the messages ``(topic, seq, payload)`` on an XPUB socket
(vLLM's PUB, plus the subscription notice, so it starts only once the ingester's SUB is
subscribed; no high-water mark, so nothing is dropped) as fast as it can; the main process runs
``VllmIngest`` (decode, re-key by kvmesh's chained hashes, its local index, ``EventPublisher``
with its default settings) into a private embedded ``redis-server`` (or ``$REDIS_URL``).
``block_events_per_s`` = stored blocks + removed hashes, divided by the time from the sender's
go to the publisher's last entry written to Redis (``flush``); ``block_events_per_cpu_s``
divides by the ingesting process's CPU time instead (less sensitive to a busy machine).

Then, not timed: an ``EventConsumer`` reads the stream back; its index and the ingester's must
both equal the simulated vLLM's cache keyed by kvmesh's hashes of the same tokens
(``index_exact``). The run fails otherwise, or if anything was lost, malformed or dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import random
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

from app.bench import bench_redis, receive
from app.ingest.vllm import VllmIngest
from cache import block_hashes_for_tokens
from events.consumer import ConsumerConfig, EventConsumer

SEED = 13  # issue #13
TOKENS_PER_BLOCK = 16
DOC_TOKENS = 512
TAIL_TOKENS = 512
NUM_DOCS = 10
VOCAB_SIZE = 32_000
REQUESTS_PER_STEP = 4
MAX_TAILS = 96  # cached request tails before the oldest is evicted
TOPIC = b"kv-events"
NUM_STEPS = 1_500  # about 330,000 block events
NUM_STEPS_QUICK = 40
TIMEOUT_S = 120.0


@dataclass(slots=True)
class Workload:
    """The pre-encoded messages and what the simulated vLLM holds at the end."""

    payloads: list[bytes] = field(default_factory=list)
    num_events: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    # kvmesh hash of every block vLLM holds at the end (all on the GPU tier)
    final: dict[int, int] = field(default_factory=dict)

    @property
    def block_events(self) -> int:
        return self.stored_blocks + self.removed_blocks


def _stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    # vLLM's BlockStored with omit_defaults: lora_id, medium and lora_name have no default.
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": TOKENS_PER_BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def generate(num_steps: int, seed: int = SEED) -> Workload:
    """The messages of ``num_steps`` scheduler steps, reproducibly."""
    rng = random.Random(seed)
    docs = [[rng.randrange(VOCAB_SIZE) for _ in range(DOC_TOKENS)] for _ in range(NUM_DOCS)]
    doc_blocks = DOC_TOKENS // TOKENS_PER_BLOCK
    tail_blocks = TAIL_TOKENS // TOKENS_PER_BLOCK
    doc_hashes = [[d * 1_000 + j + 1 for j in range(doc_blocks)] for d in range(NUM_DOCS)]
    doc_cached = [False] * NUM_DOCS
    next_hash = 1 << 40
    tails: deque[tuple[list[int], list[int]]] = deque()  # (vLLM hashes, kvmesh hashes)
    out = Workload()
    for step in range(num_steps):
        events: list[dict[str, Any]] = []
        for _ in range(REQUESTS_PER_STEP):
            d = rng.randrange(NUM_DOCS)
            tail = [rng.randrange(VOCAB_SIZE) for _ in range(TAIL_TOKENS)]
            if not doc_cached[d]:
                doc_cached[d] = True
                events.append(_stored(doc_hashes[d], None, docs[d]))
                out.stored_blocks += doc_blocks
            hashes = list(range(next_hash, next_hash + tail_blocks))
            next_hash += tail_blocks
            events.append(_stored(hashes, doc_hashes[d][-1], tail))
            out.stored_blocks += tail_blocks
            kv = block_hashes_for_tokens(docs[d] + tail, TOKENS_PER_BLOCK)[doc_blocks:]
            tails.append((hashes, kv))
            while len(tails) > MAX_TAILS:
                for h in tails.popleft()[0]:
                    events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"})
                    out.removed_blocks += 1
        out.num_events += len(events)
        batch = {"ts": 1_700_000_000.0 + step, "events": events, "data_parallel_rank": 0}
        out.payloads.append(msgpack.packb(batch))
    for d in range(NUM_DOCS):
        if doc_cached[d]:
            for h in block_hashes_for_tokens(docs[d], TOKENS_PER_BLOCK):
                out.final[h] = 0
    for _, kv in tails:
        for h in kv:
            out.final[h] = 0
    return out


# -- the sender ------------------------------------------------------------------------------


def _sender(payloads: list[bytes], conn: Connection) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the ingester is what is measured
    pub.setsockopt(zmq.LINGER, -1)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    if not pub.poll(int(TIMEOUT_S * 1000)):  # the SUB's subscription notice
        conn.send("no subscriber")
        return
    pub.recv()
    conn.send("subscribed")
    if conn.recv() != "go":
        return
    send = pub.send_multipart
    for seq, payload in enumerate(payloads):
        send((TOPIC, seq.to_bytes(8, "big"), payload), copy=False)
    pub.close()
    ctx.term()
    conn.send("sent")


async def _ingest(url: str, work: Workload, conn: Connection) -> dict[str, Any]:
    port = await receive(conn, TIMEOUT_S, "sender")
    worker_id = f"bench-vllm-{secrets.token_hex(4)}"
    ingest = VllmIngest(
        f"tcp://127.0.0.1:{port}",
        worker_id,
        url,
        topic=TOPIC.decode(),
        block_size=TOKENS_PER_BLOCK,
        url="http://127.0.0.1:8000",
    )
    num_batches = len(work.payloads)
    async with ingest:
        if await receive(conn, TIMEOUT_S, "sender") != "subscribed":
            raise RuntimeError("the ingester did not subscribe")
        cpu_start = time.process_time()
        t0 = time.monotonic()
        conn.send("go")
        await asyncio.wait_for(ingest.run(max_batches=num_batches), TIMEOUT_S)
        await ingest.publisher.flush(TIMEOUT_S)
        seconds = time.monotonic() - t0
        cpu_s = time.process_time() - cpu_start
        if await receive(conn, TIMEOUT_S, "sender") != "sent":
            raise RuntimeError("the sender did not finish")
        stats = ingest.stats()
        publisher_stats = ingest.publisher.stats()
        local = ingest.local_blocks()
        consumer = EventConsumer(url, ConsumerConfig(registry_interval_s=0.05))
        async with consumer:
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline:
                index = consumer.index
                seen = index.worker_blocks(worker_id)
                if seen == work.final and consumer.last_seq(worker_id) == ingest.publisher.last_seq:
                    break
                await asyncio.sleep(0.01)
            consumer_stats = consumer.stats()
    return {
        "seconds": seconds,
        "cpu_s": cpu_s,
        "stats": stats,
        "publisher": publisher_stats,
        "exact": local == work.final and seen == work.final,
        "consumer": consumer_stats,
    }


def measure(url: str, *, quick: bool, embedded: bool) -> dict[str, Any]:
    t_gen = time.monotonic()
    work = generate(NUM_STEPS_QUICK if quick else NUM_STEPS)
    generate_seconds = time.monotonic() - t_gen
    gc.collect()
    gc.freeze()  # the forked sender never walks the workload
    context = multiprocessing.get_context("fork")
    parent_conn, child_conn = context.Pipe()
    process = context.Process(target=_sender, args=(work.payloads, child_conn), daemon=True)
    process.start()
    try:
        result = asyncio.run(_ingest(url, work, parent_conn))
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
        gc.unfreeze()
    stats = result["stats"]
    dropped = result["publisher"]["dropped"]
    if not result["exact"] or stats["lost"] or stats["malformed"] or dropped:
        raise RuntimeError(
            f"the index is not exact (exact={result['exact']}, lost={stats['lost']}, "
            f"malformed={stats['malformed']}, dropped={dropped})"
        )
    if stats["batches"] != len(work.payloads) or stats["events"] != work.num_events:
        raise RuntimeError(f"the ingester applied {stats['batches']} batches, {stats['events']}")
    seconds = result["seconds"]
    return {
        "block_events_per_s": round(work.block_events / seconds),
        "block_events_per_cpu_s": round(work.block_events / result["cpu_s"]),
        "vllm_events_per_s": round(work.num_events / seconds),
        "batches": len(work.payloads),
        "vllm_events": work.num_events,
        "block_events": work.block_events,
        "stored_blocks": work.stored_blocks,
        "removed_blocks": work.removed_blocks,
        "final_blocks": len(work.final),
        "kvmesh_entries": result["publisher"]["entries"],
        "seconds": round(seconds, 3),
        "ingester_cpu_s": round(result["cpu_s"], 3),
        "consumer_resyncs": result["consumer"]["resyncs"],
        "index_exact": True,
        "tokens_per_block": TOKENS_PER_BLOCK,
        "wire_form": "map",
        "embedded_redis": embedded,
        "generate_seconds": round(generate_seconds, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with bench_redis() as (url, server):
        return measure(url, quick=args.quick, embedded=server is not None)
