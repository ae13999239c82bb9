"""Request and response models of the router's HTTP API (what ``/docs`` shows).

``POST /v1/completions`` takes OpenAI's completion request as the worker does (the fields the
router reads are checked here, everything else is passed to the worker as it came), plus
``routing``: a per-request choice of policy and weights. ``POST /route`` takes the prompt and
the cache-key fields alone and answers with the decision and every worker's cost.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.chat import ChatCompletionRequest, ChatMessage
from app.chat.schemas import template_tools
from app.router.settings import PolicyName, weight_field

MAX_U64 = (1 << 64) - 1


class WeightsOverride(BaseModel):
    """Weights of the cost-based policies; a field left out keeps the router's value."""

    model_config = ConfigDict(extra="forbid")

    load: float | None = weight_field(None)
    decode: float | None = weight_field(None)
    host_hit: float | None = weight_field(None)
    temperature: float | None = weight_field(None)
    dynamo_overlap_weight: float | None = weight_field(None)
    sglang_cache_threshold: float | None = Field(None, ge=0, le=1)
    sglang_balance_abs: int | None = Field(None, ge=0)
    sglang_balance_rel: float | None = Field(None, ge=1, allow_inf_nan=False)
    session: float | None = weight_field(None)


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
    """A prompt to place: token ids, text, or a chat (``messages`` and the chat request's
    rendering fields), with its model and session."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the model (optional when one is served)")
    user: str | None = Field(None, description="the session, unless x-session-id gives one")
    prompt_token_ids: list[int] | None = Field(None, description="the prompt as token ids")
    prompt: str | list[int] | None = Field(
        None, description="the prompt as text (the model's tokenizer encodes it) or token ids"
    )
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="a chat, rendered by the model's chat template"
    )
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> RouteBody:
        given = [self.prompt_token_ids, self.prompt, self.messages]
        if sum(value is not None for value in given) != 1:
            raise ValueError("give exactly one of prompt_token_ids, prompt and messages")
        return self

    def render_options(self) -> dict[str, Any]:
        return {
            "tools": template_tools(self.tools),
            "add_generation_prompt": self.add_generation_prompt and not self.continue_final_message,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": self.chat_template_kwargs,
        }


class CompletionBody(PromptFields):
    """OpenAI's completion request; fields not listed go to the worker untouched."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="the model (optional when one is served)")
    user: str | None = Field(None, description="the end user; the session, for routing")
    prompt: str | list[int] = Field(description="token ids, or text (the router tokenizes it)")
    max_tokens: int = Field(16, ge=1)
    stream: bool = False
    request_id: str | None = Field(None, min_length=1, max_length=128)


class ChatBody(ChatCompletionRequest):
    """OpenAI's chat completion request (``app.chat``), plus kvmesh's ``routing``."""

    routing: Routing | None = Field(None, description="kvmesh: policy and weights override")


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "kvmesh"
    workers: int = Field(description="kvmesh: workers up serving it")


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class CostOut(BaseModel):
    worker: str
    cost: float = Field(description="the policy's score: lower wins")
    cached_tokens: int = Field(description="prompt tokens this worker is expected to reuse")
    prefill_tokens: float = Field(description="the request's own prefill work there")
    load: float = Field(description="the load term the policy used")
    fresh: bool = Field(description="whether this worker's index data and load were current")
    affinity: float = Field(0.0, description="kv_aware: what session affinity took off the cost")
    ttft_s: float | None = Field(
        None,
        description="kv_aware: the predicted time to the first token there, in seconds, from "
        "the speed the worker reports (null: it reports none)",
    )


class RouteResponse(BaseModel):
    worker: str
    url: str | None
    model: str | None = Field(description="the model the chosen worker serves")
    policy: str
    expected_cached_tokens: int
    fresh: bool = Field(description="whether the chosen worker's data was current")
    tokenized: bool = Field(description="false: no tokenizer for the model, placed by load only")
    note: str | None = Field(description="why the prompt was not tokenized, if it was not")
    num_tokens: int = Field(description="prompt tokens (estimated from the text if not tokenized)")
    num_blocks: int
    decision_us: float
    costs: list[CostOut]


class ExplainWorker(BaseModel):
    worker: str
    state: str
    model: str | None
    approximate: bool = Field(
        description="no KV events: its match is what this router sent it (predicted_blocks)"
    )
    other_routers: dict[str, int] = Field(
        description="the part of its in-flight load other routers sent (shared decisions)"
    )
    session: bool = Field(description="it served the request's session last")
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
