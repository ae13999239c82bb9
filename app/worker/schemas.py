"""Request and response models of the worker's HTTP API (they are what ``/docs`` shows).

``CompletionRequest`` follows OpenAI's ``POST /v1/completions`` with token-id prompts (text is
the router's job), plus kvmesh's extensions: ``request_id``, ``priority``, ``lora_task_id``,
``cache_salt`` and ``retention``. Fields OpenAI clients send that a token-level worker has no
use for (``temperature``, ``top_p``, ...) are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_U64 = (1 << 64) - 1
BlockHash = Field(ge=0, le=MAX_U64)


class TokenRange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start: int = Field(ge=0, description="first token of the range")
    end: int | None = Field(None, ge=0, description="one past the last token (null: to the end)")
    priority: int = Field(ge=0, le=100, description="eviction priority, 0 (first) to 100")
    duration_s: float | None = Field(
        None, ge=0, description="seconds the priority lasts after release (null: for ever)"
    )


class Retention(BaseModel):
    """TensorRT-LLM's KvCacheRetentionConfig: priorities (and durations) per token range."""

    model_config = ConfigDict(extra="forbid")

    ranges: list[TokenRange] = Field(default_factory=list, max_length=64)
    decode_priority: int = Field(35, ge=0, le=100)
    decode_duration_s: float | None = Field(None, ge=0)


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="ignored: a worker serves one model")
    prompt: list[int] | str | list[list[int]] | list[str] = Field(
        description="the prompt as token ids (a worker takes ids; text goes to the router)"
    )
    max_tokens: int = Field(16, ge=1, description="tokens to generate")
    stream: bool = Field(False, description="server-sent events, one chunk per engine step")
    priority: int = Field(
        0, ge=-1_000_000, le=1_000_000, description="scheduling priority: lower runs first"
    )
    request_id: str | None = Field(
        None, min_length=1, max_length=128, description="kvmesh: the request's id (default: new)"
    )
    lora_task_id: int | None = Field(None, ge=0, le=MAX_U64, description="kvmesh: LoRA task")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="kvmesh: only requests with the same salt share cached blocks",
    )
    retention: Retention | None = Field(None, description="kvmesh: KV cache retention")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV cache was reused")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str = ""
    token_ids: list[int] = Field(description="kvmesh: the generated token ids")
    logprobs: None = None
    finish_reason: Literal["length", "cancelled", "aborted", "error"] | None


class Timings(BaseModel):
    worker_id: str
    request_id: str
    queue_ms: float | None = Field(description="arrival to admission")
    ttft_ms: float | None = Field(description="arrival to the first token")
    e2e_ms: float | None = Field(description="arrival to the last token")
    preemptions: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kvmesh: Timings


class BlockHashes(BaseModel):
    model_config = ConfigDict(extra="forbid")

    block_hashes: list[int] = Field(min_length=1, max_length=65_536)


class PinResponse(BaseModel):
    block_ids: list[int]


class OffloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_blocks: int | None = Field(None, ge=0, description="at most this many (null: all)")


class CountResponse(BaseModel):
    count: int


class CancelResponse(BaseModel):
    request_id: str
    cancelled: bool


class BlockInfo(BaseModel):
    block_id: int
    hash: int
    parent_hash: int | None
    level: int = Field(description="0 primary (GPU), 1 secondary (host)")
    priority: int
    ref_count: int
    num_tokens: int
    tokens: list[int] | None = None


class BlockPage(BaseModel):
    total: int
    offset: int
    limit: int
    blocks: list[BlockInfo]


class SequenceInfo(BaseModel):
    request_id: str
    state: str
    priority: int
    prompt_tokens: int
    generated_tokens: int
    max_tokens: int
    cached_tokens: int
    position: int
    num_blocks: int
    preemptions: int


class EventPage(BaseModel):
    events: list[dict[str, Any]]
    oldest_event_id: int | None
    latest_event_id: int | None
    truncated: bool = Field(description="events after `since` are no longer in the ring")


class SnapshotResponse(BaseModel):
    event_id: int
    num_blocks: int
    events: list[dict[str, Any]]


class DrainResponse(BaseModel):
    """A worker's drain: whether it admits new requests, and what is still in flight."""

    draining: bool
    shutting_down: bool
    running: int
    waiting: int
    done: bool


class HealthResponse(BaseModel):
    status: str
    worker_id: str
    checks: dict[str, bool] = Field(default_factory=dict)
