"""The router's settings: one pydantic-settings model, read from flags and ``KVMESH_`` variables.

Every field is also a ``kvmesh router`` flag (``--load-weight`` for ``load_weight``; ``app.cli``
builds the flags from this model), except the admin token (``KVMESH_ADMIN_TOKEN`` only, so that
it never shows in a process list). A flag wins over the variable, the variable over the default.
A ``--tokenizer`` or ``--model NAME=DIR`` that is missing or does not load is refused here,
before anything starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from app.chat import ModelTokenizer, TokenizerLoadError
from app.cluster.view import check_read_interval
from app.core.settings import Settings
from app.router.policies import Weights
from app.router.policies.base import MAX_WEIGHT

__all__ = ["PolicyName", "RouterSettings", "weight_field"]

PolicyName = Literal["kv_aware", "round_robin", "random", "least_loaded", "dynamo", "sglang"]


def weight_field(default: float | None, description: str | None = None) -> Any:
    """A policy weight's field, as ``Weights`` bounds it (a larger weight overflows the costs)."""
    return Field(default, ge=0, le=MAX_WEIGHT, allow_inf_nan=False, description=description)


class RouterSettings(Settings):
    """Settings of ``kvmesh router`` (plus the shared ``redis_url``, ``admin_token``, log level)."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_", extra="ignore", populate_by_name=True)

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65_535, description="port to listen on")
    policy: PolicyName = Field("kv_aware", description="routing policy")
    load_weight: float = weight_field(0.1, "kv_aware: weight of the queued prefill")
    decode_weight: float = weight_field(
        8.0, "kv_aware: prefill tokens one running sequence is worth"
    )
    host_hit_weight: float = weight_field(
        0.25, "kv_aware: cost of a host-tier token as a fraction of recomputing"
    )
    temperature: float = weight_field(0.0, "0: lowest cost wins; > 0: softmax sampling")
    dynamo_overlap_weight: float = weight_field(1.0, "dynamo: overlap_score_weight")
    sglang_cache_threshold: float = Field(0.3, ge=0, le=1, description="sglang: cache_threshold")
    sglang_balance_abs: int = Field(64, ge=0, description="sglang: balance_abs_threshold")
    sglang_balance_rel: float = Field(
        1.5, ge=1, allow_inf_nan=False, description="sglang: balance_rel_threshold"
    )
    seed: int = Field(0, ge=0, description="seed of random choices and tie-breaks")
    predict_ttl_s: float = Field(
        2.0,
        ge=0,
        description="seconds a decision's blocks count as cached before their events, at least "
        "(at most twice: they age in two generations)",
    )
    approx_ttl_s: float = Field(
        600.0,
        ge=0,
        description="seconds a worker without KV events (kvmesh register) is assumed to hold "
        "what this router sent it (Dynamo's 120 s loses half the reuse of conversations whose "
        "turns come minutes apart; the capacity bounds it too)",
    )
    share_decisions: bool = Field(
        True,
        description="share this router's in-flight requests with the other routers over Redis, "
        "and count theirs (replicas choose as one)",
    )
    router_id: str | None = Field(
        None, min_length=1, description="this router's id among replicas (default: HOST-PID)"
    )
    processes: int = Field(
        1,
        ge=1,
        le=256,
        description="router processes serving the port, each a replica with its own router id "
        "(ROUTER_ID-i when --router-id is given), sharing decisions through Redis",
    )
    tokens_per_block: int | None = Field(
        None, ge=1, description="block size to hash prompts with (default: the workers')"
    )
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="NAME=DIR: model NAME's Hugging Face tokenizer directory, for its text and "
        "chat prompts; repeat for each model (KVMESH_MODELS: a comma list)",
        json_schema_extra={"metavar": "NAME=DIR"},
    )
    tokenizer: str | None = Field(
        None,
        description="a tokenizer directory or tokenizer.json for the models --model does not "
        "name (default: none; token ids need none, other prompts are routed by load only)",
    )
    session_weight: float = weight_field(
        0.1,
        "kv_aware: a session's last worker is preferred by this fraction of the prompt's "
        "prefill (x-session-id or user; 0: off)",
    )
    load_interval_s: float = Field(0.1, gt=0, description="how often to read the workers' load")
    sync_interval_s: float = Field(0.05, gt=0, description="how often to take the consumer's view")
    max_lag_ms: float = Field(
        2_000.0, gt=0, description="index older than this (stream entries unread) is stale"
    )
    step_budget_ms: float = Field(
        10.0, gt=0, description="longest the consumer holds the event loop at a time"
    )
    event_read_interval_ms: float = Field(
        0.0,
        ge=0,
        description="read the workers' event streams at most this often (what they flush "
        "meanwhile comes in one read: fewer reads, an index up to this much later; 0: at once)",
    )
    proxy_timeout_s: float = Field(600.0, gt=0, description="limit on one proxied request")
    connect_timeout_s: float = Field(2.0, gt=0, description="limit on connecting to a worker")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 503 when no worker is up")
    max_body_bytes: int = Field(8 << 20, ge=1_024, description="largest request body accepted")
    max_prompt_tokens: int = Field(1 << 20, ge=1, description="longest prompt accepted")

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _empty_tokenizer_is_unset(cls, value: object) -> object:
        return None if value == "" else value  # KVMESH_TOKENIZER= (as for REDIS_URL=)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, value: str | None) -> str | None:
        # Loaded once here and once more by the router at start: the settings stay plain
        # data, and a bad path is one line at start, not a traceback from serving.
        if value is not None:
            _load(value)
        return value

    @field_validator("router_id")
    @classmethod
    def _router_id_is_a_key_part(cls, value: str | None) -> str | None:
        if value is not None:
            from events.keys import validate_worker_id

            validate_worker_id(value)  # its ValueError says what is wrong ("worker id ...")
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        if isinstance(value, str):  # KVMESH_MODELS=a=/dir/a,b=/dir/b
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("models")
    @classmethod
    def _models_load(cls, value: list[str]) -> list[str]:
        names: set[str] = set()
        for item in value:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"{item!r}: expected NAME=DIR")
            if name in names:
                raise ValueError(f"{name}: named twice")
            names.add(name)
            _load(path)
        return value

    def model_paths(self) -> dict[str, str]:
        """Model name -> its tokenizer's path (``--model``)."""
        return dict(item.partition("=")[::2] for item in self.models)

    @model_validator(mode="after")
    def _cross_field_checks(self) -> RouterSettings:
        self.weights()  # raises ValueError naming the bad field
        check_read_interval(self.event_read_interval_ms / 1000, self.max_lag_ms)
        return self

    def weights(self) -> Weights:
        return Weights(
            load=self.load_weight,
            decode=self.decode_weight,
            host_hit=self.host_hit_weight,
            temperature=self.temperature,
            dynamo_overlap_weight=self.dynamo_overlap_weight,
            sglang_cache_threshold=self.sglang_cache_threshold,
            sglang_balance_abs=self.sglang_balance_abs,
            sglang_balance_rel=self.sglang_balance_rel,
            session=self.session_weight,
        )


def _load(path: str) -> None:
    try:
        ModelTokenizer.load(path)
    except TokenizerLoadError as exc:
        raise ValueError(str(exc)) from None
