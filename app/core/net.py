"""Loopback ports for the processes kvmesh starts itself (the embedded Redis, the demo's and the
benches' workers and routers)."""

from __future__ import annotations

import socket

__all__ = ["LOOPBACK", "free_port", "port_is_free"]

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on now (the OS's choice); another process may still take it
    before the caller does, which the callers' start-up checks report."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could listen on ``port`` now."""
    with socket.socket() as sock:
        # As uvicorn binds: connections left in TIME_WAIT do not hold the port, a listener does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
