"""docker-compose.yml runs real kvmesh subcommands, with flags the CLI accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from app.cli import build_parser

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
SUBCOMMANDS = {"worker", "router", "dashboard", "replay", "ingest", "demo", "bench"}


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return data


def _kvmesh_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = _compose()["services"]
    return {name: spec for name, spec in services.items() if name != "redis"}


def _argv(spec: dict[str, Any]) -> list[str]:
    command = spec["command"]
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def test_redis_has_a_healthcheck() -> None:
    redis = _compose()["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_there_are_two_workers_and_a_router() -> None:
    commands = sorted(_argv(spec)[1] for spec in _kvmesh_services().values())
    assert commands == ["router", "worker", "worker"]


@pytest.mark.parametrize("service", sorted(_kvmesh_services()))
def test_service_runs_a_kvmesh_command_the_cli_accepts(service: str) -> None:
    spec = _kvmesh_services()[service]
    argv = _argv(spec)
    assert argv[0] == "kvmesh"
    assert argv[1] in SUBCOMMANDS
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as exc:  # argparse's way of rejecting a flag
        pytest.fail(f"{service}: kvmesh rejects {argv[1:]} (exit {exc.code})")

    assert spec["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert urlsplit(args.redis_url).hostname == "redis"

    published = {int(str(mapping).split(":")[-1]) for mapping in spec.get("ports", [])}
    assert published == {args.port}
    assert args.host == "0.0.0.0"

    if args.command == "worker":
        advertised = urlsplit(args.advertise_url)
        assert advertised.hostname == service
        assert advertised.port == args.port


def test_worker_ids_and_ports_are_unique() -> None:
    parsed = [build_parser().parse_args(_argv(spec)[1:]) for spec in _kvmesh_services().values()]
    workers = [args for args in parsed if args.command == "worker"]
    assert len({args.worker_id for args in workers}) == len(workers)
    assert len({args.port for args in parsed}) == len(parsed)


def test_required_settings_fail_fast_when_unset() -> None:
    # ${VAR:?message} makes `docker compose up` refuse to start without the secret.
    for service, spec in _kvmesh_services().items():
        token = spec["environment"]["KVMESH_ADMIN_TOKEN"]
        assert re.fullmatch(r"\$\{KVMESH_ADMIN_TOKEN:\?[^}]*\}", token), service
