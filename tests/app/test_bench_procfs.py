from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.procfs import (
    busy_us_per_request,
    descendants,
    replicas,
    tree_cpu_seconds,
    tree_run_seconds,
)

# A parent that spawns two children (as `kvmesh router --processes 2` does), which each burn
# 0.3 s of CPU, 0.15 s of it in a thread that has exited when it is read, and then wait to be
# killed.
SCRIPT = """
import multiprocessing, threading, time

def burn(seconds, clock):
    end = clock() + seconds
    while clock() < end:
        pass

def child():
    thread = threading.Thread(target=burn, args=(0.15, time.thread_time))
    thread.start()
    thread.join()
    burn(0.3 - time.process_time(), time.process_time)
    print("burnt", flush=True)
    time.sleep(60)

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    children = [context.Process(target=child, daemon=True) for _ in range(2)]
    for c in children:
        c.start()
    time.sleep(60)
"""


def _own_cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_parent_with_spawned_replicas(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    children: list[int] = []
    try:
        assert proc.stdout is not None
        assert [proc.stdout.readline() for _ in range(2)] == ["burnt\n", "burnt\n"]
        children = descendants(proc.pid)
        assert replicas(proc.pid) == 2
        # The two replicas, and the resource tracker where multiprocessing started one.
        assert len(children) in (2, 3)
        own = _own_cpu_seconds(proc.pid)
        total = tree_cpu_seconds(proc.pid)
        assert total is not None
        assert total == pytest.approx(own + sum(_own_cpu_seconds(c) for c in children))
        assert total >= own + 0.5  # both children's 0.3 s, in 10 ms ticks
        # To the nanosecond: each child ran its 0.3 s (by its process clock, the same one),
        # its exited thread's included, and its start; the ticks, truncated, agree within two
        # a process.
        run = tree_run_seconds(proc.pid)
        assert run is not None
        assert run > own + 0.6
        assert run == pytest.approx(total, abs=0.02 * (1 + len(children)))
    finally:
        for child in children:  # daemonic children outlive a killed parent
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_no_process() -> None:
    assert tree_cpu_seconds(None) is None
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert tree_run_seconds(gone.pid) is None
    assert replicas(None) == 1


def test_busy_cpu_takes_off_the_idle_rate_for_as_long() -> None:
    # 0.5 s of CPU over 2 s for 1,000 requests; idle, 0.03 s over 3 s (10 ms/s): 0.02 s of it.
    assert busy_us_per_request(0.5, 2.0, 1_000, 0.03, 3.0) == 480.0
    assert busy_us_per_request(0.01, 2.0, 10, 0.03, 3.0) == 0.0  # never below nothing
    assert busy_us_per_request(None, 2.0, 10, 0.03, 3.0) is None  # no /proc
    assert busy_us_per_request(0.5, 2.0, 1_000, None, 3.0) is None
    assert busy_us_per_request(0.5, 2.0, 0, 0.03, 3.0) is None  # no request answered
    assert busy_us_per_request(0.5, 2.0, 1_000, 0.03, 0.0) is None
