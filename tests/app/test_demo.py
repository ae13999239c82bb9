"""``kvmesh demo`` as a real process: the comparison it prints within ``--duration``, a clean
exit that leaves no process, port or log folder behind, and what it leaves when something fails
(the logs, and where they are): a child that exits, or SIGTERM half way."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.core.net import free_port, port_is_free
from app.demo.runner import DEMO_TRACE, PhaseResult, RequestResult, fit_to_time
from app.replay.trace import load_trace

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


def _demo(
    port: int, *extra: str, env: dict[str, str] | None = None, background: bool = False
) -> subprocess.Popen[str]:
    """``kvmesh demo``; ``background``: started as a shell starts a background job, with SIGINT
    ignored."""
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KVMESH_REDIS_URL")},
        **(env or {}),
    }
    return subprocess.Popen(
        [KVMESH, "demo", "--no-browser", "--port", str(port), "--workers", "2", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_ignore_sigint if background else None,
    )


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _pids(output: str) -> list[int]:
    return [int(pid) for pid in re.findall(r": pid (\d+)", output)]


def _log_dir(output: str) -> Path:
    found = re.search(r"\(logs in (\S+), deleted at exit unless something fails\)", output)
    assert found is not None, output
    return Path(found.group(1))


def _table(output: str) -> dict[str, list[str]]:
    """The comparison's rows, by policy: policy, hit ratio, TTFT p50 and p99 (value and unit
    each), imbalance, requests, failed."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 3]}
    assert sorted(rows) == ["kv_aware", "round_robin"], output
    return rows


def test_the_demo_ends_within_its_duration_and_leaves_nothing_behind() -> None:
    """The cut depends on how long the first workers took to start: on a busy machine it may
    leave too few requests to tell the policies apart, which the Ctrl-C test below does."""
    port = free_port()
    started = time.monotonic()
    proc = _demo(port, "--duration", "30")
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, output
    assert f"dashboard at http://127.0.0.1:{port}/dashboard" in output
    # The whole workload takes about a minute: 30 s leave each policy its first few seconds.
    cut = re.search(r"--duration 30: each policy replays the first (\d+) of 192 requests", output)
    assert cut is not None, output
    replayed = cut.group(1)
    for row in _table(output).values():
        assert row[-2:] == [replayed, "0"], output  # requests (the same), failed: say why
    # About 30 s; the whole workload, which --duration used not to cut, took over 60 s here.
    assert elapsed < 30 + 15, output
    pids = _pids(output)
    assert len(pids) == 1 + 2 * 2  # the router, then two workers per policy
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
    assert port_is_free(port)
    assert not _log_dir(output).exists()  # a clean run deletes its logs
    assert "logs kept" not in output


def test_a_worker_that_exits_fails_the_demo_and_keeps_the_logs() -> None:
    port = free_port()
    # Inherited by the children: the worker refuses it (and exits 2); the router ignores it.
    proc = _demo(port, "--workers", "1", "--duration", "0", env={"KVMESH_MAX_QUEUE_LEN": "-1"})
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    log_dir = _log_dir(output)
    try:
        assert proc.returncode == 1, output
        assert f"kvmesh demo: logs kept in {log_dir}\n" in output
        assert "kvmesh demo: kv-aware-0 exited with status 2:\n" in output
        assert sorted(path.name for path in log_dir.iterdir()) == ["kv-aware-0.log", "router.log"]
        assert (log_dir / "kv-aware-0.log").read_text() == (
            "kvmesh worker: --max-queue-len (KVMESH_MAX_QUEUE_LEN): Input should be greater "
            "than or equal to 0\n"
        )
        assert [pid for pid in _pids(output) if Path(f"/proc/{pid}").exists()] == []
        assert port_is_free(port)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def test_sigterm_half_way_stops_everything(tmp_path: Path) -> None:
    """Also when started as a background job (SIGINT ignored), as ``kvmesh demo &`` in a
    script: the demo's way out goes through SIGINT."""
    port = free_port()
    proc = _demo(port, "--speed", "20", background=True)
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
    log_dir = _log_dir(seen)
    try:  # stopped half way: the logs are kept, and the last line says where
        assert seen.splitlines()[-2:] == [
            f"kvmesh demo: logs kept in {log_dir}",
            "kvmesh demo: stopped",
        ]
        assert sorted(path.name for path in log_dir.iterdir()) == [
            "kv-aware-0.log",
            "kv-aware-1.log",
            "router.log",
        ]
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def test_fit_to_time_cuts_the_workload_to_the_time_left() -> None:
    trace = load_trace(DEMO_TRACE)
    # 20 s left, the first workers took 4 s: (20 - 4 - 3) / 2 - 3 = 3.5 s of replay each, at
    # 85x the requests of the first 297.5 s of the trace: 74, the last at 291 s (the next: 300).
    fitted = fit_to_time(trace, speed=85, left_s=20, startup_s=4)
    assert fitted == trace[:74]
    assert (fitted[-1].timestamp_ms, trace[74].timestamp_ms) == (291_000, 300_000)
    # Twice the speed, twice the trace time in the same seconds.
    assert fit_to_time(trace, speed=170, left_s=20, startup_s=4) == trace[:135]
    # Time enough: all of it; none left: the first request still (a run that compares nothing
    # would tell nothing, a run of one request tells that it works).
    assert fit_to_time(trace, speed=85, left_s=1_000, startup_s=4) == trace
    assert fit_to_time(trace, speed=85, left_s=0, startup_s=4) == trace[:1]


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
    # window 0: a 100, b 40: the busiest over max(mean 70, largest request 100) = 1.0;
    # window 1: a 50, b 0: 50 over max(25, 50) = 1.0. Both as even as their requests allow.
    assert summary["load_imbalance"] == 1.0
    two = [
        RequestResult(0.0, "a", 100, 0, 0.1, 0.5),
        RequestResult(1.0, "a", 100, 0, 0.1, 0.5),
        RequestResult(2.0, "b", 100, 0, 0.1, 0.5),
    ]
    # One window: a 200, b 100 -> 200 over max(150, 100).
    assert PhaseResult("kv_aware", two).summary(["a", "b"])["load_imbalance"] == 200 / 150


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
    # What the policy comparison below replays: 29 conversations, 19 of their later turns.
    first = [request.hash_ids[1] for request in trace[:48]]
    assert (len(set(first)), len(first) - len(set(first))) == (29, 19)


def test_the_demo_compares_the_policies_and_ctrl_c_while_serving_is_a_clean_end() -> None:
    """Without --duration the demo serves until Ctrl-C: that is its normal end, not a failure
    (exit 0, the logs deleted); Ctrl-C during the comparison is a stop (the test above).

    The first 48 requests hold later turns of conversations, which kv_aware sends where the
    earlier turns are cached. Replayed at 25x (under 7 s a policy), kv_aware hit 0.358 and
    round robin 0.255 with two CPU-bound processes beside the demo; at the default 85x, beside
    the same two, 60 requests hit 0.342 and 0.341 (TTFT p50 1.4 s, about the median gap
    between two turns of a conversation there)."""
    port = free_port()
    proc = _demo(port, "--requests", "48", "--speed", "25")
    assert proc.stdout is not None
    try:
        deadline = time.monotonic() + 120
        seen = ""
        while "serving at" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            seen += proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=60)
        seen += proc.stdout.read()
    finally:
        proc.kill()
        proc.stdout.close()
    assert status == 0, seen
    rows = _table(seen)
    for row in rows.values():
        assert row[-2:] == ["48", "0"], seen  # requests, failed: say why
    assert float(rows["kv_aware"][1]) > float(rows["round_robin"][1]), seen
    assert seen.splitlines()[-1] == "kvmesh demo: stopped"
    assert not _log_dir(seen).exists()
    assert port_is_free(port)
    assert [pid for pid in _pids(seen) if Path(f"/proc/{pid}").exists()] == []
