"""`store_blocks` below the request's last stored block stores as the walk from the root does
(`tests/cache/store_walk.py`: random runs, each with and without the shortcut, on the
sources)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache import _native

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_the_shortcut_stores_as_the_walk_from_the_root() -> None:
    env = {**os.environ, _native.PURE_ENV: "1"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.cache.store_walk", "300"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,  # the module stops itself after 60 s, naming the seed and the stack
    )
    assert out.returncode == 0, out.stderr[-3_000:]
    result = json.loads(out.stdout)
    assert result["differ"] == []
    assert result["broken"] == []  # every block in a tree leads up to its root, both ways
    assert result["taken"] > 1_000  # the shortcut was taken, not only the walk compared
