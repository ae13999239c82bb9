"""CPU time of a process and all its descendants, from Linux ``/proc``, for the benchmarks.

``kvmesh router --processes N`` is a parent that only holds the socket and N replicas that do
the work (``app.core.replicas``): its CPU is its children's. ``tree_cpu_seconds`` sums user +
system time over the process and every descendant alive when it is read (a child's time is in
its parent's ``cutime`` only once it has exited and been waited for, so the live children are
read one by one), in 10 ms ticks; ``tree_run_seconds`` the same in nanoseconds, for
``tools/ab.py``'s short rounds.
"""

from __future__ import annotations

import os
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
    """``tree_cpu_seconds`` to the nanosecond: the time every live thread of ``pid`` and its
    descendants has run, from ``/proc/PID/task/TID/schedstat`` (a thread that has exited no
    longer counts, so only a difference over a window where none exits is exact). For a window
    too short for ticks: 200 requests at 100 µs are two of them, and may read as none. None
    where the kernel keeps no schedstat or ``pid`` is gone."""
    total_ns = 0
    for process in (pid, *descendants(pid)):
        try:
            tasks = list(Path(f"/proc/{process}/task").iterdir())
        except OSError:
            if process == pid:
                return None
            continue  # a child that exited meanwhile
        for task in tasks:
            try:
                total_ns += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                if process == pid and task.name == str(pid):
                    return None
    return total_ns / 1e9


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
