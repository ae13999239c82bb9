"""Scenarios H1-H3 (closed forms), capacity batch size, window shares and memory budgets."""

from __future__ import annotations

import pytest

from cache import KVCacheManager
from cache.capacity import WINDOW_SIZE_SHARES_ENV, calculate_free_mem_bytes


@pytest.mark.parametrize(
    ("seq", "sink", "window", "tpb", "blocks"),
    [
        (512, 0, 1024, 64, 8),
        (513, 0, 1024, 64, 9),
        (512, 0, 256, 64, 5),
        (512, 0, 257, 64, 6),
        (512, 64, 1024, 64, 8),
        (513, 64, 1024, 64, 9),
        (512, 64, 256, 64, 5),
        (512, 64, 257, 64, 6),
        (512, 65, 1024, 64, 9),
        (513, 65, 1024, 64, 9),
        (512, 65, 256, 64, 6),
        (512, 65, 257, 64, 6),
    ],
)
def test_h1_max_block_requirements_per_beam(
    seq: int, sink: int, window: int, tpb: int, blocks: int
) -> None:
    assert (
        KVCacheManager.calculate_max_block_requirements_per_beam(seq, sink, window, tpb) == blocks
    )


def test_h2_max_block_requirements() -> None:
    f = KVCacheManager.calculate_max_block_requirements
    assert f(257, 255, 0, 2048, 1, 64) == 8
    assert f(257, 255, 0, 128, 4, 64) == 12
    assert f(257, 255, 0, 412, 4, 64) == 26


def test_h3_max_attention_window() -> None:
    f = KVCacheManager.calculate_max_attention_window
    assert f(1024, 255, 0, 12, 4, 64) == 192
    assert f(1024, 1024, 0, 256, 4, 64) == 2048


def test_max_capacity_batch_size_takes_the_tightest_window() -> None:
    mgr = KVCacheManager(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        tokens_per_block=64,
        blocks_per_window={128: (40, 0), 1024: (100, 0)},
        max_attention_window=[128, 1024],
        max_sequence_length=1024,
        allocate_pools=False,
    )
    # window 128: 2 + 1 blocks for 256 tokens -> 13; window 1024: 4 blocks -> 25
    assert mgr.get_max_capacity_batch_size(200, 56) == 13


def test_window_size_to_share() -> None:
    share = KVCacheManager.calculate_window_size_to_share
    assert share({4096: [0, 1]}, {4096: 8}) == {4096: 1.0}
    got = share({1024: [0], 4096: [1, 2]}, {1024: 10, 4096: 10})
    assert got == pytest.approx({1024: 0.2, 4096: 0.8})


def test_max_num_blocks_from_a_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    f = KVCacheManager.calculate_max_num_blocks
    layers = {4096: [0, 1, 2, 3]}
    # 4 layers x 8 heads x 128 dims x K,V x 2 bytes = 16 KiB per token, 16 tokens per block
    per_block = 4 * 8 * 128 * 2 * 2 * 16
    assert f(layers, [8] * 4, 128, 16, 2, 100 * per_block, 10 * per_block) == {4096: (100, 10)}
    assert f(layers, [8] * 4, 128, 16, 2, 100 * per_block, max_tokens=160) == {4096: (10, 0)}
    two = {512: [0, 1], 4096: [2, 3]}
    assert f(two, [8] * 4, 128, 16, 2, 100 * per_block) == {512: (100, 0), 4096: (100, 0)}
    monkeypatch.setenv(WINDOW_SIZE_SHARES_ENV, "0.25,0.75")
    assert f(two, [8] * 4, 128, 16, 2, 100 * per_block) == {512: (50, 0), 4096: (150, 0)}
    monkeypatch.setenv(WINDOW_SIZE_SHARES_ENV, "0.5")
    with pytest.raises(ValueError, match="1 shares for 2 window sizes"):
        f(two, [8] * 4, 128, 16, 2, 100 * per_block)
    monkeypatch.setenv(WINDOW_SIZE_SHARES_ENV, "2,1")
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        f(two, [8] * 4, 128, 16, 2, 100 * per_block)


def test_free_memory_budget() -> None:
    assert calculate_free_mem_bytes(1000, 50) == (900, 50)
    assert calculate_free_mem_bytes(1000, 0, 0.5) == (500, 0)
    with pytest.raises(ValueError, match="free_gpu_memory_fraction"):
        calculate_free_mem_bytes(1000, 0, 1.0)
