"""``kvmesh demo`` as a real process: the comparison it prints, and a clean exit that leaves no
process or port behind, whether it finishes or is stopped with SIGTERM half way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.demo.runner import DEMO_TRACE, PhaseResult, RequestResult, port_is_free
from app.replay.trace import load_trace
from tests.app.worker_support import free_port

KVMESH = str(Path(sys.executable).parent / "kvmesh")


def _children_alive(marker: str) -> list[str]:
    """Command lines of running processes that mention ``marker``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and "pytest" not in cmdline:
            found.append(cmdline)
    return found


def _demo(port: int, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KVMESH_REDIS_URL")}
    return subprocess.Popen(
        [KVMESH, "demo", "--no-browser", "--port", str(port), "--workers", "2", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _pids(output: str) -> list[int]:
    return [int(pid) for pid in re.findall(r": pid (\d+)", output)]


def test_the_demo_compares_the_policies_and_leaves_nothing_behind() -> None:
    port = free_port()
    proc = _demo(port, "--requests", "200", "--duration", "20")
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert f"dashboard at http://127.0.0.1:{port}/dashboard" in output
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 3]}
    assert sorted(rows) == ["kv_aware", "round_robin"]
    for row in rows.values():
        assert row[-2:] == ["192", "0"]  # requests (the whole built-in workload), failed
    assert float(rows["kv_aware"][1]) > float(rows["round_robin"][1])
    pids = _pids(output)
    assert len(pids) == 1 + 2 * 2  # the router, then two workers per policy
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
    assert port_is_free(port)


def test_sigterm_half_way_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    proc = _demo(port, "--speed", "20")
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    seen = ""
    while "[1/2] kv_aware" not in seen:
        assert time.monotonic() < deadline, seen
        seen += proc.stdout.readline()
    time.sleep(1.0)  # requests in flight
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    seen += proc.stdout.read()
    proc.stdout.close()
    pids = _pids(seen)
    assert len(pids) == 3  # the router and the first two workers
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
    assert port_is_free(port)
    assert _children_alive("--worker-id kv-aware-") == []
    assert _children_alive(f"--port {port}") == []


def test_phase_summary_figures() -> None:
    results = [
        RequestResult(0.0, "a", 100, 0, 0.1, 0.5),
        RequestResult(10.0, "b", 100, 60, 0.3, 0.6),
        RequestResult(70.0, "a", 200, 150, 0.2, 0.4),
        RequestResult(71.0, "b", 50, 0, None, None, error="HTTP 503: no worker is up"),
    ]
    summary = PhaseResult("kv_aware", results).summary(["a", "b"])
    assert summary["hit_ratio"] == 210 / 400
    assert summary["ttft_p50_s"] == 0.2
    assert (summary["requests"], summary["failed"]) == (4, 1)
    # window 0: a 100, b 40 -> 100 / 70; window 1: a 50, b 0 -> 50 / 25; weighted by 140 and 50
    expected = (100 / 70 * 140 + 2.0 * 50) / 190
    assert abs(summary["load_imbalance"] - expected) < 1e-12


def test_the_built_in_workload_is_the_documented_cut() -> None:
    trace = load_trace(DEMO_TRACE)
    assert len(trace) == 192
    conversations: dict[int, int] = {}
    for request in trace:
        conversations[request.hash_ids[1]] = conversations.get(request.hash_ids[1], 0) + 1
        assert request.input_length <= 16_384
    assert sorted(set(conversations.values())) == [4]
    assert len(conversations) == 48
    assert trace[0].timestamp_ms == 0
