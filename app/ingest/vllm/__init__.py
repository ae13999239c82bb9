"""``kvmesh ingest vllm|sglang``: a vLLM (or SGLang) server's ZMQ KV events, re-keyed for kvmesh.

vLLM and SGLang publish their KV cache events over ZeroMQ (``--kv-events-config``); one protocol,
one ingester. Three layers, the first two pure and synchronous, one module each::

    wire.py     the wire format: ``decode_batch`` turns a msgpack ``KVEventBatch`` into records
                (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), array or map encoded,
                coalescing runs of removals on the hot path
    rekey.py    ``Rekeyer``: records -> kvmesh ``KVCacheEvent`` s keyed by kvmesh's chained hash
                of their tokens (LoRA as ``lora_name_id``, cache salt, multimodal items as
                ``multimodal_hash``, keys kvmesh cannot express as opaque items), tiers by medium
    service.py  ``VllmIngest``: the subscriber (pyzmq, asyncio): sequence numbers, replay of
                gaps, restarts, one kvmesh worker per data-parallel rank (``offset_endpoint``),
                each published through a ``Republisher``; ``run_vllm_ingest`` for the CLI

Everything callers use is re-exported here.

Errors (of ingest's one tree, ``app.ingest.errors``)::

    IngestError
    └── VllmIngestError
        ├── VllmDecodeError      (also a ValueError) a payload or event not in vLLM's wire format
        └── UnknownParentError   a stored event below (or, without tokens, of) a block this stream
                                 never saw
"""

from app.ingest.errors import UnknownParentError, VllmDecodeError, VllmIngestError
from app.ingest.vllm.rekey import Rekeyer, lora_name_id, multimodal_hash
from app.ingest.vllm.service import VllmIngest, offset_endpoint, run_vllm_ingest
from app.ingest.vllm.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    VllmEvent,
    decode_batch,
    decode_event,
)

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
    "decode_event",
    "lora_name_id",
    "multimodal_hash",
    "offset_endpoint",
    "run_vllm_ingest",
]
