"""Ingest: other engines' KV events republished as kvmesh workers (``kvmesh ingest SOURCE``).

A TensorRT-LLM, vLLM or SGLang server does not publish kvmesh's stream; an ingester beside it
reads what the engine does publish, turns it into kvmesh ``KVCacheEvent`` s (re-keyed by kvmesh's
hashes where the engine's own are of no use to a router) and republishes them with an
``EventPublisher``, with the server's URL in the registry, so that one router places requests on
a mixed fleet as on its own workers. Ingest owns the engines' wire formats, the mapping of their
events onto kvmesh's, the handling of their sequence gaps and restarts, and the options of
``kvmesh ingest``; the stream, snapshot and registry are ``events/``'s. The modules::

    stream.py    Republisher: one engine stream as a kvmesh worker (its EventPublisher and the
                 PrefixIndex of what it published, whose dump is its snapshot); both engines'
    settings.py  the options of each source as a validated settings object, and their flags
    errors.py    the one error tree, IngestError and its subclasses
    trtllm.py    ``kvmesh ingest trtllm``: polls a TensorRT-LLM server's /kv_cache_events
    vllm/        ``kvmesh ingest vllm|sglang``: their ZeroMQ events (wire.py, rekey.py,
                 service.py), re-keyed by kvmesh's hashes of their tokens

Nothing here is imported by this package's ``__init__`` but the errors, so that the CLI builds its
parser from ``settings`` without loading an engine's client (pyzmq, httpx).
"""

from app.ingest.errors import (
    IngestError,
    IngestSettingsError,
    TrtllmIngestError,
    UnknownParentError,
    VllmDecodeError,
    VllmIngestError,
)

__all__ = [
    "IngestError",
    "IngestSettingsError",
    "TrtllmIngestError",
    "UnknownParentError",
    "VllmDecodeError",
    "VllmIngestError",
]
