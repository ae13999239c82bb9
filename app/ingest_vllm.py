"""``kvmesh ingest vllm|sglang``: a vLLM (or SGLang) server's ZMQ KV events, re-keyed for kvmesh.

vLLM's ``ZmqEventPublisher`` sends multipart messages ``(topic, seq, payload)``: ``seq`` an
8-byte big-endian counter from 0, ``payload`` a msgpack ``KVEventBatch`` -- ``[ts, events,
data_parallel_rank]`` (array-like; a map with those keys is accepted too). Each event is a
tagged array (``["BlockStored", ...fields]``) or a map with a ``type`` key:

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, then the
  optional medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window (trailing defaults are omitted on the wire);
* ``BlockRemoved``: block_hashes, then the optional medium, group_idx;
* ``AllBlocksCleared``: no fields.

An optional ROUTER socket replays: a request ``(b"", start_seq)`` is answered with every buffered
``(seq, payload)`` from ``start_seq``, then ``(-1, b"")``. SGLang's publisher speaks the same
protocol.

Three layers, the first two pure and synchronous:

* ``decode_batch`` turns a payload into typed records (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``). A payload that is not a batch raises ``VllmDecodeError``; a single
  malformed event is skipped and its error (naming the event and the field) returned;
* ``Rekeyer`` turns records into kvmesh ``KVCacheEvent`` s. vLLM's block hashes are its own, so
  every stored block is re-keyed by kvmesh's chained hash of the event's ``token_ids`` (below the
  parent's kvmesh hash; the LoRA id -- or, without one, ``lora_name_id(lora_name)`` -- as the
  key's LoRA task id), and a map vLLM hash -> kvmesh hash translates removals. Medium ``GPU``
  (or none) is level 0, ``CPU`` level 1; a block held on both is on the GPU tier, and losing its
  GPU copy is an ``updated`` event to level 1. ``AllBlocksCleared`` removes everything the
  stream holds. A stored event whose parent is unknown raises ``UnknownParentError``: the
  caller reports it as lost (consumers resynchronise from the snapshot);
* ``VllmIngest`` subscribes (pyzmq, asyncio), checks sequence numbers and publishes through an
  ``EventPublisher``. A gap asks the replay endpoint for everything from the first missing
  sequence; what it cannot give back is reported as ``dropped`` (the publisher writes a snapshot
  of what the ingester knows, from its own ``PrefixIndex``). A sequence number back to 0 is a
  publisher restart: a new epoch, an empty index. A sequence at or below the last one is a
  duplicate (replay overlap) and skipped.

Not mapped (yet): ``extra_keys`` (multimodal ids, cache salt) -- blocks are keyed by tokens and
LoRA only; KV cache groups other than ``kv_group`` (hybrid models) are skipped and counted; one
endpoint is one stream (data-parallel ranks each need their own ingester).

Errors::

    VllmIngestError
    ├── VllmDecodeError      (also a ValueError) a payload or event not in vLLM's wire format
    └── UnknownParentError   a stored event below a block this stream never saw
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio
from redis.asyncio import Redis

from cache import KVCacheEvent, RemovedData, StoredBlock, StoredData
from cache.events import EventDiff, UpdatedData
from cache.hashing import as_token_array, hash_token_blocks
from events import keys
from events.index import PrefixIndex
from events.publisher import EventPublisher, client_for
from events.snapshot import Snapshot

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "Rekeyer",
    "UnknownParentError",
    "VllmDecodeError",
    "VllmEvent",
    "VllmIngest",
    "VllmIngestError",
    "decode_batch",
    "lora_name_id",
    "run_vllm_ingest",
]

logger = logging.getLogger(__name__)

ExternalHash = int | bytes  # vLLM's ExternalBlockHash: an int (builtin hash) or sha256 bytes
END_SEQ = -1
MEDIUM_LEVELS = {"GPU": 0, "CPU": 1}
_GPU, _CPU = 1, 2  # bits of the media a vLLM block is held on


class VllmIngestError(Exception):
    """Base of this module's errors."""


class VllmDecodeError(VllmIngestError, ValueError):
    """A payload or an event that is not in vLLM's wire format; the message names the field."""


class UnknownParentError(VllmIngestError):
    """A stored event hangs below a block the stream never saw (an event was missed)."""


# -- the wire format -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[ExternalHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_MIN_FIELDS = {"BlockStored": 5, "BlockRemoved": 1, "AllBlocksCleared": 0}
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    ts: float
    events: tuple[VllmEvent, ...]
    data_parallel_rank: int | None
    errors: tuple[str, ...] = ()  # one per malformed event, skipped


def _is_hash(value: object) -> bool:
    return (type(value) is int) or isinstance(value, bytes)


def _opt(value: object, kind: type, name: str) -> Any:
    if value is not None and type(value) is not kind:
        raise VllmDecodeError(f"{name} must be {kind.__name__} or nil, got {type(value).__name__}")
    return value


def _hashes(value: object, name: str) -> tuple[ExternalHash, ...]:
    if not isinstance(value, list) or not all(map(_is_hash, value)):
        raise VllmDecodeError(f"{name} must be a list of int or bytes hashes")
    return tuple(value)


def _fields(raw: object) -> tuple[str, dict[str, Any]]:
    """An event's tag and its named fields, from the array-like or the map encoding."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise VllmDecodeError("event must start with its tag (a string)")
        tag, values = raw[0], raw[1:]
        names = _FIELDS.get(tag)
        if names is None:
            raise VllmDecodeError(f"unknown event tag {tag!r}")
        if not _MIN_FIELDS[tag] <= len(values) <= len(names):
            raise VllmDecodeError(
                f"{tag} has {len(values)} fields, expected {_MIN_FIELDS[tag]} to {len(names)}"
            )
        return tag, dict(zip(names, values, strict=False))
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str) or kind not in _FIELDS:
            raise VllmDecodeError(f"unknown event tag {kind!r}")
        tag = kind
        missing = [n for n in _FIELDS[tag][: _MIN_FIELDS[tag]] if n not in raw]
        if missing:
            raise VllmDecodeError(f"{tag} lacks {', '.join(missing)}")
        return tag, raw
    raise VllmDecodeError(f"event must be an array or a map, got {type(raw).__name__}")


def decode_event(raw: object) -> VllmEvent:
    """One event of a batch; raises ``VllmDecodeError`` naming what is malformed."""
    tag, f = _fields(raw)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        return BlockRemoved(
            _hashes(f["block_hashes"], "BlockRemoved.block_hashes"),
            _opt(f.get("medium"), str, "BlockRemoved.medium"),
            _opt(f.get("group_idx"), int, "BlockRemoved.group_idx"),
        )
    hashes = _hashes(f["block_hashes"], "BlockStored.block_hashes")
    parent = f["parent_block_hash"]
    if parent is not None and not _is_hash(parent):
        raise VllmDecodeError("BlockStored.parent_block_hash must be an int, bytes or nil")
    tokens = f["token_ids"]
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise VllmDecodeError("BlockStored.token_ids must be a list of ints")
    block_size = f["block_size"]
    if type(block_size) is not int or block_size <= 0:
        raise VllmDecodeError(f"BlockStored.block_size must be a positive int, got {block_size!r}")
    if len(tokens) != len(hashes) * block_size:
        raise VllmDecodeError(
            f"BlockStored.token_ids has {len(tokens)} tokens for {len(hashes)} blocks "
            f"of {block_size}"
        )
    extra = f.get("extra_keys")
    if extra is not None and (not isinstance(extra, list) or len(extra) != len(hashes)):
        raise VllmDecodeError("BlockStored.extra_keys must be nil or one entry per block")
    return BlockStored(
        hashes,
        parent,
        tuple(tokens),
        block_size,
        _opt(f.get("lora_id"), int, "BlockStored.lora_id"),
        _opt(f.get("medium"), str, "BlockStored.medium"),
        _opt(f.get("lora_name"), str, "BlockStored.lora_name"),
        None if extra is None else tuple(extra),
        _opt(f.get("group_idx"), int, "BlockStored.group_idx"),
    )


def decode_batch(payload: bytes) -> DecodedBatch:
    """A ``KVEventBatch`` payload. Raises ``VllmDecodeError`` when the batch itself is malformed;
    a malformed event is skipped and its error listed in ``errors``."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:  # ExtraData, FormatError, ... too
        raise VllmDecodeError(f"payload is not msgpack: {exc}") from exc
    if isinstance(raw, list):
        if not 2 <= len(raw) <= 3:
            raise VllmDecodeError(f"batch has {len(raw)} fields, expected 2 or 3")
        ts, items, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise VllmDecodeError("batch map lacks ts or events")
        ts, items, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise VllmDecodeError(f"batch must be an array or a map, got {type(raw).__name__}")
    if type(ts) not in (int, float):
        raise VllmDecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(items, list):
        raise VllmDecodeError(f"batch events must be an array, got {type(items).__name__}")
    _opt(rank, int, "batch data_parallel_rank")
    events: list[VllmEvent] = []
    errors: list[str] = []
    for i, item in enumerate(items):
        try:
            events.append(decode_event(item))
        except VllmDecodeError as exc:
            errors.append(f"event {i}: {exc}")
    return DecodedBatch(float(ts), tuple(events), rank, tuple(errors))


# -- re-keying ---------------------------------------------------------------------------------


def lora_name_id(name: str) -> int:
    """The LoRA task id a vLLM ``lora_name`` enters kvmesh block keys as (BLAKE2b-64, LE); a
    client routing by LoRA name sends this as ``lora_task_id``."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


@dataclass(slots=True)
class _Held:
    kv_hash: int
    media: int  # _GPU | _CPU bits


class Rekeyer:
    """vLLM events of one stream -> kvmesh events with consecutive ids from ``next_event_id``.

    Invariant: ``_held`` is exactly the set of vLLM blocks whose stored events were turned into
    kvmesh events (and not removed since), and ``_refs[k]`` the number of them keyed ``k``.
    """

    def __init__(
        self, *, block_size: int | None = None, window_size: int = 0, kv_group: int = 0
    ) -> None:
        self.block_size = block_size
        self.window_size = window_size
        self.kv_group = kv_group
        self.next_event_id = 0
        self._held: dict[ExternalHash, _Held] = {}
        self._refs: dict[int, int] = {}
        self.num_other_groups = 0
        self.num_unknown_removals = 0

    def kv_hash(self, vllm_hash: ExternalHash) -> int | None:
        held = self._held.get(vllm_hash)
        return None if held is None else held.kv_hash

    def num_blocks(self) -> int:
        return len(self._held)

    def _event(self, data: StoredData | RemovedData | UpdatedData) -> KVCacheEvent:
        event = KVCacheEvent(self.next_event_id, data, self.window_size)
        self.next_event_id += 1
        return event

    def apply(self, event: VllmEvent) -> list[KVCacheEvent]:
        """The kvmesh events for one vLLM event (none, one or two). Raises ``VllmDecodeError``
        or ``UnknownParentError`` before changing anything."""
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            return self._removed(event)
        return self._cleared()

    def _stored(self, ev: BlockStored) -> list[KVCacheEvent]:
        if (ev.group_idx or 0) != self.kv_group:
            self.num_other_groups += 1
            return []
        if self.block_size is not None and ev.block_size != self.block_size:
            raise VllmDecodeError(
                f"BlockStored.block_size is {ev.block_size}, the ingester's is {self.block_size}"
            )
        level = MEDIUM_LEVELS.get(ev.medium or "GPU")
        if level is None:
            raise VllmDecodeError(f"BlockStored.medium {ev.medium!r} is not GPU or CPU")
        parent_kv: int | None = None
        if ev.parent_block_hash is not None:
            parent_kv = self.kv_hash(ev.parent_block_hash)
            if parent_kv is None:
                raise UnknownParentError(
                    f"stored event below unknown block {ev.parent_block_hash!r}"
                )
        lora = ev.lora_id
        if lora is None and ev.lora_name is not None:
            lora = lora_name_id(ev.lora_name)
        n = len(ev.block_hashes)
        kv_hashes: list[int] = hash_token_blocks(
            as_token_array(ev.token_ids),
            ev.block_size,
            n,
            parent_hash=parent_kv or 0,
            lora_task_id=lora,
        ).tolist()
        bit = _GPU if level == 0 else _CPU
        blocks: list[StoredBlock] = []
        size = ev.block_size
        for i, (vllm_hash, kv_hash) in enumerate(zip(ev.block_hashes, kv_hashes, strict=True)):
            held = self._held.get(vllm_hash)
            if held is None:
                self._held[vllm_hash] = _Held(kv_hash, bit)
                self._refs[kv_hash] = self._refs.get(kv_hash, 0) + 1
            elif held.kv_hash != kv_hash:  # vLLM reused the hash for other tokens
                self._unref(held.kv_hash)
                self._held[vllm_hash] = _Held(kv_hash, bit)
                self._refs[kv_hash] = self._refs.get(kv_hash, 0) + 1
            else:
                held.media |= bit
            media = self._held[vllm_hash].media
            blocks.append(
                StoredBlock(
                    kv_hash,
                    ev.token_ids[i * size : (i + 1) * size],
                    cache_level=0 if media & _GPU else 1,
                    lora_id=lora,
                )
            )
        return [self._event(StoredData(parent_kv, blocks))]

    def _unref(self, kv_hash: int) -> bool:
        """Drop one reference; True when none is left (the block is gone)."""
        left = self._refs[kv_hash] - 1
        if left:
            self._refs[kv_hash] = left
            return False
        del self._refs[kv_hash]
        return True

    def _removed(self, ev: BlockRemoved) -> list[KVCacheEvent]:
        if (ev.group_idx or 0) != self.kv_group:
            self.num_other_groups += 1
            return []
        level = MEDIUM_LEVELS.get(ev.medium or "GPU")
        if level is None:
            raise VllmDecodeError(f"BlockRemoved.medium {ev.medium!r} is not GPU or CPU")
        bit = _GPU if level == 0 else _CPU
        gone: list[int] = []
        out: list[KVCacheEvent] = []
        for vllm_hash in ev.block_hashes:
            held = self._held.get(vllm_hash)
            if held is None or not held.media & bit:
                self.num_unknown_removals += 1
                continue
            held.media &= ~bit
            if held.media:  # the GPU copy went, the CPU copy stays: down to the host tier
                if bit == _GPU:
                    out.append(self._event(UpdatedData(held.kv_hash, EventDiff(0, 1))))
                continue
            del self._held[vllm_hash]
            if self._unref(held.kv_hash):
                gone.append(held.kv_hash)
        if gone:
            out.append(self._event(RemovedData(gone)))
        return out

    def _cleared(self) -> list[KVCacheEvent]:
        gone = list(self._refs)
        self._held.clear()
        self._refs.clear()
        return [self._event(RemovedData(gone))] if gone else []

    def reset(self) -> None:
        """A publisher restart: nothing is held, ids start again."""
        self._held.clear()
        self._refs.clear()
        self.next_event_id = 0


# -- the subscriber ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Stream:
    worker_id: str
    publisher: EventPublisher
    rekeyer: Rekeyer
    index: PrefixIndex = field(default_factory=PrefixIndex)

    def snapshot(self) -> Snapshot:
        events = (
            self.index.dump_events(self.worker_id) if self.worker_id in self.index.workers() else []
        )
        return Snapshot(events, self.rekeyer.next_event_id - 1)


class VllmIngest:
    """Subscribes to one vLLM/SGLang ZMQ publisher and republishes re-keyed events."""

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
        source: str = "vllm",
        replay_timeout_s: float = 2.0,
        **publisher_options: Any,
    ) -> None:
        self.worker_id = keys.validate_worker_id(worker_id)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self._redis, self._owns_redis = client_for(redis)
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        entry = {"url": url, "device": source, "tokens_per_block": block_size, "source": source}
        holder: list[_Stream] = []
        publisher = EventPublisher(
            self._redis,
            self.worker_id,
            snapshot_source=lambda: holder[0].snapshot(),
            registry_entry=entry,
            **publisher_options,
        )
        self._stream = _Stream(self.worker_id, publisher, Rekeyer(block_size=block_size))
        holder.append(self._stream)
        self.last_seq = -1
        self.num_batches = 0
        self.num_events = 0
        self.num_malformed = 0
        self.num_duplicates = 0
        self.num_replayed = 0
        self.num_lost = 0  # batches or events that could not be applied (reported as dropped)
        self.num_restarts = 0

    async def __aenter__(self) -> VllmIngest:
        await self._stream.publisher.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._stream.publisher.aclose()
        self._sub.close(0)
        self._ctx.term()
        if self._owns_redis:
            await self._redis.aclose()

    @property
    def publisher(self) -> EventPublisher:
        return self._stream.publisher

    def local_blocks(self) -> dict[int, int]:
        index = self._stream.index
        return index.worker_blocks(self.worker_id) if self.worker_id in index.workers() else {}

    def stats(self) -> dict[str, Any]:
        return {
            "batches": self.num_batches,
            "events": self.num_events,
            "malformed": self.num_malformed,
            "duplicates": self.num_duplicates,
            "replayed": self.num_replayed,
            "lost": self.num_lost,
            "restarts": self.num_restarts,
            "last_seq": self.last_seq,
        }

    # -- one message ---------------------------------------------------------------------------

    async def handle(self, frames: Sequence[bytes]) -> None:
        """One multipart message ``(topic, seq, payload)`` from the SUB socket."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.num_malformed += 1
            logger.warning("ingest %s: skipped a message of %d frames", self.worker_id, len(frames))
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq == 0 and self.last_seq >= 0:
            self._restart()
        elif seq <= self.last_seq:
            self.num_duplicates += 1
            return
        elif seq > self.last_seq + 1:
            await self._fill_gap(self.last_seq + 1, seq)
            if seq <= self.last_seq:  # the replay already brought it
                return
        self.apply_payload(seq, frames[2])

    def _restart(self) -> None:
        self.num_restarts += 1
        logger.info("ingest %s: the publisher restarted (sequence back to 0)", self.worker_id)
        stream = self._stream
        stream.rekeyer.reset()
        stream.index = PrefixIndex()
        stream.publisher.new_epoch()
        self.last_seq = -1

    async def _fill_gap(self, first: int, upto: int) -> None:
        """Replay ``first .. upto-1``; what does not come back is reported as lost."""
        if self.replay_endpoint is not None:
            for seq, payload in await self.replay(first):
                if seq >= upto:
                    break
                if seq <= self.last_seq:
                    continue
                if seq > self.last_seq + 1:
                    self._lose(seq - self.last_seq - 1, f"replay lacks {self.last_seq + 1}..")
                self.num_replayed += 1
                self.apply_payload(seq, payload)
        if self.last_seq < upto - 1:
            self._lose(upto - 1 - self.last_seq, f"batches {self.last_seq + 1}..{upto - 1}")
            self.last_seq = upto - 1

    def _lose(self, count: int, what: str) -> None:
        self.num_lost += count
        logger.warning("ingest %s: lost %s; consumers resync", self.worker_id, what)
        self._stream.publisher.publish([], dropped=count)

    async def replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Ask the replay endpoint for the batches from ``start_seq`` (empty on a timeout)."""
        assert self.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    logger.warning("ingest %s: replay timed out", self.worker_id)
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

    def apply_payload(self, seq: int, payload: bytes) -> None:
        """Decode, re-key and publish one batch (synchronously: the snapshot source then always
        matches what was published)."""
        self.last_seq = seq
        self.num_batches += 1
        try:
            batch = decode_batch(payload)
        except VllmDecodeError as exc:
            self.num_malformed += 1
            self._lose(1, f"batch {seq}: {exc}")
            return
        for error in batch.errors:
            logger.warning("ingest %s: batch %d: skipped %s", self.worker_id, seq, error)
        self.num_malformed += len(batch.errors)
        stream = self._stream
        pending: list[KVCacheEvent] = []
        lost = len(batch.errors)
        for event in batch.events:
            try:
                out = stream.rekeyer.apply(event)
            except VllmIngestError as exc:
                logger.warning("ingest %s: batch %d: %s", self.worker_id, seq, exc)
                if isinstance(exc, VllmDecodeError):
                    self.num_malformed += 1
                if pending or lost:
                    stream.publisher.publish(pending, dropped=lost)
                pending, lost = [], 0
                self.num_lost += 1
                stream.publisher.publish([], dropped=1)
                continue
            for kv_event in out:
                stream.index.apply_event(self.worker_id, kv_event)
            pending.extend(out)
            self.num_events += 1
        if pending or lost:
            stream.publisher.publish(pending, dropped=lost)

    async def run(self, *, max_batches: int | None = None) -> None:
        """Receive until cancelled (or ``max_batches`` messages)."""
        received = 0
        while max_batches is None or received < max_batches:
            frames = await self._sub.recv_multipart()
            received += 1
            await self.handle(frames)


async def run_vllm_ingest(
    endpoint: str,
    worker_id: str,
    redis_url: str,
    *,
    replay_endpoint: str | None = None,
    topic: str = "",
    url: str | None = None,
    block_size: int | None = None,
    source: str = "vllm",
    max_batches: int | None = None,
) -> dict[str, Any]:
    """What ``kvmesh ingest vllm|sglang`` runs; returns the ingester's stats when it stops."""
    ingest = VllmIngest(
        endpoint,
        worker_id,
        redis_url,
        replay_endpoint=replay_endpoint,
        topic=topic,
        url=url,
        block_size=block_size,
        source=source,
    )
    async with ingest:
        with contextlib.suppress(asyncio.CancelledError):
            await ingest.run(max_batches=max_batches)
        await ingest.publisher.flush(10)
        return ingest.stats()
