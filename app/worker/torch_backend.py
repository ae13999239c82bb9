"""The ``torch`` back-end: a tiny random-weight decoder whose attention is paged through the
KV cache manager's pools.

This module owns:

* ``TinyDecoderConfig`` and ``TinyDecoder``: a seeded, random-weight Llama-shaped decoder
  (RMSNorm, grouped-query attention with RoPE, a SiLU MLP, greedy sampling) in plain torch,
  without autograd. Its layer pieces (``embed``, ``layer_qkv``, ``layer_finish``,
  ``next_token``) are shared by the dense reference and the paged back-end, so the two differ
  only in where attention's keys and values come from.
* ``dense_generate``: the reference, with no paging at all. Each step recomputes the whole
  sequence with full causal attention over its own dense K/V.
* ``TorchBackend``: the ``Backend`` (see ``app.worker.backend``). A step writes the post-RoPE
  K and V of its new positions into the manager's primary pool, in the slots of the sequence's
  blocks, then gathers the keys and values of every position up to the step's last one back
  from the pool through the block table and attends over them. Positions before a chunk (reused
  or computed by an earlier step) are read from the pool only, so the output is right only when
  the manager's blocks hold the right K/V.

Pool layout (``cache.pools``): ``pools[window][0].primary`` is
``[num_blocks, layers_in_pool, 2 (K, V), num_kv_heads * tokens_per_block * head_dim]``, and a
block's slot is laid out ``[num_kv_heads, tokens_per_block, head_dim]``. A block's slot is its
``memory_index``, which offload and onboard change, so it is looked up at every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.worker.backend import StepBatch, StepOutput
from cache.manager import CacheType, KVCacheManager

__all__ = [
    "TinyDecoder",
    "TinyDecoderConfig",
    "TorchBackend",
    "dense_generate",
]


@dataclass(frozen=True, slots=True)
class TinyDecoderConfig:
    num_layers: int = 2
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # grouped-query attention: num_heads / num_kv_heads queries per KV head
    head_dim: int = 16
    vocab_size: int = 512
    mlp_multiple: int = 4  # MLP hidden size = mlp_multiple * hidden
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_multiple * self.hidden


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    wq: torch.Tensor  # [hidden, num_heads * head_dim]
    wk: torch.Tensor  # [hidden, num_kv_heads * head_dim]
    wv: torch.Tensor  # [hidden, num_kv_heads * head_dim]
    wo: torch.Tensor  # [num_heads * head_dim, hidden]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate: torch.Tensor  # [hidden, mlp_hidden]
    w_up: torch.Tensor  # [hidden, mlp_hidden]
    w_down: torch.Tensor  # [mlp_hidden, hidden]


class TinyDecoder:
    """A seeded random-weight decoder. Activations are row-major: ``[tokens, hidden]``.

    Weights are drawn in float32 from ``torch.Generator().manual_seed(config.seed)`` (so a given
    seed gives the same weights whatever the dtype or device) and scaled by 1/sqrt(fan_in).
    """

    def __init__(self, config: TinyDecoderConfig | None = None, device: str = "cpu") -> None:
        self.config = cfg = config or TinyDecoderConfig()
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(cfg.seed)
        hidden, mlp = cfg.hidden, cfg.mlp_hidden
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

        def weight(fan_in: int, fan_out: int) -> torch.Tensor:
            w = torch.randn(fan_in, fan_out, generator=gen) / math.sqrt(fan_in)
            return w.to(device=self.device, dtype=cfg.dtype)

        def norm(size: int) -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(size, generator=gen)
            return w.to(device=self.device, dtype=cfg.dtype)

        self.embedding = torch.randn(cfg.vocab_size, hidden, generator=gen).to(
            device=self.device, dtype=cfg.dtype
        )
        self.layers = [
            _Layer(
                attn_norm=norm(hidden),
                wq=weight(hidden, q_dim),
                wk=weight(hidden, kv_dim),
                wv=weight(hidden, kv_dim),
                wo=weight(q_dim, hidden),
                mlp_norm=norm(hidden),
                w_gate=weight(hidden, mlp),
                w_up=weight(hidden, mlp),
                w_down=weight(mlp, hidden),
            )
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = norm(hidden)
        self.lm_head = weight(hidden, cfg.vocab_size)
        half = cfg.head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim
        self._inv_freq = (1.0 / cfg.rope_theta**exponents).to(self.device)  # float64 [half]

    # -- pieces ----------------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.rms_eps) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of ``x`` [heads, tokens, head_dim] at ``positions`` [tokens]."""
        angles = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]  # [T, half]
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(x.dtype)  # [T, head_dim]
        sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Hidden states [len(tokens), hidden] of ``tokens``."""
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        return self.embedding[ids]

    def layer_qkv(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-RoPE q [num_heads, T, head_dim], k and v [num_kv_heads, T, head_dim]."""
        cfg = self.config
        w = self.layers[layer]
        x = self._rms(hidden, w.attn_norm)
        tokens = hidden.shape[0]
        q = (x @ w.wq).view(tokens, cfg.num_heads, cfg.head_dim).transpose(0, 1)
        k = (x @ w.wk).view(tokens, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        v = (x @ w.wv).view(tokens, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        return self._rope(q, positions), self._rope(k, positions), v.contiguous()

    def layer_finish(
        self,
        layer: int,
        hidden: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of ``q`` (at ``positions``) over ``keys``/``values`` [num_kv_heads, S,
        head_dim] of positions 0..S-1, causal; then the output projection, the MLP and both
        residuals. Returns the layer's output hidden states."""
        cfg = self.config
        w = self.layers[layer]
        group = cfg.num_heads // cfg.num_kv_heads
        k = keys.repeat_interleave(group, dim=0)  # [num_heads, S, head_dim]
        v = values.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(cfg.head_dim)  # [num_heads, T, S]
        key_positions = torch.arange(keys.shape[1], device=keys.device)
        allowed = key_positions[None, :] <= positions[:, None]  # [T, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = torch.softmax(scores, dim=-1) @ v  # [num_heads, T, head_dim]
        tokens = hidden.shape[0]
        hidden = hidden + attn.transpose(0, 1).reshape(tokens, -1) @ w.wo
        x = self._rms(hidden, w.mlp_norm)
        return hidden + (torch.nn.functional.silu(x @ w.w_gate) * (x @ w.w_up)) @ w.w_down

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab_size] of hidden states [T, hidden]."""
        return self._rms(hidden, self.final_norm) @ self.lm_head

    def next_token(self, hidden: torch.Tensor) -> int:
        """Greedy sample from the last row of ``hidden`` (ties go to the lowest id)."""
        return int(torch.argmax(self.logits(hidden[-1:])[0]))

    # -- dense forward ---------------------------------------------------------------------------

    def forward_dense(self, tokens: Sequence[int]) -> torch.Tensor:
        """Final hidden states [len(tokens), hidden] of a whole sequence, no cache."""
        with torch.inference_mode():
            positions = torch.arange(len(tokens), device=self.device)
            hidden = self.embed(tokens)
            for layer in range(self.config.num_layers):
                q, k, v = self.layer_qkv(layer, hidden, positions)
                hidden = self.layer_finish(layer, hidden, q, k, v, positions)
            return hidden


def dense_generate(model: TinyDecoder, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy generation with no paging: every step recomputes the whole sequence with full
    causal attention over its own K/V. Returns the ``max_new_tokens`` generated tokens."""
    if not prompt:
        raise ValueError("prompt is empty")
    tokens = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            token = model.next_token(model.forward_dense(tokens))
            out.append(token)
            tokens.append(token)
    return out


class TorchBackend:
    """``Backend`` running ``TinyDecoder`` with paged attention over the manager's pools.

    The manager must be shaped like the model: same number of layers, KV heads (in every layer)
    and head dim, a single attention window that is not a sliding window, allocated pools, and a
    self-attention cache with K and V (kv_factor 2). The pool's device must be the model's; its
    dtype may differ (K/V are cast on write and read).
    """

    name = "torch"

    def __init__(self, mgr: KVCacheManager, model: TinyDecoder) -> None:
        cfg = model.config
        if mgr.num_layers != cfg.num_layers:
            raise ValueError(
                f"num_layers mismatch: manager has {mgr.num_layers}, model {cfg.num_layers}"
            )
        heads = set(mgr.num_kv_heads_per_layer)
        if heads != {cfg.num_kv_heads}:
            raise ValueError(
                f"num_kv_heads mismatch: manager has {sorted(heads)} per layer, "
                f"model {cfg.num_kv_heads}"
            )
        if mgr.head_dim != cfg.head_dim:
            raise ValueError(f"head_dim mismatch: manager has {mgr.head_dim}, model {cfg.head_dim}")
        if len(mgr.windows) != 1:
            raise ValueError(
                f"windows: the backend needs one window, manager has {list(mgr.windows)}"
            )
        self.window = window = next(iter(mgr.windows))
        self.wm = mgr.windows[window]
        if self.wm.is_swa:
            raise ValueError(
                f"window {window} is a sliding window (max_sequence_length "
                f"{mgr.max_sequence_length}); the backend needs full attention"
            )
        pools = mgr.pools.get(window)
        if not pools:
            raise ValueError("pools: the manager has no allocated pools (allocate_pools=False)")
        if len(pools) != 1:
            raise ValueError(f"pools: the backend needs one pool per window, got {len(pools)}")
        pool = pools[0]
        if pool.kv_factor != 2:
            raise ValueError(f"kv_factor must be 2 (K and V), pool has {pool.kv_factor}")
        if mgr.cache_type is not CacheType.SELF:
            raise ValueError(f"cache_type must be SELF, manager has {mgr.cache_type.name}")
        if pool.num_layers != cfg.num_layers:
            raise ValueError(
                f"num_layers mismatch: pool holds {pool.num_layers}, model {cfg.num_layers}"
            )
        primary = pool.primary
        if primary is None:
            raise ValueError("pools: the primary pool is not allocated")
        if primary.device != model.device:
            raise ValueError(f"device mismatch: pool on {primary.device}, model on {model.device}")
        if not primary.is_contiguous():
            raise ValueError("pools: the primary pool is not contiguous")
        self.mgr = mgr
        self.model = model
        self.vocab_size = cfg.vocab_size
        self.tokens_per_block = mgr.tokens_per_block
        self._pool = primary

    def _kv_views(self) -> torch.Tensor:
        """The primary pool as [num_blocks, layers, 2, num_kv_heads, tokens_per_block, head_dim]
        (a view: writes go to the pool)."""
        cfg = self.model.config
        return self._pool.view(
            self._pool.shape[0],
            cfg.num_layers,
            2,
            cfg.num_kv_heads,
            self.tokens_per_block,
            cfg.head_dim,
        )

    def _slots(self, request_id: int, end: int) -> torch.Tensor:
        """Pool slots of the blocks holding positions 0..end-1 (beam 0)."""
        ids = self.mgr.get_cache_block_ids(request_id, self.window)[0]
        needed = -(-end // self.tokens_per_block)
        if len(ids) < needed:
            raise RuntimeError(
                f"request {request_id}: positions 0..{end - 1} need {needed} blocks, "
                f"the manager allocated {len(ids)}"
            )
        blocks = self.wm.blocks
        for block_id in ids[:needed]:
            if not blocks[block_id].is_primary:
                raise RuntimeError(f"request {request_id}: block {block_id} is not in primary")
        slots = [blocks[block_id].memory_index for block_id in ids[:needed]]
        return torch.tensor(slots, dtype=torch.long, device=self._pool.device)

    def _step(
        self, request_id: int, tokens: Sequence[int], start: int, end: int, sample: bool
    ) -> int | None:
        """Compute the K/V of tokens[start:end] into the pool; with ``sample``, return the token
        sampled after position end - 1."""
        if not 0 <= start < end <= len(tokens):
            raise ValueError(
                f"request {request_id}: bad range [{start}, {end}) of {len(tokens)} tokens"
            )
        model = self.model
        cfg = model.config
        tpb = self.tokens_per_block
        device = self._pool.device
        slots = self._slots(request_id, end)
        positions = torch.arange(start, end, device=device)
        write_slots = slots[positions // tpb]  # [T]
        write_offsets = positions % tpb  # [T]
        pool = self._kv_views()
        hidden = model.embed(tokens[start:end])
        for layer in range(cfg.num_layers):
            q, k, v = model.layer_qkv(layer, hidden, positions)
            cache = pool[:, layer]  # [N, 2, heads, tpb, head_dim]
            # [N, tpb, heads, head_dim] views, indexed by (slot, offset) of each position
            cache_k = cache[:, 0].permute(0, 2, 1, 3)
            cache_v = cache[:, 1].permute(0, 2, 1, 3)
            cache_k[write_slots, write_offsets] = k.transpose(0, 1).to(self._pool.dtype)
            cache_v[write_slots, write_offsets] = v.transpose(0, 1).to(self._pool.dtype)
            # Paged read: gather the sequence's blocks, lay them end to end, cut at `end`.
            blocks = cache[slots]  # [nb, 2, heads, tpb, head_dim]
            kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, cfg.num_kv_heads, -1, cfg.head_dim)
            kv = kv[:, :, :end].to(cfg.dtype)
            hidden = model.layer_finish(layer, hidden, q, kv[0], kv[1], positions)
        return model.next_token(hidden) if sample else None

    def execute(self, batch: StepBatch) -> StepOutput:
        out: dict[int, int] = {}
        with torch.inference_mode():
            for chunk in batch.prefills:
                done = chunk.completes_prompt
                token = self._step(chunk.request_id, chunk.tokens, chunk.start, chunk.end, done)
                if token is not None:
                    out[chunk.request_id] = token
            for decode in batch.decodes:
                n = len(decode.tokens)
                token = self._step(decode.request_id, decode.tokens, n - 1, n, True)
                assert token is not None
                out[decode.request_id] = token
        return StepOutput(tokens=out, model_time_s=0.0)
