"""The vLLM / SGLang ingester: subscribe to a server's ZeroMQ KV events, republish them re-keyed.

``VllmIngest`` subscribes (pyzmq, asyncio) to the PUB socket of ``app.ingest.vllm.wire``'s
protocol, checks sequence numbers, decodes and re-keys each batch (``decode_batch``,
``Rekeyer``) and publishes the result through its stream's ``Republisher``
(``app.ingest.stream``), whose ``PrefixIndex`` of what it published is the snapshot. A gap asks
the replay endpoint for everything from the first missing sequence; what it cannot give back is
reported as ``dropped`` (the publisher writes a snapshot of what the ingester knows). A sequence
number back to 0 is a publisher restart: a new epoch, an empty index. A sequence at or below the
last one is a duplicate (replay overlap) and skipped.

Data parallelism. Each vLLM data-parallel rank has its own ``ZmqEventPublisher`` on the base port
plus its rank (``offset_endpoint``; replay endpoint likewise), its own sequence numbers and its
own KV cache. With ``data_parallel_size > 1`` the ingester subscribes to every rank's endpoint
and republishes each as its own kvmesh worker ``<worker-id>-dp<rank>`` (as ``ingest trtllm``
names attention-DP ranks), with its own re-keying, epoch, local index and registry entry (which
carries ``data_parallel_rank``). A batch whose ``data_parallel_rank`` disagrees with its
endpoint's rank is applied to the endpoint's stream and counted (``rank_mismatches``).

``run_vllm_ingest`` is what ``kvmesh ingest vllm|sglang`` runs, from its settings
(``app.ingest.settings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio
from redis.asyncio import Redis

from app.ingest.errors import VllmDecodeError
from app.ingest.settings import VllmIngestSettings
from app.ingest.stream import Republisher, rank_worker_id, registry_entry
from app.ingest.vllm.rekey import Rekeyer
from app.ingest.vllm.wire import decode_batch
from cache import KVCacheEvent, RemovedData, StoredBlock, StoredData
from cache.hashing import as_token_array, hash_token_blocks
from events import keys
from events.index import PrefixIndex
from events.publisher import EventPublisher, PublisherConfig
from events.redis_io import client_for

__all__ = ["END_SEQ", "VllmIngest", "offset_endpoint", "run_vllm_ingest"]

logger = logging.getLogger(__name__)

END_SEQ = -1  # the replay's last message


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` publishes, as vLLM's (and SGLang's)
    ``ZmqEventPublisher.offset_endpoint_port`` moves it: rank 0 as given, a TCP port plus the
    rank, an inproc name plus ``_dp<rank>``."""
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"endpoint {endpoint!r} has no port to offset by the rank")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"endpoint {endpoint!r}: data-parallel ranks need tcp:// or inproc://")


class _Stream(Republisher):
    """One publisher (the worker, or one data-parallel rank of it) republished as a kvmesh
    worker, with its subscription and its re-keying."""

    __slots__ = ("endpoint", "last_seq", "rank", "rekeyer", "replay_endpoint", "sub")

    def __init__(
        self,
        redis: Redis,
        worker_id: str,
        config: PublisherConfig,
        entry: dict[str, Any],
        *,
        rank: int | None,  # None without data parallelism
        endpoint: str,
        replay_endpoint: str | None,
        sub: zmq.asyncio.Socket,
        rekeyer: Rekeyer,
    ) -> None:
        super().__init__(redis, worker_id, config, entry)
        self.rank = rank
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.sub = sub
        self.rekeyer = rekeyer
        self.last_seq = -1

    def last_event_id(self) -> int:
        return self.rekeyer.next_event_id - 1

    def restart(self) -> None:
        self.rekeyer.reset()
        self.last_seq = -1
        super().restart()


def _warm_up() -> None:
    """Compile (or load from numba's cache) the kernels of the hot path -- the block hasher, the
    index's -- now rather than on the first events, which would wait a tenth of a second."""
    block_hash = int(hash_token_blocks(as_token_array([0]), 1, 1)[0])
    index = PrefixIndex()
    index.apply_event(
        "warm-up", KVCacheEvent(0, StoredData(None, [StoredBlock(block_hash, (0,))]), 0)
    )
    index.apply_event("warm-up", KVCacheEvent(1, RemovedData([block_hash]), 0))


class VllmIngest:
    """Subscribes to one vLLM/SGLang server (each of its data-parallel ranks) and republishes
    re-keyed events."""

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        redis: Redis | str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        url: str | None = None,
        block_size: int | None = None,
        model: str | None = None,
        window_size: int = 0,
        data_parallel_size: int = 1,
        source: str = "vllm",
        replay_timeout_s: float = 2.0,
        **publisher_options: Any,
    ) -> None:
        self.worker_id = keys.validate_worker_id(worker_id)
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
        if window_size < 0:
            raise ValueError(f"window_size must be >= 0, got {window_size}")
        ranks: list[int | None] = (
            [None] if data_parallel_size == 1 else [*range(data_parallel_size)]
        )
        for rank in ranks:  # bad endpoints fail here, before any socket exists
            keys.validate_worker_id(rank_worker_id(self.worker_id, rank))
            offset_endpoint(endpoint, rank or 0)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.url = url
        self.block_size = block_size
        self.model = model
        self.window_size = window_size
        self.source = source
        self.replay_timeout_s = replay_timeout_s
        self._redis, self._owns_redis = client_for(redis)
        self._ctx = zmq.asyncio.Context()
        self._publisher_options = publisher_options
        _warm_up()
        self._streams = [self._make_stream(rank) for rank in ranks]
        self._by_socket = {stream.sub: stream for stream in self._streams}
        self.num_batches = 0
        self.num_events = 0
        self.num_malformed = 0
        self.num_duplicates = 0
        self.num_replayed = 0
        self.num_lost = 0  # batches or events that could not be applied (reported as dropped)
        self.num_restarts = 0
        self.num_rank_mismatches = 0

    def _make_stream(self, rank: int | None) -> _Stream:
        endpoint = offset_endpoint(self.endpoint, rank or 0)
        replay = self.replay_endpoint
        if replay is not None:
            replay = offset_endpoint(replay, rank or 0)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(endpoint)
        entry = registry_entry(self.source, self.url, self.block_size, self.model)
        if rank is not None:
            entry["data_parallel_rank"] = rank
        return _Stream(
            self._redis,
            rank_worker_id(self.worker_id, rank),
            PublisherConfig(**self._publisher_options),
            entry,
            rank=rank,
            endpoint=endpoint,
            replay_endpoint=replay,
            sub=sub,
            rekeyer=Rekeyer(block_size=self.block_size, window_size=self.window_size),
        )

    async def __aenter__(self) -> VllmIngest:
        for stream in self._streams:
            await stream.publisher.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for stream in self._streams:
            await stream.publisher.aclose()
            stream.sub.close(0)
        self._ctx.term()
        if self._owns_redis:
            await self._redis.aclose()

    # -- what it holds -------------------------------------------------------------------------

    def _stream_of(self, worker_id: str | None) -> _Stream:
        if worker_id is None:
            return self._streams[0]
        for stream in self._streams:
            if stream.worker_id == worker_id:
                return stream
        raise KeyError(worker_id)

    @property
    def worker_ids(self) -> list[str]:
        return [stream.worker_id for stream in self._streams]

    @property
    def publisher(self) -> EventPublisher:
        """The first stream's publisher (the only one without data parallelism)."""
        return self._streams[0].publisher

    @property
    def last_seq(self) -> int:
        """The first stream's last sequence number (the only one without data parallelism)."""
        return self._streams[0].last_seq

    def publishers(self) -> dict[str, EventPublisher]:
        return {stream.worker_id: stream.publisher for stream in self._streams}

    def endpoints(self) -> dict[str, tuple[str, str | None]]:
        """Per kvmesh worker id: the PUB endpoint and the replay endpoint it listens to."""
        return {s.worker_id: (s.endpoint, s.replay_endpoint) for s in self._streams}

    def local_blocks(self, worker_id: str | None = None) -> dict[int, int]:
        """What the ingester believes the worker (or one rank's stream) holds: hash -> tier."""
        return self._stream_of(worker_id).local_blocks()

    def stats(self) -> dict[str, Any]:
        return {
            "batches": self.num_batches,
            "events": self.num_events,
            "malformed": self.num_malformed,
            "duplicates": self.num_duplicates,
            "replayed": self.num_replayed,
            "lost": self.num_lost,
            "restarts": self.num_restarts,
            "rank_mismatches": self.num_rank_mismatches,
            "last_seq": self.last_seq,
            "streams": {s.worker_id: s.last_seq for s in self._streams},
        }

    # -- one message ---------------------------------------------------------------------------

    async def handle(self, frames: Sequence[bytes], worker_id: str | None = None) -> None:
        """One multipart message ``(topic, seq, payload)`` from a SUB socket (of the stream
        ``worker_id``; the first stream by default)."""
        await self._handle(self._stream_of(worker_id), frames)

    async def _handle(self, stream: _Stream, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.num_malformed += 1
            logger.warning(
                "ingest %s: skipped a message of %d frames", stream.worker_id, len(frames)
            )
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = stream.last_seq
        if seq == 0 and last >= 0:
            self._restart(stream)
        elif seq <= last:
            self.num_duplicates += 1
            return
        elif seq > last + 1:
            await self._fill_gap(stream, last + 1, seq)
            if seq <= stream.last_seq:  # the replay already brought it
                return
        self._apply(stream, seq, frames[2])

    def _restart(self, stream: _Stream) -> None:
        self.num_restarts += 1
        logger.info("ingest %s: the publisher restarted (sequence back to 0)", stream.worker_id)
        stream.restart()

    async def _fill_gap(self, stream: _Stream, first: int, upto: int) -> None:
        """Replay ``first .. upto-1``; what does not come back is reported as lost."""
        if stream.replay_endpoint is not None:
            for seq, payload in await self._replay(stream, first):
                if seq >= upto:
                    break
                if seq <= stream.last_seq:
                    continue
                if seq > stream.last_seq + 1:
                    missing = seq - stream.last_seq - 1
                    self._lose(stream, missing, f"replay lacks {stream.last_seq + 1}..")
                self.num_replayed += 1
                self._apply(stream, seq, payload)
        if stream.last_seq < upto - 1:
            missing = upto - 1 - stream.last_seq
            self._lose(stream, missing, f"batches {stream.last_seq + 1}..{upto - 1}")
            stream.last_seq = upto - 1

    def _lose(self, stream: _Stream, count: int, what: str) -> None:
        self.num_lost += count
        logger.warning("ingest %s: lost %s; consumers resync", stream.worker_id, what)
        stream.publisher.publish([], dropped=count)

    async def replay(self, start_seq: int, worker_id: str | None = None) -> list[tuple[int, bytes]]:
        """Ask a stream's replay endpoint for the batches from ``start_seq``."""
        return await self._replay(self._stream_of(worker_id), start_seq)

    async def _replay(self, stream: _Stream, start_seq: int) -> list[tuple[int, bytes]]:
        """The batches from ``start_seq`` the replay endpoint still has (what came before a
        timeout, if it does not answer)."""
        assert stream.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(stream.replay_endpoint)
            await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    logger.warning("ingest %s: replay timed out", stream.worker_id)
                    return got
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.num_malformed += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    return got
                got.append((seq, frames[2]))
        finally:
            sock.close(0)

    def apply_payload(self, seq: int, payload: bytes, worker_id: str | None = None) -> None:
        """Decode, re-key and publish one batch of a stream (the first by default)."""
        self._apply(self._stream_of(worker_id), seq, payload)

    def _apply(self, stream: _Stream, seq: int, payload: bytes) -> None:
        """Decode, re-key and publish one batch (synchronously: the snapshot source then always
        matches what was published). Everything lost in the batch is reported with its first
        published entry, so consumers resynchronise once per batch, not once per loss."""
        stream.last_seq = seq
        self.num_batches += 1
        publisher = stream.publisher
        try:
            batch = decode_batch(payload, coalesce=True)
        except VllmDecodeError as exc:
            self.num_malformed += 1
            self._lose(stream, 1, f"batch {seq}: {exc}")
            return
        worker_id = stream.worker_id
        if batch.data_parallel_rank not in (None, stream.rank or 0):
            self.num_rank_mismatches += 1
            logger.warning(
                "ingest %s: batch %d says data-parallel rank %d; applied to its endpoint's stream",
                worker_id,
                seq,
                batch.data_parallel_rank,
            )
        for error in batch.errors:
            logger.warning("ingest %s: batch %d: skipped %s", worker_id, seq, error)
        self.num_malformed += len(batch.errors)
        # Coalesced removals have a medium the re-keying maps, so a refusal is one vLLM event.
        pending, refused = stream.rekeyer.apply_all(batch.events)
        for refusal in refused:
            logger.warning("ingest %s: batch %d: %s", worker_id, seq, refusal)
            if isinstance(refusal, VllmDecodeError):
                self.num_malformed += 1
        lost = len(batch.errors) + len(refused)
        self.num_events += batch.num_events - len(refused)
        apply_event = stream.index.apply_event
        for kv_event in pending:
            apply_event(worker_id, kv_event)
        self.num_lost += lost
        if pending or lost:
            publisher.publish(pending, dropped=lost)

    async def run(self, *, max_batches: int | None = None) -> None:
        """Receive until cancelled (or ``max_batches`` messages, over all streams)."""
        received = 0
        if len(self._streams) == 1:
            stream = self._streams[0]
            recv = stream.sub.recv_multipart
            while max_batches is None or received < max_batches:
                frames = await recv()
                received += 1
                await self._handle(stream, frames)
            return
        poller = zmq.asyncio.Poller()
        for stream in self._streams:
            poller.register(stream.sub, zmq.POLLIN)
        while max_batches is None or received < max_batches:
            for sock, _ in await poller.poll():
                if max_batches is not None and received >= max_batches:
                    break
                frames = await sock.recv_multipart()
                received += 1
                await self._handle(self._by_socket[sock], frames)


async def run_vllm_ingest(settings: VllmIngestSettings) -> dict[str, Any]:
    """What ``kvmesh ingest vllm|sglang`` runs; returns the ingester's stats when it stops."""
    ingest = VllmIngest(
        settings.endpoint,
        settings.worker_id,
        settings.redis_url,
        replay_endpoint=settings.replay_endpoint,
        topic=settings.topic,
        url=settings.url,
        block_size=settings.block_size,
        model=settings.served_model_name,
        window_size=settings.window_size,
        data_parallel_size=settings.data_parallel_size,
        source=settings.source,
    )
    async with ingest:
        with contextlib.suppress(asyncio.CancelledError):
            await ingest.run(max_batches=settings.max_batches)
        for publisher in ingest.publishers().values():
            await publisher.flush(10)
        return ingest.stats()
