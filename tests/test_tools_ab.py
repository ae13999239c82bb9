"""``tools/ab.py``: its summary's arithmetic, exactly, and one small run of each path end to end
as a maintainer runs it (this checkout against itself: a real Redis, two real routers, and a
real worker or the router bench's publishers)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from cache._native import built
from tools.ab import Round, main, summarize

ROOT = Path(__file__).resolve().parents[1]


def test_the_summary_is_the_mean_ratio_with_its_t_interval() -> None:
    rounds = [Round(False, 10, 10, 500.0, 450.0), Round(True, 10, 10, 400.0, 440.0)]
    summary = summarize(rounds)
    assert [r["ratio"] for r in summary["rounds"]] == [0.9, 1.1]
    assert summary["rounds"][1] == {
        "b_first": True,
        "a_requests": 10,
        "b_requests": 10,
        "a_cpu_us": 400.0,
        "b_cpu_us": 440.0,
        "ratio": 1.1,
    }
    assert summary["ratio_mean"] == 1.0
    assert summary["b_lower_in"] == 1
    half = 12.706 * math.sqrt(0.02) / math.sqrt(2)  # one degree of freedom
    assert summary["ratio_interval"] == [round(1 - half, 4), round(1 + half, 4)]
    twelve = summarize(rounds * 6)  # eleven degrees of freedom: t 2.201, not the normal's 1.96
    spread = 2.201 * statistics.stdev([0.9, 1.1] * 6) / math.sqrt(12)
    assert twelve["ratio_interval"] == [round(1 - spread, 4), round(1 + spread, 4)]
    alone = summarize(rounds[:1])
    assert (alone["ratio_mean"], alone["b_lower_in"]) == (0.9, 1)
    assert "ratio_interval" not in alone  # no spread from one round


def test_a_directory_that_is_no_checkout_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path), str(ROOT)])
    assert exited.value.code == 2
    assert f"{tmp_path}: not a kvmesh checkout (no app/__main__.py)" in capsys.readouterr().err


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("path", "extra"), [("completions", []), ("route", ["--events", "1000"])])
def test_this_checkout_against_itself_from_the_command_line(path: str, extra: list[str]) -> None:
    command = [sys.executable, "tools/ab.py", ".", ".", "--path", path, "--rounds", "2"]
    command += ["--requests", "200", "--json", *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4_000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert (report["a"], report["b"], report["path"]) == (str(ROOT), str(ROOT), path)
    assert report["a_compiled"] == report["b_compiled"] == built(ROOT / "cache")
    assert report["requests_per_round"] == 200
    # Request i to one router and i + 1 to the other; B goes first in every other round.
    rounds = report["rounds"]
    assert [(r["b_first"], r["a_requests"], r["b_requests"]) for r in rounds] == [
        (False, 100, 100),
        (True, 100, 100),
    ]
    ratios = [r["b_cpu_us"] / r["a_cpu_us"] for r in rounds]
    assert report["ratio_mean"] == round(statistics.fmean(ratios), 4)
    assert len(report["ratio_interval"]) == 2
    assert done.stderr.count(" B/A ") == 2  # a line a round as it goes
