"""Scenario C1 (evictionPolicyTest) and C2 (per-block retention), exactly."""

from __future__ import annotations

import pytest

from cache import InvalidRetentionConfigError, RetentionConfig, TokenRangeRetention
from cache.block import KVCacheBlock
from cache.eviction import PRIMARY_LEVEL, SECONDARY_LEVEL, LRUEvictionPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_policy(clock: Clock | None = None) -> tuple[list[KVCacheBlock], LRUEvictionPolicy]:
    blocks = [KVCacheBlock(i, i, True) for i in range(8)] + [
        KVCacheBlock(8 + i, i, False) for i in range(4)
    ]
    return blocks, LRUEvictionPolicy(blocks, clock=clock)


def free_counts(policy: LRUEvictionPolicy) -> tuple[int, int]:
    return policy.get_num_free_blocks(PRIMARY_LEVEL), policy.get_num_free_blocks(SECONDARY_LEVEL)


def test_num_free_blocks() -> None:
    blocks, policy = make_policy()
    assert free_counts(policy) == (8, 4)
    policy.claim_block(blocks[0])
    assert free_counts(policy) == (7, 4)
    policy.claim_block(blocks[8])
    assert free_counts(policy) == (7, 3)


def test_get_free_block_returns_blocks_of_the_level() -> None:
    blocks, policy = make_policy()
    assert policy.get_free_block(PRIMARY_LEVEL)[0] is blocks[0]
    assert policy.get_free_block(SECONDARY_LEVEL)[0] is blocks[8]
    # getting does not claim
    assert free_counts(policy) == (8, 4)


def test_release_to_front_and_back() -> None:
    blocks, policy = make_policy()
    policy.claim_block(blocks[3])
    policy.release_block(blocks[3], to_front=True)
    assert policy.get_free_block(PRIMARY_LEVEL)[0] is blocks[3]
    policy.claim_block(blocks[3])
    policy.release_block(blocks[3])
    assert policy.free_order(PRIMARY_LEVEL) == [0, 1, 2, 4, 5, 6, 7, 3]


def test_lru_order() -> None:
    blocks, policy = make_policy()
    b1, b2 = blocks[1], blocks[2]
    policy.claim_block(b1)
    policy.claim_block(b2)
    policy.release_block(b2)
    policy.release_block(b1)
    for i in (0, 3, 4, 5, 6, 7):
        policy.claim_block(blocks[i])
    assert policy.get_free_block(PRIMARY_LEVEL)[0] is b2
    policy.claim_block(b2)
    assert policy.get_free_block(PRIMARY_LEVEL)[0] is b1


def test_priority_order_and_offload_threshold() -> None:
    blocks, policy = make_policy()
    assert policy.get_free_block(PRIMARY_LEVEL) == (blocks[0], True)
    for block in blocks[:8]:
        policy.claim_block(block)
    policy.claim_block(blocks[0], priority=80)
    policy.release_block(blocks[0])
    policy.claim_block(blocks[1], priority=5)
    policy.release_block(blocks[1])
    # 5 goes before 80, and 5 is under the offload threshold of 30
    assert policy.get_free_block(PRIMARY_LEVEL) == (blocks[1], False)
    policy.claim_block(blocks[1])
    assert policy.get_free_block(PRIMARY_LEVEL) == (blocks[0], True)


def test_timed_retention_expires_back_to_default() -> None:
    clock = Clock()
    blocks, policy = make_policy(clock)
    for block in blocks[:8]:
        policy.claim_block(block)
    b0 = blocks[0]
    policy.claim_block(b0, priority=80, duration_s=0.001)
    policy.release_block(b0)
    policy.refresh()
    assert b0.priority == 80
    clock.now = 0.002
    policy.refresh()
    assert b0.priority == 35
    assert policy.free_order(PRIMARY_LEVEL) == [0]

    policy.claim_block(b0)
    b1, b2 = blocks[1], blocks[2]
    clock.now = 0.005
    policy.claim_block(b1, priority=80, duration_s=0.003)
    policy.claim_block(b2, priority=50, duration_s=0.008)
    policy.release_block(b1)
    policy.release_block(b2)
    assert policy.get_free_block(PRIMARY_LEVEL)[0] is b2
    clock.now = 0.009
    policy.refresh()
    assert (b1.priority, b2.priority) == (35, 50)
    assert policy.get_free_block(PRIMARY_LEVEL)[0] is b1
    assert policy.verify_queue_integrity()


def test_claim_cancels_a_pending_expiry() -> None:
    clock = Clock()
    blocks, policy = make_policy(clock)
    b = blocks[0]
    policy.claim_block(b, priority=90, duration_s=0.001)
    policy.release_block(b)
    policy.claim_block(b, priority=90, duration_s=None)  # reclaimed: the duration is cleared
    clock.now = 1.0
    policy.refresh()
    assert b.priority == 90
    assert b.q_level == -1


def test_verify_queue_integrity_catches_a_referenced_queued_block() -> None:
    blocks, policy = make_policy()
    assert policy.verify_queue_integrity()
    blocks[4].ref_count = 1
    assert not policy.verify_queue_integrity()


R = TokenRangeRetention


@pytest.mark.parametrize(
    ("ranges", "block_size", "seq_len", "expected"),
    [
        ([R(0, 64, 80), R(64, 128, 50)], 64, 256, [80, 50, None, None]),
        ([R(0, 63, 80), R(63, 127, 30)], 32, 127, [80, 80, 30, 30]),
        ([R(0, 1, 80), R(1, 2, 5)], 32, 128, [80, None, None, None]),
        ([R(0, 128, 80)], 256, 192, [80]),
        ([R(0, 65, 80), R(65, 129, 30)], 64, 192, [80, 80, 30]),
        ([R(0, 64, 80), R(129, None, 50)], 64, 256, [80, None, None, 50]),
        ([R(0, 64, 80), R(66, 67, 50)], 64, 256, [80, None, None, None]),
        ([R(127, 193, 80)], 64, 256, [None, None, 80, 80]),
        ([R(127, 193, 80)], 64, 32, [None]),
        ([R(1, None, 80)], 64, 128, [None, 80]),
    ],
)
def test_c2_per_block_priorities(
    ranges: list[TokenRangeRetention], block_size: int, seq_len: int, expected: list[int | None]
) -> None:
    config = RetentionConfig(ranges=ranges)
    assert [p for p, _ in config.per_block_retention(block_size, seq_len)] == expected


def test_c2_durations_follow_the_range() -> None:
    config = RetentionConfig(ranges=[R(0, 64, 80, duration_s=2.5), R(64, None, 20)])
    assert config.per_block_retention(64, 192) == [(80, 2.5), (20, None), (20, None)]


def test_c2_invalid_configs() -> None:
    with pytest.raises(InvalidRetentionConfigError, match="open-ended token range"):
        RetentionConfig(ranges=[R(0, None, 80), R(64, 128, 50)])
    with pytest.raises(InvalidRetentionConfigError, match="before its start"):
        R(64, 10, 80)
    with pytest.raises(InvalidRetentionConfigError, match="overlap"):
        RetentionConfig(ranges=[R(0, 65, 80), R(64, 128, 50)])
    with pytest.raises(InvalidRetentionConfigError, match=r"outside 0\.\.100"):
        R(0, 10, 101)
    with pytest.raises(InvalidRetentionConfigError, match=r"outside 0\.\.100"):
        RetentionConfig(decode_priority=-1)
    # ranges are sorted before they are checked
    config = RetentionConfig(ranges=[R(64, 128, 50), R(0, 64, 80)])
    assert [p for p, _ in config.per_block_retention(64, 128)] == [80, 50]
