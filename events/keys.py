"""Every Redis key kvmesh uses, built in one place.

A worker's keys carry its id as a Redis Cluster hash tag (``{w3}``), so they all live in one
slot and can be written in one pipeline (or one ``MULTI``) on a cluster too::

    kvmesh:{<worker>}:events            stream of event batches (XADD MAXLEN ~ N)
    kvmesh:{<worker>}:snapshot          the worker's whole tree as replayable stored events
    kvmesh:{<worker>}:snapshot:request  set by a consumer that needs a fresher snapshot
    kvmesh:{<worker>}:load              hash: active sequences, free/used blocks, queue depth
    kvmesh:{<worker>}:alive             heartbeat, "<epoch> <last event id>", with a TTL
    kvmesh:workers                      registry hash: worker id -> JSON entry
    kvmesh:cordons                      hash: worker id -> JSON cordon (operators, via routers)
    kvmesh:{routers}:decisions          stream: every router's requests begun, prefilled, ended
    kvmesh:{routers}:alive:<router>     a router's heartbeat, with a TTL

The routers' keys share the hash tag ``{routers}``: one slot on a cluster, one pipeline.

Worker ids are checked (``validate_worker_id``) before any key is built, so a bad id fails
with an ``InvalidWorkerIdError`` (``events.errors``; also a ``ValueError``) before any I/O.
Braces are refused because they would change the hash tag; control characters and whitespace
because they make keys unreadable in ``redis-cli``.
"""

from __future__ import annotations

from typing import Final

from events.errors import InvalidWorkerIdError

__all__ = [
    "CORDONS_KEY",
    "DECISIONS_KEY",
    "MAX_WORKER_ID_LENGTH",
    "WORKERS_KEY",
    "alive_key",
    "events_key",
    "load_key",
    "router_alive_key",
    "snapshot_key",
    "snapshot_request_key",
    "validate_worker_id",
    "worker_from_events_key",
]

PREFIX: Final = "kvmesh"
WORKERS_KEY: Final = f"{PREFIX}:workers"
CORDONS_KEY: Final = f"{PREFIX}:cordons"
DECISIONS_KEY: Final = f"{PREFIX}:{{routers}}:decisions"
MAX_WORKER_ID_LENGTH: Final = 128

_EVENTS_SUFFIX: Final = "}:events"
_EVENTS_PREFIX: Final = f"{PREFIX}:{{"


def validate_worker_id(worker_id: object) -> str:
    """Return ``worker_id`` if it can name a worker's keys; else raise ``InvalidWorkerIdError``."""
    if not isinstance(worker_id, str):
        raise InvalidWorkerIdError(f"worker id must be a str, got {type(worker_id).__name__}")
    if not worker_id:
        raise InvalidWorkerIdError("worker id must not be empty")
    if len(worker_id) > MAX_WORKER_ID_LENGTH:
        raise InvalidWorkerIdError(
            f"worker id is {len(worker_id)} characters long; at most {MAX_WORKER_ID_LENGTH}"
        )
    if "{" in worker_id or "}" in worker_id:
        raise InvalidWorkerIdError(
            f"worker id {worker_id!r} must not contain braces (Redis hash tags)"
        )
    if not worker_id.isprintable() or any(c.isspace() for c in worker_id):
        raise InvalidWorkerIdError(
            f"worker id {worker_id!r} must not contain whitespace or control chars"
        )
    return worker_id


def _worker_key(worker_id: str, suffix: str) -> str:
    return f"{PREFIX}:{{{validate_worker_id(worker_id)}}}:{suffix}"


def events_key(worker_id: str) -> str:
    return _worker_key(worker_id, "events")


def snapshot_key(worker_id: str) -> str:
    return _worker_key(worker_id, "snapshot")


def snapshot_request_key(worker_id: str) -> str:
    return _worker_key(worker_id, "snapshot:request")


def load_key(worker_id: str) -> str:
    return _worker_key(worker_id, "load")


def alive_key(worker_id: str) -> str:
    return _worker_key(worker_id, "alive")


def router_alive_key(router_id: str) -> str:
    """A router's heartbeat key (its id is checked as a worker id is)."""
    return f"{PREFIX}:{{routers}}:alive:{validate_worker_id(router_id)}"


def worker_from_events_key(key: str | bytes) -> str:
    """The worker id inside an events stream key (``InvalidWorkerIdError`` if it is not one)."""
    text = key.decode() if isinstance(key, bytes) else key
    if not (text.startswith(_EVENTS_PREFIX) and text.endswith(_EVENTS_SUFFIX)):
        raise InvalidWorkerIdError(f"{text!r} is not a kvmesh events stream key")
    return validate_worker_id(text[len(_EVENTS_PREFIX) : -len(_EVENTS_SUFFIX)])
