"""Ingest's one error tree: everything ``kvmesh ingest`` raises of its own derives from
``IngestError``.

Errors::

    IngestError
    ├── IngestSettingsError      (also a ValueError) a bad option; the message names its flag
    ├── TrtllmIngestError        (also a RuntimeError) the TensorRT-LLM endpoint answered
    │                            something that is not a list of events
    └── VllmIngestError
        ├── VllmDecodeError      (also a ValueError) a payload or event not in vLLM's wire format
        └── UnknownParentError   a stored event below (or, without tokens, of) a block this stream
                                 never saw

Each engine's module re-exports its own (``app.ingest.trtllm``, ``app.ingest.vllm``).
"""

from __future__ import annotations

__all__ = [
    "IngestError",
    "IngestSettingsError",
    "TrtllmIngestError",
    "UnknownParentError",
    "VllmDecodeError",
    "VllmIngestError",
]


class IngestError(Exception):
    """Base of ingest's errors."""


class IngestSettingsError(IngestError, ValueError):
    """A bad ``kvmesh ingest`` option (or a missing Redis); the message names its flag."""


class TrtllmIngestError(IngestError, RuntimeError):
    """The TensorRT-LLM endpoint answered something that is not a list of events."""


class VllmIngestError(IngestError):
    """Base of the vLLM / SGLang ingester's errors."""


class VllmDecodeError(VllmIngestError, ValueError):
    """A payload or an event that is not in vLLM's wire format; the message names the field."""


class UnknownParentError(VllmIngestError):
    """A stored event hangs below a block the stream never saw (an event was missed)."""
