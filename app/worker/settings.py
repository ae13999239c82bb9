"""The worker's settings: one pydantic-settings model, read from flags and ``KVMESH_`` variables.

Every field is also a ``kvmesh worker`` flag (``--num-gpu-blocks`` for ``num_gpu_blocks``;
``app.cli`` builds the flags from this model), except the admin token, which is read from
``KVMESH_ADMIN_TOKEN`` only, so that it never shows in a process list. A flag wins over the
variable, the variable over the default.

The model shape comes from a preset (``--model tiny`` or ``llama-3-8b``) and any field given on
its own overrides the preset's. The cache size is either a block count per level or a memory
budget per level (GiB), turned into blocks with ``cache.capacity.calculate_max_num_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from app.core.settings import Settings
from cache import capacity

__all__ = ["MODEL_PRESETS", "ModelShape", "WorkerSettings"]

# Bytes per element; torch itself is imported only when the pools are built.
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
GIB = 1 << 30
# The torch back-end runs a real (random-weight) decoder on the worker's CPU or GPU: keep it tiny.
MAX_TORCH_HIDDEN = 1024


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    num_heads: int  # query heads (the torch back-end); the cache only sees KV heads
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_seq_len: int
    tokens_per_block: int
    dtype: str


MODEL_PRESETS: dict[str, ModelShape] = {
    # The torch back-end's test model: 2 layers, GQA 4 query / 2 KV heads, head dim 16.
    "tiny": ModelShape(2, 4, 2, 16, 512, 8_192, 16, "float32"),
    # Meta Llama 3 8B (config.json): 32 layers, 32 query / 8 KV heads of 128, vocab 128,256.
    "llama-3-8b": ModelShape(32, 32, 8, 128, 128_256, 8_192, 32, "bfloat16"),
    # Meta Llama 3 70B: 80 layers, 64 query / 8 KV heads of 128.
    "llama-3-70b": ModelShape(80, 64, 8, 128, 128_256, 8_192, 32, "bfloat16"),
}
DEFAULT_GPU_BLOCKS = {"tiny": 4_096}


class WorkerSettings(Settings):
    """Settings of ``kvmesh worker`` (plus the shared ``redis_url``, ``admin_token``, log level)."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_", extra="ignore", populate_by_name=True)

    worker_id: str = Field(description="unique id of this worker, e.g. w0")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8001, ge=0, le=65_535, description="port to listen on (0: any free port)")
    advertise_url: str | None = Field(
        None, description="URL under which routers reach this worker (default: http://HOST:PORT)"
    )
    engine: Literal["sim", "torch"] = Field("sim", description="model back-end")

    model: Literal["tiny", "llama-3-8b", "llama-3-70b"] = Field(
        "tiny", description="model shape preset; the fields below override it"
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="the model name clients ask for (default: the shape preset's, e.g. tiny)",
    )
    tokenizer: str | None = Field(
        None,
        description="a Hugging Face tokenizer directory (or tokenizer.json): text prompts and "
        "/v1/chat/completions (default: none; token-id prompts only)",
    )
    num_layers: int | None = Field(None, gt=0, description="layers (default: the preset's)")
    num_heads: int | None = Field(None, gt=0, description="query heads (default: the preset's)")
    num_kv_heads: int | None = Field(None, gt=0, description="KV heads (default: the preset's)")
    head_dim: int | None = Field(None, gt=0, description="head dimension (default: the preset's)")
    vocab_size: int | None = Field(None, gt=0, description="vocabulary (default: the preset's)")
    max_seq_len: int | None = Field(
        None, gt=0, description="longest prompt + output, in tokens (default: the preset's)"
    )
    tokens_per_block: int | None = Field(
        None, gt=0, description="tokens per KV cache block (default: the preset's)"
    )
    dtype: Literal["float16", "bfloat16", "float32", "float64"] | None = Field(
        None, description="KV cache dtype (default: the preset's)"
    )
    device: str = Field("cpu", description="torch device of the primary pool, e.g. cuda:0")

    num_gpu_blocks: int | None = Field(
        None,
        gt=0,
        description="primary (GPU) blocks; or give --gpu-memory-gib "
        f"(default: {DEFAULT_GPU_BLOCKS['tiny']} for --model tiny)",
    )
    num_host_blocks: int | None = Field(
        None,
        ge=0,
        description="secondary (host) blocks; or give --host-memory-gib (default: 0)",
    )
    gpu_memory_gib: float | None = Field(
        None, gt=0, description="primary KV cache budget, GiB (default: unset; blocks as above)"
    )
    host_memory_gib: float | None = Field(
        None, ge=0, description="host KV cache budget, GiB (default: unset; blocks as above)"
    )
    allocate_pools: bool = Field(
        True, description="allocate the KV pools (off: block metadata only, for simulations)"
    )
    enable_block_reuse: bool = Field(True, description="reuse cached prefixes")
    enable_partial_reuse: bool = Field(True, description="reuse partially matching blocks")

    max_batch_size: int = Field(64, gt=0, description="most sequences running at once")
    max_tokens_per_step: int = Field(
        8_192, gt=0, description="token budget of one step (prefill chunks + decodes)"
    )
    max_queue_len: int = Field(1_024, ge=0, description="most requests waiting; more get 429")
    scheduler: Literal["guaranteed_no_evict", "max_utilization"] = Field(
        "guaranteed_no_evict",
        description="TensorRT-LLM's capacity policies: reserve every request's blocks to "
        "completion, or admit by next-step needs and preempt the newest when blocks run out",
    )

    sim_step_overhead_ms: float = Field(5.0, ge=0, description="sim: fixed time of a step")
    sim_prefill_us_per_token: float = Field(
        32.0, ge=0, description="sim: time per uncached prompt token"
    )
    sim_decode_us_per_sequence: float = Field(
        80.0, ge=0, description="sim: time per decoding sequence in a step"
    )
    virtual_clock: bool = Field(
        False, description="sim: advance a virtual clock by the model time instead of sleeping"
    )

    drain_timeout_s: float = Field(
        10.0, ge=0, description="on SIGTERM, time given to in-flight requests"
    )
    max_body_bytes: int = Field(8 << 20, gt=0, description="largest request body accepted")
    events_ring_blocks: int = Field(
        4_096, gt=0, description="recent events kept for GET /events, counted in blocks"
    )
    stream_retain_s: float = Field(
        60.0, gt=0, description="seconds of events the stream keeps (XADD MINID ~)"
    )
    stream_maxlen: int = Field(
        100_000, gt=0, description="cap on the stream's entries on top of the retention"
    )
    heartbeat_ttl_s: float = Field(5.0, gt=0, description="heartbeat key lifetime")

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        shape = self.shape
        if self.gpu_memory_gib is not None and self.num_gpu_blocks is not None:
            raise ValueError("gpu_memory_gib: give it or num_gpu_blocks, not both")
        if self.host_memory_gib is not None and self.num_host_blocks is not None:
            raise ValueError("host_memory_gib: give it or num_host_blocks, not both")
        if (
            self.num_gpu_blocks is None
            and self.gpu_memory_gib is None
            and self.model not in DEFAULT_GPU_BLOCKS
        ):
            raise ValueError(f"num_gpu_blocks: give it or gpu_memory_gib for model {self.model}")
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(
                f"num_heads: {shape.num_heads} is not a multiple of num_kv_heads "
                f"{shape.num_kv_heads}"
            )
        if self.engine == "torch":
            hidden = shape.num_heads * shape.head_dim
            if hidden > MAX_TORCH_HIDDEN:
                raise ValueError(
                    f"engine: the torch back-end runs models up to hidden size "
                    f"{MAX_TORCH_HIDDEN}, this shape has {hidden} (use --model tiny)"
                )
            if not self.allocate_pools:
                raise ValueError("allocate_pools: the torch back-end needs the KV pools")
        if self.max_tokens_per_step < shape.tokens_per_block:
            raise ValueError(
                f"max_tokens_per_step: {self.max_tokens_per_step} is less than a block "
                f"({shape.tokens_per_block} tokens); prompt chunks are whole blocks"
            )
        blocks = self.blocks_per_level()
        if blocks[0] <= 0:
            raise ValueError("gpu_memory_gib: the budget holds no block")
        return self

    @field_validator("tokenizer", "served_model_name", mode="before")
    @classmethod
    def _empty_is_unset_too(cls, value: object) -> object:
        return None if value == "" else value

    @model_validator(mode="after")
    def _tokenizer_fits(self) -> WorkerSettings:
        # Loaded here and once more by the runtime: a bad directory, or a vocabulary the
        # model cannot embed, is one line at start, not a traceback from serving.
        if self.tokenizer is not None:
            from app.chat import ModelTokenizer, TokenizerLoadError

            try:
                vocab = ModelTokenizer.load(self.tokenizer).vocab_size
            except TokenizerLoadError as exc:
                raise ValueError(f"tokenizer: {exc}") from None
            if vocab > self.shape.vocab_size:
                raise ValueError(
                    f"tokenizer: {self.tokenizer} has {vocab} tokens, the model's vocabulary "
                    f"is {self.shape.vocab_size} (give --vocab-size or the model's preset)"
                )
        return self

    @property
    def model_name(self) -> str:
        """The name clients ask for (``served_model_name``, else the preset's)."""
        return self.served_model_name or self.model

    @property
    def shape(self) -> ModelShape:
        preset = MODEL_PRESETS[self.model]
        return ModelShape(
            num_layers=self.num_layers or preset.num_layers,
            num_heads=self.num_heads or preset.num_heads,
            num_kv_heads=self.num_kv_heads or preset.num_kv_heads,
            head_dim=self.head_dim or preset.head_dim,
            vocab_size=self.vocab_size or preset.vocab_size,
            max_seq_len=self.max_seq_len or preset.max_seq_len,
            tokens_per_block=self.tokens_per_block or preset.tokens_per_block,
            dtype=self.dtype or preset.dtype,
        )

    @property
    def torch_dtype(self) -> Any:
        import torch

        return getattr(torch, self.shape.dtype)

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"

    def blocks_per_level(self) -> tuple[int, int]:
        """(primary, secondary) blocks: given as counts, or from the memory budgets."""
        shape = self.shape
        budget_blocks = capacity.calculate_max_num_blocks(
            {shape.max_seq_len: list(range(shape.num_layers))},
            [shape.num_kv_heads] * shape.num_layers,
            shape.head_dim,
            shape.tokens_per_block,
            DTYPE_BYTES[shape.dtype],
            int((self.gpu_memory_gib or 0) * GIB),
            int((self.host_memory_gib or 0) * GIB),
        )[shape.max_seq_len]
        if self.num_gpu_blocks is not None:
            primary = self.num_gpu_blocks
        elif self.gpu_memory_gib is not None:
            primary = budget_blocks[0]
        else:
            primary = DEFAULT_GPU_BLOCKS[self.model]
        secondary = self.num_host_blocks if self.num_host_blocks is not None else budget_blocks[1]
        return primary, secondary
