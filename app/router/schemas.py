"""Request and response models of the router's HTTP API (what ``/docs`` shows).

``POST /v1/completions`` takes OpenAI's completion request as the worker does (the fields the
router reads are checked here, everything else is passed to the worker as it came), plus
``routing``: a per-request choice of policy and weights. ``POST /route`` takes the prompt and
the cache-key fields alone and answers with the decision and every worker's cost.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.router.settings import PolicyName

MAX_U64 = (1 << 64) - 1


class WeightsOverride(BaseModel):
    """Weights of the cost-based policies; a field left out keeps the router's value."""

    model_config = ConfigDict(extra="forbid")

    load: float | None = Field(None, ge=0, allow_inf_nan=False)
    decode: float | None = Field(None, ge=0, allow_inf_nan=False)
    host_hit: float | None = Field(None, ge=0, allow_inf_nan=False)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    dynamo_overlap_weight: float | None = Field(None, ge=0, allow_inf_nan=False)
    sglang_cache_threshold: float | None = Field(None, ge=0, le=1)
    sglang_balance_abs: int | None = Field(None, ge=0)
    sglang_balance_rel: float | None = Field(None, ge=1, allow_inf_nan=False)


class Routing(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyName | None = Field(None, description="this request's policy")
    weights: WeightsOverride | None = Field(None, description="this request's weights")


class PromptFields(BaseModel):
    """What decides where a prompt's blocks live: its tokens and its cache namespace."""

    lora_task_id: int | None = Field(None, ge=0, le=MAX_U64, description="LoRA task")
    cache_salt: str | None = Field(
        None, min_length=1, max_length=256, description="only equal salts share blocks"
    )
    routing: Routing | None = Field(None, description="kvmesh: policy and weights override")


class RouteBody(PromptFields):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] | None = Field(None, description="the prompt as token ids")
    prompt: str | list[int] | None = Field(
        None, description="the prompt as text (needs the router's tokenizer) or token ids"
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> RouteBody:
        if (self.prompt_token_ids is None) == (self.prompt is None):
            raise ValueError("give exactly one of prompt_token_ids and prompt")
        return self


class CompletionBody(PromptFields):
    """OpenAI's completion request; fields not listed go to the worker untouched."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] = Field(description="token ids, or text (the router tokenizes it)")
    max_tokens: int = Field(16, ge=1)
    stream: bool = False
    request_id: str | None = Field(None, min_length=1, max_length=128)


class CostOut(BaseModel):
    worker: str
    cost: float = Field(description="the policy's score: lower wins")
    cached_tokens: int = Field(description="prompt tokens this worker is expected to reuse")
    prefill_tokens: float = Field(description="the request's own prefill work there")
    load: float = Field(description="the load term the policy used")
    fresh: bool = Field(description="whether this worker's index data and load were current")


class RouteResponse(BaseModel):
    worker: str
    url: str | None
    policy: str
    expected_cached_tokens: int
    fresh: bool = Field(description="whether the chosen worker's data was current")
    num_tokens: int
    num_blocks: int
    decision_us: float
    costs: list[CostOut]


class ExplainWorker(BaseModel):
    worker: str
    state: str
    stale_reason: str | None
    matched_blocks: int = Field(description="leading blocks held, index and predicted")
    index_blocks: int = Field(description="leading blocks the index says it holds, any tier")
    gpu_blocks: int
    host_blocks: int
    predicted_blocks: int = Field(description="blocks beyond the index assumed from decisions")
    queued_prefill_tokens: int
    running: int
    active_blocks: int
    free_blocks: int
    cost: CostOut


class ExplainResponse(RouteResponse):
    workers: list[ExplainWorker]


class PolicyOut(BaseModel):
    policy: str
    weights: dict[str, Any]


class PolicyUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: PolicyName | None = None
    weights: WeightsOverride | None = None
