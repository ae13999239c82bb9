"""Several processes serving one port: a parent that binds the socket and hands it out.

One Python process routes on one core. ``serve_replicas(n, host, port, target)`` binds and
listens once (so a port in use is one error, and port 0 gets one port for all), then starts
``n`` spawned children, each running ``target(socket, index)`` (a server on the shared
listening socket: the kernel gives each new connection to one of the processes accepting on
it). The parent only supervises: on SIGTERM or SIGINT it sends SIGTERM to every child, waits
for them to finish what they have in flight, SIGKILLs any left after ``stop_timeout_s``, and
returns 0. A child that exits on its own stops the others too (1): a replica set with a hole in
it is restarted as a whole by whatever supervises the parent. Each child also gets SIGTERM if
the parent dies without stopping it (Linux ``PR_SET_PDEATHSIG``), so none is left behind.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import signal
import socket
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType

__all__ = ["die_with_parent", "serve_replicas"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def listening_socket(host: str, port: int, backlog: int = 2_048) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def serve_replicas(
    num_processes: int,
    host: str,
    port: int,
    target: Callable[[socket.socket, int], None],
    *,
    stop_timeout_s: float = 15.0,
) -> int:
    """Run ``num_processes`` children of ``target`` on one listening socket until SIGTERM or
    SIGINT (0) or until one of them exits (1); see the module docstring. ``target`` must be
    picklable (a module-level function, or a ``functools.partial`` of one)."""
    sock = listening_socket(host, port)
    stop = threading.Event()

    def on_signal(sig: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    context = multiprocessing.get_context("spawn")
    children: list[BaseProcess] = []
    child: BaseProcess
    try:
        for index in range(num_processes):
            child = context.Process(
                target=target, args=(sock, index), name=f"kvmesh-replica-{index}"
            )
            child.start()
            children.append(child)
        logger.info(
            "%d processes on %s:%d: %s",
            num_processes,
            host,
            sock.getsockname()[1],
            " ".join(str(c.pid) for c in children),
        )
        while not stop.wait(0.2):
            gone = [c for c in children if not c.is_alive()]
            if gone:
                logger.error(
                    "process %d exited with %s: stopping the others", gone[0].pid, gone[0].exitcode
                )
                return 1
        return 0
    finally:
        for child in children:
            if child.is_alive() and child.pid is not None:
                child.terminate()  # SIGTERM: it finishes what is in flight
        for child in children:
            child.join(stop_timeout_s)
            if child.is_alive():
                child.kill()
                child.join()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
