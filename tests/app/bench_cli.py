"""Run a benchmark the way a user does: `kvmesh bench NAME --quick --json`, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_quick_bench(name: str, *extra: str, timeout_s: float = 300) -> dict[str, Any]:
    """The JSON object on the last line of a quick run (the run must succeed); ``extra``: the
    bench's own flags."""
    result = subprocess.run(
        [sys.executable, "-m", "app", "bench", name, "--quick", "--json", *extra],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report
