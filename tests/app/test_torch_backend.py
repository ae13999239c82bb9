"""The torch back-end: paged attention through the manager's pools equals a dense reference.

Every test drives the manager as the engine does (``run_request``), so a test passes only when
the blocks the manager hands out (fresh, reused, partially copied, taken over, onboarded) hold
the K/V the back-end expects at every position.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from app.worker.backend import Backend, Decode, PrefillChunk, StepBatch
from app.worker.torch_backend import TinyDecoder, TinyDecoderConfig, TorchBackend, dense_generate
from cache import CacheType, KVCacheManager, LlmRequest
from cache.pools import TorchTransferEngine

TPB = 16  # tokens per block
NEW = 20  # generated tokens per request
WINDOW = 512
CONFIG = TinyDecoderConfig()
MODEL = TinyDecoder(CONFIG)
_DENSE: dict[tuple[tuple[int, ...], int], list[int]] = {}


def dense(prompt: list[int], max_new_tokens: int = NEW) -> list[int]:
    key = (tuple(prompt), max_new_tokens)
    if key not in _DENSE:
        _DENSE[key] = dense_generate(MODEL, prompt, max_new_tokens)
    return _DENSE[key]


def make_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(length)]


def make_manager(primary: int = 64, secondary: int = 0, **kwargs: Any) -> KVCacheManager:
    return KVCacheManager(
        num_layers=kwargs.pop("num_layers", 2),
        num_kv_heads=kwargs.pop("num_kv_heads", 2),
        head_dim=kwargs.pop("head_dim", 16),
        tokens_per_block=TPB,
        blocks_per_window=kwargs.pop("blocks_per_window", {WINDOW: (primary, secondary)}),
        max_sequence_length=512,
        dtype=torch.float32,
        allocate_pools=kwargs.pop("allocate_pools", True),
        **kwargs,
    )


def run_request(
    mgr: KVCacheManager,
    backend: TorchBackend,
    request_id: int,
    prompt: list[int],
    max_new_tokens: int,
    chunk_tokens: int | None = None,
) -> tuple[list[int], int]:
    """One request start to end, as the engine drives the manager; (generated, reused)."""
    req = LlmRequest(request_id, prompt, max_new_tokens=max_new_tokens)
    reused = mgr.add_sequence(req)
    assert reused == req.prepopulated_prompt_len
    step = chunk_tokens or len(prompt)
    tok: int | None = None
    for start in range(req.prepopulated_prompt_len, len(prompt), step):
        end = min(start + step, len(prompt))
        chunk = PrefillChunk(request_id, list(req.tokens), start, end, 0)
        out = backend.execute(StepBatch(prefills=[chunk]))
        if end < len(prompt):
            assert out.tokens == {}
        else:
            tok = out.tokens[request_id]
    assert tok is not None
    mgr.store_context_blocks(req)
    req.add_new_token(tok)
    generated = [tok]
    while len(generated) < max_new_tokens:
        mgr.add_token(request_id)  # blocks for the K/V of the last token
        out = backend.execute(StepBatch(decodes=[Decode(request_id, list(req.tokens), 0)]))
        tok = out.tokens[request_id]
        req.add_new_token(tok)
        mgr.store_new_block(req)
        generated.append(tok)
    mgr.remove_sequence(request_id, req)
    return generated, reused


def tree_ids(mgr: KVCacheManager) -> set[int]:
    return {block.block_id for block in mgr.windows[WINDOW].tree_blocks()}


def test_backend_protocol() -> None:
    backend: Backend = TorchBackend(make_manager(), MODEL)
    assert backend.name == "torch"
    assert backend.vocab_size == CONFIG.vocab_size


def test_dense_generate_is_deterministic_and_prefix_consistent() -> None:
    prompt = make_prompt(0, 37)
    out = dense_generate(TinyDecoder(CONFIG), prompt, 8)
    assert out == dense(prompt)[:8]
    assert len(set(dense(prompt))) > 1  # not a degenerate model that repeats one token


@pytest.mark.parametrize("length", [37, 64, 100])
def test_cold_cache_equals_dense(length: int) -> None:
    mgr = make_manager()
    backend = TorchBackend(mgr, MODEL)
    prompt = make_prompt(length, length)
    assert run_request(mgr, backend, 1, prompt, NEW) == (dense(prompt), 0)


def test_several_cold_requests_on_one_manager() -> None:
    mgr = make_manager()
    backend = TorchBackend(mgr, MODEL)
    for rid, length in enumerate((37, 64, 100)):
        prompt = make_prompt(100 + rid, length)
        assert run_request(mgr, backend, rid, prompt, NEW) == (dense(prompt), 0)


@pytest.mark.parametrize("partial_reuse", [True, False])
@pytest.mark.parametrize("length", [33, 37, 64])
def test_full_reuse_equals_dense(length: int, partial_reuse: bool) -> None:
    mgr = make_manager(enable_partial_reuse=partial_reuse)
    backend = TorchBackend(mgr, MODEL)
    prompt = make_prompt(length, length)
    assert run_request(mgr, backend, 1, prompt, NEW) == (dense(prompt), 0)
    # The last prompt token is never matched. With partial reuse the first run's stored blocks
    # (prompt and generated tokens) cover the other length - 1; without it only full blocks
    # of those length - 1 tokens match.
    expected = length - 1 if partial_reuse else (length - 1) // TPB * TPB
    assert run_request(mgr, backend, 2, prompt, NEW) == (dense(prompt), expected)


@pytest.mark.parametrize("chunk_tokens", [None, 16, 7])
@pytest.mark.parametrize(
    ("first_len", "first_new", "shared", "copies"),
    [
        # the matched block has a child (the first request went on past it): its first
        # `shared % TPB` tokens are copied into a new block
        (70, NEW, 40, 1),
        # the matched block is a free leaf: the second request takes it over, no copy
        (40, 5, 36, 0),
    ],
)
def test_partial_reuse_equals_dense(
    first_len: int, first_new: int, shared: int, copies: int, chunk_tokens: int | None
) -> None:
    assert shared % TPB  # the shared prefix ends mid-block
    mgr = make_manager()
    backend = TorchBackend(mgr, MODEL)
    first = make_prompt(1, first_len)
    assert run_request(mgr, backend, 1, first, first_new) == (dense(first, first_new), 0)
    full_first = first + dense(first, first_new)
    second = [*full_first[:shared], (full_first[shared] + 1) % CONFIG.vocab_size]
    second += make_prompt(2, 60 - len(second))
    engine = mgr.windows[WINDOW].transfer
    assert isinstance(engine, TorchTransferEngine)
    before = engine.num_copies
    assert run_request(mgr, backend, 2, second, NEW, chunk_tokens) == (dense(second), shared)
    assert engine.num_copies - before == copies


@pytest.mark.parametrize("chunk_tokens", [16, 32, 7])
@pytest.mark.parametrize("length", [37, 64, 100])
def test_chunked_prefill_equals_dense(length: int, chunk_tokens: int) -> None:
    mgr = make_manager()
    backend = TorchBackend(mgr, MODEL)
    prompt = make_prompt(length, length)
    assert run_request(mgr, backend, 1, prompt, NEW, chunk_tokens) == (dense(prompt), 0)


def test_requests_batched_in_one_step_equal_dense() -> None:
    mgr = make_manager()
    backend = TorchBackend(mgr, MODEL)
    prompts = {1: make_prompt(11, 37), 2: make_prompt(12, 50), 3: make_prompt(13, 16)}
    reqs = {rid: LlmRequest(rid, p, max_new_tokens=NEW) for rid, p in prompts.items()}
    for r in reqs.values():
        assert mgr.add_sequence(r) == 0
    out = backend.execute(
        StepBatch(prefills=[PrefillChunk(rid, list(p), 0, len(p), 0) for rid, p in prompts.items()])
    )
    for rid, r in reqs.items():
        mgr.store_context_blocks(r)
        r.add_new_token(out.tokens[rid])
    for _ in range(NEW - 1):
        for rid in reqs:
            mgr.add_token(rid)
        batch = StepBatch(decodes=[Decode(rid, list(r.tokens), 0) for rid, r in reqs.items()])
        out = backend.execute(batch)
        for rid, r in reqs.items():
            r.add_new_token(out.tokens[rid])
            mgr.store_new_block(r)
    for rid, r in reqs.items():
        assert r.tokens[len(prompts[rid]) :] == dense(prompts[rid])
        mgr.remove_sequence(rid, r)


def test_offloaded_blocks_are_onboarded_with_their_contents() -> None:
    # 40 tokens + 8 generated hold 3 blocks; 6 primary blocks fit two such requests, so the
    # third evicts the first one's cached blocks to the host tier.
    length, new = 40, 8
    per_request = -(-(length + new - 1) // TPB)
    mgr = make_manager(primary=2 * per_request, secondary=4 * per_request)
    wm = mgr.windows[WINDOW]
    backend = TorchBackend(mgr, MODEL)
    first = make_prompt(21, length)
    assert run_request(mgr, backend, 1, first, new) == (dense(first, new), 0)
    first_blocks = tree_ids(mgr)
    assert len(first_blocks) == per_request
    assert all(wm.blocks[i].is_primary for i in first_blocks)
    for rid in (2, 3):
        other = make_prompt(21 + rid, length)
        assert run_request(mgr, backend, rid, other, new) == (dense(other, new), 0)
    # still cached, every one of them now in the secondary pool
    assert first_blocks <= tree_ids(mgr)
    assert not any(wm.blocks[i].is_primary for i in first_blocks)
    # their old primary slots have been overwritten by the other requests since
    assert run_request(mgr, backend, 4, first, new) == (dense(first, new), length - 1)
    assert all(wm.blocks[i].is_primary for i in first_blocks)


@pytest.mark.parametrize("block_index", [0, 1])
def test_corrupted_pool_changes_the_reused_output(block_index: int) -> None:
    """Zeroing one reused block's slot changes what a reusing request generates, so the
    equality tests above really read the reused K/V from the pool."""
    length = 64
    mgr = make_manager()
    backend = TorchBackend(mgr, MODEL)
    prompt = make_prompt(31, length)
    assert run_request(mgr, backend, 1, prompt, NEW) == (dense(prompt), 0)
    wm = mgr.windows[WINDOW]
    root_children = list(wm.root.next_blocks.values())
    assert len(root_children) == 1
    block = root_children[0]
    for _ in range(block_index):
        (block,) = block.next_blocks.values()
    assert block.is_primary
    mgr.pools[WINDOW][0].primary[block.memory_index].zero_()
    out, reused = run_request(mgr, backend, 2, prompt, NEW)
    assert reused == length - 1
    assert out != dense(prompt)


MISMATCHES: list[tuple[dict[str, Any], str]] = [
    ({"num_layers": 3}, "num_layers"),
    ({"num_kv_heads": 4}, "num_kv_heads"),
    ({"num_kv_heads": [2, 4]}, "num_kv_heads"),
    ({"head_dim": 8}, "head_dim"),
    ({"allocate_pools": False}, "pools"),
    ({"cache_type": CacheType.SELFKONLY}, "kv_factor"),
    ({"cache_type": CacheType.CROSS}, "cache_type"),
    (
        {"max_attention_window": [WINDOW, 256], "blocks_per_window": {WINDOW: (8, 0), 256: (8, 0)}},
        "windows",
    ),
    ({"max_attention_window": [256], "blocks_per_window": {256: (8, 0)}}, "sliding window"),
]


@pytest.mark.parametrize(("kwargs", "field"), MISMATCHES)
def test_manager_shape_mismatch_raises(kwargs: dict[str, Any], field: str) -> None:
    mgr = make_manager(8, **kwargs)
    with pytest.raises(ValueError, match=field):
        TorchBackend(mgr, MODEL)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (TinyDecoderConfig(num_layers=3), "num_layers"),
        (TinyDecoderConfig(num_kv_heads=4), "num_kv_heads"),
        (TinyDecoderConfig(head_dim=32), "head_dim"),
    ],
)
def test_model_shape_mismatch_raises(config: TinyDecoderConfig, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TorchBackend(make_manager(8), TinyDecoder(config))


def test_missing_blocks_raise() -> None:
    mgr = make_manager()
    backend = TorchBackend(mgr, MODEL)
    prompt = make_prompt(41, 16)
    mgr.add_sequence(LlmRequest(1, prompt, max_new_tokens=2))
    tokens = [*prompt, 0]  # position 16 needs a second block, which add_token would allocate
    with pytest.raises(RuntimeError, match="blocks"):
        backend.execute(StepBatch(decodes=[Decode(1, tokens, 0)]))
