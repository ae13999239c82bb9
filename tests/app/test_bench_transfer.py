from __future__ import annotations

import argparse

from app.bench import load_benchmark
from app.bench.transfer import NUM_BLOCKS_QUICK


def test_transfer_benchmark_moves_every_block_and_reports_bandwidth() -> None:
    result = load_benchmark("transfer")(argparse.Namespace(quick=True, json=True))
    assert set(result) == {
        "offload_gbps",
        "onboard_gbps",
        "copy_gbps",
        "ratio",
        "blocks",
        "block_bytes",
        "device",
        "repeats",
    }
    assert result["blocks"] == NUM_BLOCKS_QUICK
    # 32 layers x K,V x 8 heads x 128 dims x 16 tokens x 2 bytes
    assert result["block_bytes"] == 32 * 2 * 8 * 128 * 16 * 2
    assert result["offload_gbps"] > 0 and result["onboard_gbps"] > 0 and result["copy_gbps"] > 0
    slower = min(result["offload_gbps"], result["onboard_gbps"])
    assert abs(result["ratio"] - slower / result["copy_gbps"]) < 0.01
