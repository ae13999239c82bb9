"""Scenarios A2 (pools and offset tables), A6 (window smaller than a block), B2 (partial copy with
real tensors) and a data-integrity test of offload and onboard through eviction."""

from __future__ import annotations

import pytest
import torch

from cache import CacheType, KVCacheManager, LlmRequest
from cache.pools import KV_CACHE_INDEX_SENTINEL
from tests.cache.factories import add_tokens, ids, make_manager, req


def a2_manager(heads: list[int]) -> KVCacheManager:
    return KVCacheManager(
        num_layers=4,
        num_kv_heads=heads,
        head_dim=4,
        tokens_per_block=64,
        blocks_per_window={640: (128, 0)},
        max_sequence_length=640,
        max_beam_width=4,
        enable_block_reuse=False,
        dtype=torch.float16,
    )


@pytest.mark.parametrize(
    "heads", [[2, 2, 2, 2], [3, 2, 1, 2]], ids=["homogeneous", "heterogeneous"]
)
def test_a2_pools_offsets_and_growth(heads: list[int]) -> None:
    mgr = a2_manager(heads)
    pools = mgr.pools[640]
    if heads[0] == 3:
        assert [(p.num_kv_heads, p.num_layers) for p in pools] == [(1, 1), (2, 2), (3, 1)]
        assert [mgr.get_layer_pool(layer) for layer in range(4)] == [(2, 0), (1, 0), (0, 0), (1, 1)]
    else:
        assert [(p.num_kv_heads, p.num_layers) for p in pools] == [(2, 4)]
    for pool in pools:
        assert pool.primary is not None
        assert tuple(pool.primary.shape) == (128, pool.num_layers, 2, pool.num_kv_heads * 4 * 64)
    assert mgr.get_kv_cache_stats().allocated_bytes == sum(
        p.primary.numel() * 2 for p in pools if p.primary is not None
    )
    r = req(0, range(575), beam_width=4)
    mgr.add_sequence(r)
    assert mgr.get_num_free_blocks() == 116
    table = mgr.get_block_offsets(0)
    assert tuple(table.shape) == (len(pools), 4, 2, 10)
    for p, pool in enumerate(pools):
        step = pool.num_layers * 2
        for beam in range(4):
            expected_k = [b * step for b in range(8)] + [(8 + beam) * step]
            assert table[p, beam, 0, :9].tolist() == expected_k
            assert table[p, beam, 1, :9].tolist() == [k + 1 for k in expected_k]
            assert table[p, beam, :, 9].tolist() == [KV_CACHE_INDEX_SENTINEL] * 2
    out = torch.full((len(pools), 8, 2, 10), -1, dtype=torch.int32)
    assert mgr.copy_block_offsets(out, 4, 0) == 9
    assert torch.equal(out[:, 4:8, :, :9], table[:, :, :, :9])
    assert (out[:, :4] == -1).all() and (out[:, 4:8, :, 9] == -1).all()
    add_tokens(mgr, r, [575])
    assert mgr.get_num_free_blocks() == 116
    add_tokens(mgr, r, [576])
    assert mgr.get_num_free_blocks() == 112
    mgr.remove_sequence(0)
    assert mgr.get_num_free_blocks() == 128
    for rid in range(8):
        s = req(rid, range(575), beam_width=4)
        mgr.add_sequence(s)
        add_tokens(mgr, s, [575, 576])
    assert mgr.get_num_free_blocks() == 0


def test_k_only_cache_points_k_and_v_at_the_same_field() -> None:
    mgr = make_manager(
        4,
        max_sequence_length=16,
        num_kv_heads=1,
        head_dim=4,
        allocate_pools=True,
        cache_type=CacheType.SELFKONLY,
    )
    assert mgr.pools[16][0].kv_factor == 1
    mgr.add_sequence(req(0, range(6)))
    table = mgr.get_block_offsets(0)
    assert table[0, 0, 0, :2].tolist() == [0, 2] == table[0, 0, 1, :2].tolist()


def test_cross_attention_allocates_for_encoder_tokens() -> None:
    mgr = make_manager(8, max_sequence_length=32, cache_type=CacheType.CROSS)
    r = LlmRequest(0, [1, 2], encoder_tokens=list(range(9)))
    mgr.add_sequence(r)
    assert len(ids(mgr, 0)) == 3  # ceil(9 / 4) blocks of encoder output
    with pytest.raises(ValueError, match="needs encoder tokens"):
        mgr.add_sequence(LlmRequest(1, [1, 2]))


def test_a6_window_smaller_than_a_block() -> None:
    mgr = make_manager(16, window=3, max_sequence_length=16, enable_block_reuse=False)
    r = req(0, range(2))
    mgr.add_sequence(r)
    seen = [ids(mgr, 0)]
    for token in range(2, 9):
        add_tokens(mgr, r, [token])
        seen.append(ids(mgr, 0))
    # a new block when (tokens - 1) % 4 == 0: at 5 and 9 tokens; the id list keeps block 0
    assert seen == [[0], [0], [0], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1, 2]]
    # block 0 left the window at 7 tokens and went back to the free queue
    assert mgr.get_num_free_blocks() == 14
    mgr.remove_sequence(0)
    assert mgr.get_num_free_blocks() == 16
    assert mgr.verify_queue_integrity()


def fill(mgr: KVCacheManager, slot: int, value: float) -> None:
    for pool in mgr.pools[mgr.max_sequence_length]:
        assert pool.primary is not None
        pool.primary[slot] = value


def test_b2_partial_copy_moves_exactly_the_first_tokens() -> None:
    mgr = KVCacheManager(
        num_layers=12,
        num_kv_heads=6,
        head_dim=128,
        tokens_per_block=8,
        blocks_per_window={64: (4, 4)},
        max_sequence_length=64,
        dtype=torch.float32,
    )
    wm = mgr.windows[64]
    a = req(0, range(17))
    mgr.add_sequence(a)
    assert ids(mgr, 0) == [0, 1, 2]
    pool = mgr.pools[64][0]
    assert pool.primary is not None
    source = torch.arange(pool.primary[0].numel(), dtype=torch.float32).view_as(pool.primary[0])
    pool.primary[wm.blocks[1].memory_index] = source
    mgr.store_context_blocks(a)
    b = req(1, range(12))
    assert mgr.add_sequence(b) == 11
    assert ids(mgr, 1) == [0, 3]
    dst = pool.primary[wm.blocks[3].memory_index].view(12, 2, 6, 8, 128)
    src = source.view(12, 2, 6, 8, 128)
    assert torch.equal(dst[:, :, :, :3], src[:, :, :, :3])
    assert (dst[:, :, :, 3:] == 0).all()


def test_offload_and_onboard_keep_every_byte() -> None:
    """Distinct content per block; eviction pushes it to the host pool and reuse brings it back."""
    mgr = KVCacheManager(
        num_layers=2,
        num_kv_heads=[2, 1],
        head_dim=8,
        tokens_per_block=4,
        blocks_per_window={64: (8, 8)},
        max_sequence_length=64,
        dtype=torch.float32,
    )
    wm = mgr.windows[64]
    pools = mgr.pools[64]

    def content(block_hash: int, pool: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(block_hash % (2**63) + pool)
        primary = pools[pool].primary
        assert primary is not None
        return torch.rand(primary[0].shape, generator=g)

    def write(rid: int) -> None:
        for block_id in ids(mgr, rid):
            block = wm.blocks[block_id]
            for p, pool in enumerate(pools):
                assert pool.primary is not None
                pool.primary[block.memory_index] = content(block.hash, p)

    prompts = [[s, *range(100 * s, 100 * s + 12)] for s in range(3)]  # 13 tokens: 4 blocks
    for rid, prompt in enumerate(prompts):
        r = req(rid, prompt)
        mgr.add_sequence(r)
        write(rid)
        mgr.remove_sequence(rid, r)
    offloaded = [b for b in wm.tree_blocks() if not b.is_primary]
    assert offloaded, "eviction should have pushed cached blocks to the host pool"
    for block in wm.tree_blocks():
        for p, pool in enumerate(pools):
            tensor = pool.tensor(block.is_primary)
            assert torch.equal(tensor[block.memory_index], content(block.hash, p))
    # reuse the first prompt again: its blocks are onboarded with their bytes
    again = req(10, prompts[0])
    assert mgr.add_sequence(again) == 12
    for block_id in ids(mgr, 10)[:3]:
        block = wm.blocks[block_id]
        assert block.is_primary
        for p, pool in enumerate(pools):
            assert pool.primary is not None
            assert torch.equal(pool.primary[block.memory_index], content(block.hash, p))
    assert mgr.verify_queue_integrity()
