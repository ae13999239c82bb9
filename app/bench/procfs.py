"""CPU time of a process and all its descendants, from Linux ``/proc``, for the benchmarks.

``kvmesh router --processes N`` is a parent that only holds the socket and N replicas that do
the work (``app.core.replicas``): its CPU is its children's. ``tree_cpu_seconds`` sums user +
system time over the process and every descendant alive when it is read (a child's time is in
its parent's ``cutime`` only once it has exited and been waited for, so the live children are
read one by one), in 10 ms ticks; ``tree_run_seconds`` the same to the nanosecond (each
process's CPU clock), for ``tools/ab.py``'s short rounds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = [
    "busy_us_per_request",
    "descendants",
    "replicas",
    "tree_cpu_seconds",
    "tree_run_seconds",
]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from ``/proc/PID/task/*/children``."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                pending.append(child)
    return found


def tree_cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of ``pid`` and its live descendants; None where ``pid`` is
    None or unreadable."""
    if pid is None:
        return None
    fields = _stat_fields(pid)
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])
    for child in descendants(pid):
        child_fields = _stat_fields(child)
        if child_fields is not None:
            ticks += int(child_fields[11]) + int(child_fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_run_seconds(pid: int) -> float | None:
    """``tree_cpu_seconds`` to the nanosecond, for a window too short for ticks (200 requests at
    100 µs are two of them, and may read as none): each process's CPU clock (Linux's
    ``clock_getcpuclockid``, every thread it has run, the exited ones included) summed over
    ``pid`` and its live descendants. None where ``pid`` is gone or the clock is not Linux's."""
    total = 0.0
    for process in (pid, *descendants(pid)):
        try:
            total += time.clock_gettime(_cpu_clock(process))
        except OSError:
            if process == pid:
                return None
            # a child that exited meanwhile
    return total


def _cpu_clock(pid: int) -> int:
    """The clock id of ``pid``'s CPU time, as glibc's ``clock_getcpuclockid`` makes it (the
    kernel's process clock, CPUCLOCK_SCHED: ``(~pid << 3) | 2``); Python has no binding."""
    return ((~pid) << 3) | 2


def replicas(pid: int | None) -> int:
    """How many processes of ``pid``'s tree serve: its spawned replicas
    (``multiprocessing``'s ``spawn_main``; its resource tracker does not count), else 1."""
    count = 0
    for child in descendants(pid) if pid is not None else []:
        try:
            count += b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
    return count or 1


def busy_us_per_request(
    cpu_s: float | None, seconds: float, requests: int, idle_cpu_s: float | None, idle_s: float
) -> float | None:
    """CPU µs per request of a service that spent ``cpu_s`` on ``requests`` in ``seconds``,
    less its idle rate (``idle_cpu_s`` over ``idle_s`` while it served nothing) for as long:
    what the requests cost it, without its timers and background reads. CPU times come in
    10 ms ticks: the idle rate of an ``idle_s`` window is good to about ±10 ms / ``idle_s``."""
    if cpu_s is None or idle_cpu_s is None or not requests or idle_s <= 0:
        return None
    idle = idle_cpu_s / idle_s * seconds
    return round(max(cpu_s - idle, 0.0) / requests * 1e6, 1)
