"""A private ``redis-server`` locked down as production should run it, for the security tests:
ACL users (the default user off) and, optionally, TLS with a test CA made by the ``openssl`` CLI.

The ACL rules are the ones docs/reliability.md gives; the tests prove that a worker, a router and
a dashboard work with nothing more, and that each user is refused what it was not given.

``SecureRedis(users={...}, tls=True)`` starts the server on a free loopback port; ``url(user)``
is the ``redis://`` or ``rediss://`` URL a service would be given; ``admin()`` is a synchronous
client with every right (to read ``ACL LOG`` and ``INFO commandstats``).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis

from app.core.embedded_redis import find_redis_server
from app.core.net import free_port

__all__ = [
    "ADMIN_PASSWORD",
    "ROUTER_RULES",
    "SHARED_RULES",
    "WORKER_RULES",
    "SecureRedis",
    "make_test_ca",
]

ADMIN_PASSWORD = "admin-pw-7f3b9c"

_BASE = "resetkeys resetchannels -@all +ping"
# The worker's publisher: its stream, snapshot, registry entry, heartbeat and load hash.
_WORKER_COMMANDS = "+xadd +xrevrange +set +getdel +exists +hset +hdel +pexpire +del"
# The router's (and a dashboard's) consumer and sync loop; SET only asks for a fresh snapshot;
# XADD, XREVRANGE, SET and DEL on the routers' own keys (their shared decisions, heartbeats);
# HGET, HSET, HSETNX and HDEL on the cordons (the fleet admin calls; a cordon written back
# after a Redis restart).
_ROUTER_COMMANDS = (
    "+info +xread +xrange +hgetall +exists +pttl +get +set +xadd +xrevrange +del "
    "+hget +hset +hsetnx +hdel"
)

# One user for every kvmesh process.
SHARED_RULES = f"{_BASE} ~kvmesh:* {_WORKER_COMMANDS} {_ROUTER_COMMANDS}"
# Least privilege: workers write their keys; routers and dashboards read, and write nothing but
# the snapshot-request key, the routers' own keys and the cordons (so a leaked router password
# cannot forge events).
WORKER_RULES = f"{_BASE} ~kvmesh:* {_WORKER_COMMANDS}"
ROUTER_RULES = (
    f"{_BASE} %R~kvmesh:* %W~kvmesh:{{*}}:snapshot:request %W~kvmesh:{{routers}}:* "
    "~kvmesh:cordons "
    f"{_ROUTER_COMMANDS}"
)

_HOST = "127.0.0.1"


def make_test_ca(directory: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1/localhost, made with the ``openssl`` CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("no openssl CLI on PATH")
    paths = {name: directory / f"{name}" for name in ("ca.crt", "ca.key", "server.crt")}
    paths.update({"server.key": directory / "server.key", "server.csr": directory / "server.csr"})
    ext = directory / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=directory)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=kvmesh test CA", "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "san.cnf", "-out", "server.crt")  # fmt: skip
    return paths


class SecureRedis:
    """A redis-server with ACL users (``name -> (password, rules)``) and optionally TLS only."""

    def __init__(self, users: Mapping[str, tuple[str, str]], *, tls: bool = False) -> None:
        self.users = dict(users)
        self.tls = tls
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kvmesh-secure-redis-"))
        self.certs: dict[str, Path] = {}
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def ca_file(self) -> Path:
        return self.certs["ca.crt"]

    def url(self, user: str, password: str | None = None) -> str:
        """The URL a kvmesh process would be given (``password`` overrides the user's)."""
        secret = self.users[user][0] if password is None else password
        auth = f"{quote(user, safe='')}:{quote(secret, safe='')}@"
        if not self.tls:
            return f"redis://{auth}{_HOST}:{self.port}/0"
        query = f"ssl_ca_certs={quote(str(self.ca_file), safe='/')}"
        return f"rediss://{auth}{_HOST}:{self.port}/0?{query}"

    def admin(self) -> redis.Redis:
        if self.tls:
            return redis.Redis(
                host=_HOST,
                port=self.port,
                username="admin",
                password=ADMIN_PASSWORD,
                ssl=True,
                ssl_ca_certs=str(self.ca_file),
            )
        return redis.Redis(host=_HOST, port=self.port, username="admin", password=ADMIN_PASSWORD)

    def start(self) -> SecureRedis:
        acl = [
            "user default off",
            f"user admin on >{ADMIN_PASSWORD} ~* &* +@all",
            *(f"user {name} on >{secret} {rules}" for name, (secret, rules) in self.users.items()),
        ]
        (self.dir / "users.acl").write_text("\n".join(acl) + "\n")
        argv = [
            str(find_redis_server()),
            "--bind", _HOST,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--aclfile", str(self.dir / "users.acl"),
        ]  # fmt: skip
        if self.tls:
            self.certs = make_test_ca(self.dir)
            argv += [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.certs["server.crt"]),
                "--tls-key-file", str(self.certs["server.key"]),
                "--tls-ca-cert-file", str(self.ca_file),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        else:
            argv += ["--port", str(self.port)]
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 (the child holds it)
        with log:
            self._proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 10
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log_tail()}")
            with contextlib.suppress(redis.RedisError, OSError), self.admin() as client:
                if client.ping():
                    return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not come up: {self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"

    def denied(self) -> list[dict[str, object]]:
        """``ACL LOG``: every command, key or auth a user was refused since the start."""
        with self.admin() as client:
            entries: list[dict[str, object]] = client.acl_log()
            return entries

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SecureRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
