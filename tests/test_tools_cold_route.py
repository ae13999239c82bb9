"""``tools/cold_route.py``: its line's arithmetic, exactly, and one small run of each mode as a
maintainer runs it (the router bench's workload, generated and indexed for real)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tools.cold_route import _line

ROOT = Path(__file__).resolve().parents[1]
STAGE_LINE = re.compile(
    r"(hot|l2|cold) +scan ([\d.]+), hash ([\d.]+), tolist ([\d.]+), match ([\d.]+), "
    r"decide ([\d.]+), answer ([\d.]+); in all ([\d.]+)"
)


def test_a_line_is_each_stages_median_and_the_sum_without_the_match() -> None:
    samples = [[1_000, 9_000, 2_000], [2_500], [300], [4_000], [5_000, 6_000], [700]]
    # Medians in µs: 2.0, 2.5, 0.3, 4.0, 5.5, 0.7; the match is in decide's, counted once.
    assert _line("cold", samples) == (
        "cold  scan 2.0, hash 2.5, tolist 0.3, match 4.0, decide 5.5, answer 0.7; in all 11.0"
    )


def _run(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "tools/cold_route.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.splitlines()


def test_a_small_run_times_every_stage_in_every_mode() -> None:
    lines = _run("--requests", "20", "--rounds", "1")
    found = [STAGE_LINE.fullmatch(line) for line in lines]
    assert all(found), lines
    assert [m.group(1) for m in found if m] == ["hot", "l2", "cold"]
    totals = []
    for m in found:
        assert m is not None
        stages = [float(m.group(k)) for k in range(2, 8)]
        assert min(stages) > 0
        assert abs(float(m.group(8)) - (sum(stages) - stages[3])) <= 0.35  # six roundings
        totals.append(float(m.group(8)))
    assert totals[2] > totals[0]  # the flush works: cold is about twice hot


def test_calls_times_each_kind_in_every_mode() -> None:
    lines = _run("--calls", "--rounds", "1")
    names = [line[:20].rstrip() for line in lines]
    assert names == [
        "empty lambda",
        "Python function",
        "numba, 1 argument",
        "numba, 7 arguments",
        "ndarray.sum",
    ]
    for line in lines:
        assert re.fullmatch(r".{20} hot [\d.]+, l2 [\d.]+, cold [\d.]+", line), line
