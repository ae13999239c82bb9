"""The options of ``kvmesh ingest trtllm|vllm|sglang``: one frozen, validated settings object per
source.

Each option is declared once, as a field of its source's dataclass: its name, type, default and
help. ``add_flags`` makes the fields the subcommand's flags (``--block-size`` for
``block_size``, in field order; the default is added to the help unless the help already says
it), and ``from_args`` builds the chosen source's settings from what argparse parsed, with the
Redis URL of ``--redis-url``, else ``REDIS_URL`` / ``KVMESH_REDIS_URL``. A bad value raises
``IngestSettingsError`` naming its flag (a bad worker id: ``events.keys``' message, "worker id
..."), when the object is made: ``kvmesh ingest`` prints it on one line and exits with status 2,
before anything connects. (``kvmesh`` itself refuses a malformed Redis URL before that.)

Dataclasses, not pydantic-settings models like the worker's and the router's, because:

* there are no ``KVMESH_`` variables to read. kvmesh's variables are one namespace shared by all
  its commands, and an ingester's options are one engine's identity (its endpoint, URL, worker
  id and block size): ``KVMESH_WORKER_ID`` and ``KVMESH_TOKENS_PER_BLOCK`` already mean the
  worker's and the router's, so an ingester started beside them would silently take their
  values. Only the Redis URL comes from the environment, as for every command;
* the flags keep argparse's own defaults and required flags, so the usage, the help and the
  parsed arguments are what they always were (a settings model's flags default to None, to let
  the variables through), and each check is one comparison whose message names the flag.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar

from app.core.settings import Settings, check_redis_url
from app.ingest.errors import IngestSettingsError
from app.ingest.stream import rank_worker_id
from events.keys import validate_worker_id

__all__ = [
    "SOURCES",
    "IngestSettings",
    "SglangIngestSettings",
    "TrtllmIngestSettings",
    "VllmIngestSettings",
    "add_flags",
    "from_args",
]

NO_REDIS = "give --redis-url or set REDIS_URL"


def _option(default: Any = MISSING, *, about: str) -> Any:
    """A field that is a flag: ``about`` is its help; no default makes the flag required."""
    return field(default=default, metadata={"help": about})


@dataclass(frozen=True, kw_only=True)
class IngestSettings:
    """What every source has: the Redis to publish to (the shared ``--redis-url``, not a flag of
    the source's own)."""

    source: ClassVar[str]  # the engine: the subcommand, and the registry's device and source
    summary: ClassVar[str]  # the subcommand's help

    redis_url: str
    served_model_name: str | None = _option(
        None,
        about="the model the engine serves, as clients name it (its --served-model-name; "
        "default: none, routers send it any model's requests)",
    )

    def __post_init__(self) -> None:
        if self.served_model_name == "":
            raise IngestSettingsError("--served-model-name must not be empty")
        if not self.redis_url:
            raise IngestSettingsError(NO_REDIS)
        try:
            check_redis_url(self.redis_url)
        except ValueError as exc:
            raise IngestSettingsError(f"--redis-url: {exc}") from exc


@dataclass(frozen=True, kw_only=True)
class TrtllmIngestSettings(IngestSettings):
    """``kvmesh ingest trtllm``."""

    source: ClassVar[str] = "trtllm"
    summary: ClassVar[str] = "poll a TensorRT-LLM server's POST /kv_cache_events"

    url: str = _option(about="the server, e.g. http://gpu3:8000")
    worker_id: str = _option(about="worker id to publish the events as")
    tokens_per_block: int | None = _option(
        None, about="the engine's block size, for the registry (default: none registered)"
    )
    poll_interval_s: float = _option(0.05, about="pause after an empty answer")
    max_polls: int | None = _option(None, about="stop after this many polls (default: never)")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_worker_id(self.worker_id)


# Both publishers default to endpoint tcp://*:5557 and topic "" (vLLM's KVEventsConfig, SGLang's
# disaggregation/kv_events.py KVEventsConfig); see docs/operations.md. vLLM's blocks default to
# 16 tokens (--block-size); SGLang's pages to 1 (--page-size: None resolves to 1 unless the
# attention backend needs larger pages -- then give --block-size).


@dataclass(frozen=True, kw_only=True)
class VllmIngestSettings(IngestSettings):
    """``kvmesh ingest vllm`` (and, with its own block size, ``sglang``)."""

    source: ClassVar[str] = "vllm"
    summary: ClassVar[str] = "subscribe to a vLLM server's ZMQ KV events (--kv-events-config)"

    endpoint: str = _option("tcp://localhost:5557", about="its PUB socket, e.g. tcp://gpu3:5557")
    replay_endpoint: str | None = _option(
        None,
        about="its replay ROUTER socket, e.g. tcp://gpu3:5567 (default: none; a gap in the "
        "sequence is then reported as lost)",
    )
    topic: str = _option("", about="the topic it publishes (default: all)")
    worker_id: str = _option(about="worker id to publish as")
    url: str | None = _option(
        None, about="the server, e.g. http://gpu3:8000, for the registry (default: none)"
    )
    block_size: int = _option(16, about="its tokens per block")
    data_parallel_size: int = _option(
        1,
        about="its data-parallel ranks: rank r publishes on the endpoints' ports + r and "
        "becomes worker <worker-id>-dp<r> (default 1: one worker, <worker-id>)",
    )
    window_size: int = _option(
        0,
        about="its attention window in tokens, put on the events (e.g. vLLM's "
        "--max-model-len; default 0: not given; a sliding-window group sends its own)",
    )
    max_batches: int | None = _option(None, about="stop after this many messages (default: never)")

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_worker_id(self.worker_id)
        if self.block_size <= 0:
            raise IngestSettingsError(f"--block-size must be positive, got {self.block_size}")
        if self.data_parallel_size <= 0:
            raise IngestSettingsError(
                f"--data-parallel-size must be positive, got {self.data_parallel_size}"
            )
        if self.data_parallel_size > 1:  # the ranks' ids: <worker-id>-dp<rank>
            _check_worker_id(rank_worker_id(self.worker_id, self.data_parallel_size - 1))
        if self.window_size < 0:
            raise IngestSettingsError(f"--window-size must be >= 0, got {self.window_size}")


@dataclass(frozen=True, kw_only=True)
class SglangIngestSettings(VllmIngestSettings):
    """``kvmesh ingest sglang``: the same protocol as vLLM's, pages of 1 token by default."""

    source: ClassVar[str] = "sglang"
    summary: ClassVar[str] = "subscribe to a SGLang server's ZMQ KV events (--kv-events-config)"

    block_size: int = _option(1, about="its tokens per block")


@dataclass(frozen=True, kw_only=True)
class RegisterSettings(IngestSettings):
    """``kvmesh register``: an OpenAI-compatible server that publishes no KV events, routed by
    what the routers sent it (an approximate prefix tree per worker)."""

    source: ClassVar[str] = "openai"
    summary: ClassVar[str] = (
        "register an OpenAI-compatible server without KV events (routed approximately)"
    )

    url: str = _option(about="the server, e.g. http://gpu3:8000")
    worker_id: str = _option(about="worker id to register it as")
    block_size: int = _option(16, about="its tokens per block (what routers hash prompts in)")
    capacity_blocks: int = _option(
        65_536,
        about="blocks of prompts its cache holds: routers remember at most this many of what "
        "they sent it",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_worker_id(self.worker_id)
        if not self.url.startswith(("http://", "https://")):
            raise IngestSettingsError(f"--url must be an http:// or https:// URL, got {self.url!r}")
        for name in ("block_size", "capacity_blocks"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise IngestSettingsError(f"{flag} must be positive, got {getattr(self, name)}")


SOURCES: dict[str, type[TrtllmIngestSettings] | type[VllmIngestSettings]] = {
    model.source: model
    for model in (TrtllmIngestSettings, VllmIngestSettings, SglangIngestSettings)
}


def _check_worker_id(worker_id: str) -> None:
    try:
        validate_worker_id(worker_id)
    except ValueError as exc:  # its message says "worker id ..."
        raise IngestSettingsError(str(exc)) from exc


def _flags(model: type[IngestSettings]) -> list[Field[Any]]:
    return [f for f in fields(model) if "help" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, model: type[IngestSettings]) -> None:
    """One flag per option of ``model``, in field order (the CLI adds ``--redis-url``): typed as
    the field (an ``int`` or ``float``; else the string as given), required when the field has
    no default, else with it, said in the help unless the help already says it."""
    hints = typing.get_type_hints(model)
    for option in _flags(model):
        about: str = option.metadata["help"]
        spec: dict[str, Any] = {}
        kinds = {hints[option.name], *typing.get_args(hints[option.name])} & {int, float}
        if kinds:
            spec["type"] = int if int in kinds else float
        if option.default is MISSING:
            spec["required"] = True
        else:
            spec["default"] = option.default
            if option.default is not None and "default" not in about:
                about += f" (default: {option.default})"
        parser.add_argument("--" + option.name.replace("_", "-"), help=about, **spec)


def from_args(args: argparse.Namespace) -> TrtllmIngestSettings | VllmIngestSettings:
    """The settings of the source ``args`` chose (``kvmesh ingest SOURCE ...``), from its flags
    and the Redis URL; raises ``IngestSettingsError`` naming the first bad one."""
    model = SOURCES[args.source]
    redis_url = args.redis_url or Settings().redis_url
    if redis_url is None:
        raise IngestSettingsError(NO_REDIS)
    return model(redis_url=redis_url, **option_values(args, model))


def option_values(args: argparse.Namespace, model: type[IngestSettings]) -> dict[str, Any]:
    """The values of ``model``'s flags in ``args``, by field name."""
    given = vars(args)
    return {option.name: given[option.name] for option in _flags(model)}
