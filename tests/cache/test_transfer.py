"""The torch transfer engine: per-slot ordering (D5), batching, file mode, and the same checks on
CUDA when a GPU is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache import KVCacheManager, LlmRequest, RetentionConfig, TransferMode
from cache.pools import KVCachePool, TorchTransferEngine, allocate
from cache.transfer import Slot
from tests.cache.factories import ids

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
P = [Slot(i, True) for i in range(8)]
S = [Slot(i, False) for i in range(8)]


def engine(device: str) -> tuple[TorchTransferEngine, KVCachePool]:
    pool = KVCachePool(num_layers=2, kv_factor=2, num_kv_heads=2, head_dim=4, tokens_per_block=4)
    allocate([pool], 8, 8, torch.float32, torch.device(device))
    return TorchTransferEngine([pool]), pool


def host(pool: KVCachePool, slot: Slot) -> torch.Tensor:
    return pool.tensor(slot.is_primary)[slot.index].cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_d5_copies_keep_per_slot_order(device: str) -> None:
    eng, pool = engine(device)
    assert pool.primary is not None
    pool.primary[0] = 7.0
    # read after write: offload P0 -> S0, then onboard S0 -> P1 must see the new S0
    eng.copy(P[0], S[0])
    eng.copy(S[0], P[1])
    # write after read: P2 takes S0, then S0 is overwritten from P3 (zeros)
    eng.copy(S[0], P[2])
    eng.copy(P[3], S[0])
    # write after write: S1 from P0, then S1 from P3
    eng.copy(P[0], S[1])
    eng.copy(P[3], S[1])
    eng.sync()
    assert (host(pool, P[1]) == 7).all() and (host(pool, P[2]) == 7).all()
    assert (host(pool, S[0]) == 0).all() and (host(pool, S[1]) == 0).all()
    # offload, onboard and offload again: host and device agree (zeros), as in the C++ test
    eng.copy(P[4], S[4])
    eng.copy(S[4], P[4])
    eng.sync()
    eng.copy(P[4], S[4])
    eng.sync()
    assert torch.equal(host(pool, S[4]), host(pool, P[4]))


@pytest.mark.parametrize("device", DEVICES)
def test_independent_copies_run_as_one_batch(device: str) -> None:
    eng, pool = engine(device)
    assert pool.primary is not None
    for i in range(8):
        pool.primary[i] = float(i)
    pairs = [(P[i], S[7 - i]) for i in range(8)]  # scattered destinations
    for src, dst in pairs:
        eng.copy(src, dst)
    assert eng.num_copies == 0  # queued, nothing issued yet
    eng.flush()
    assert eng.num_copies == 8
    eng.sync()
    for i in range(8):
        assert (host(pool, S[7 - i]) == i).all()


@pytest.mark.parametrize("device", DEVICES)
def test_partial_copy_touches_only_the_first_tokens(device: str) -> None:
    eng, pool = engine(device)
    assert pool.primary is not None
    pool.primary[0] = torch.arange(pool.primary[0].numel(), dtype=torch.float32).view_as(
        pool.primary[0]
    )
    eng.copy(P[0], P[1], num_tokens=3)
    eng.sync()
    shape = (2, 2, 2, 4, 4)  # layers, K/V, heads, tokens, head dim
    src, dst = host(pool, P[0]).view(shape), host(pool, P[1]).view(shape)
    assert torch.equal(dst[:, :, :, :3], src[:, :, :, :3])
    assert (dst[:, :, :, 3:] == 0).all()


def file_manager(device: str) -> KVCacheManager:
    return KVCacheManager(
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        tokens_per_block=4,
        blocks_per_window={64: (4, 4)},
        max_sequence_length=64,
        dtype=torch.float32,
        device=device,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_file_mode_offloads_to_files_and_back(device: str, tmp_path: Path) -> None:
    mgr = file_manager(device)
    wm = mgr.windows[64]
    to_files = RetentionConfig(
        transfer_mode=TransferMode.POSIX_DEBUG_FALLBACK, directory=str(tmp_path)
    )
    a = LlmRequest(0, list(range(9)), retention=to_files)
    mgr.add_sequence(a)
    pool = mgr.pools[64][0]
    assert pool.primary is not None
    for n, block_id in enumerate(ids(mgr, 0)):
        pool.primary[wm.blocks[block_id].memory_index] = float(n + 1)
    mgr.remove_sequence(0, a)
    cached = {b.block_id: b.hash for b in wm.tree_blocks()}
    # a stranger takes every primary block; the cached ones go to files
    mgr.add_sequence(LlmRequest(1, list(range(100, 113)), retention=to_files))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["block_0_pool_0.bin", "block_1_pool_0.bin"]
    assert pool.secondary is not None
    assert (pool.secondary == 0).all()  # host memory was not used
    mgr.remove_sequence(1)
    # a DRAM request reuses them: they come back from the files
    b = LlmRequest(2, list(range(9)))
    assert mgr.add_sequence(b) == 8
    for n, block_id in enumerate(ids(mgr, 2)[:2]):
        assert wm.blocks[block_id].hash == cached[block_id]
        assert (pool.primary[wm.blocks[block_id].memory_index] == float(n + 1)).all()


def test_file_mode_without_a_directory_falls_back_to_dram() -> None:
    mgr = file_manager("cpu")
    config = RetentionConfig(transfer_mode=TransferMode.GDS)
    with pytest.warns(UserWarning, match="without a directory, falling back to DRAM"):
        mgr.add_sequence(LlmRequest(0, list(range(9)), retention=config))
