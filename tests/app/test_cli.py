from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench import BENCHMARKS, load_benchmark
from app.cli import build_parser, main

SUBCOMMANDS = ["demo", "worker", "router", "dashboard", "replay", "bench", "ingest"]


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "kvmesh"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "demo" in result.stdout


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["--no-such-flag", "demo"],
        ["demo", "--no-such-flag"],
        ["bench", "no-such-benchmark"],
        ["router", "--port", "not-a-number"],
    ],
)
def test_bad_usage_prints_usage_and_exits_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: kvmesh" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["router", "dashboard"])
def test_router_and_dashboard_need_a_redis(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("KVMESH_REDIS_URL", raising=False)
    assert main([command]) == 2
    assert capsys.readouterr().err == (
        f"kvmesh {command}: --redis-url (REDIS_URL): it reads the workers' streams; "
        "give the Redis they publish to\n"
    )


def test_bad_router_settings_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--redis-url", "redis://x", "--sglang-balance-rel", "0.5"]) == 2
    assert capsys.readouterr().err == (
        "kvmesh router: --sglang-balance-rel (KVMESH_SGLANG_BALANCE_REL): "
        "Input should be greater than or equal to 1\n"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["worker"], "--worker-id (KVMESH_WORKER_ID): Field required"),
        (
            ["worker", "--worker-id", "w0", "--num-layers", "0"],
            "--num-layers (KVMESH_NUM_LAYERS): Input should be greater than 0",
        ),
        (
            ["worker", "--worker-id", "w0", "--num-gpu-blocks", "8", "--gpu-memory-gib", "1"],
            "--gpu-memory-gib (KVMESH_GPU_MEMORY_GIB): give it or num_gpu_blocks, not both",
        ),
        (
            ["worker", "--worker-id", "w0", "--max-tokens-per-step", "8"],
            "--max-tokens-per-step (KVMESH_MAX_TOKENS_PER_STEP): 8 is less than a block "
            "(16 tokens); prompt chunks are whole blocks",
        ),
        (
            ["worker", "--worker-id", "w0", "--model", "llama-3-8b"],
            "--num-gpu-blocks (KVMESH_NUM_GPU_BLOCKS): give it or gpu_memory_gib for model "
            "llama-3-8b",
        ),
        (
            [
                *("worker", "--worker-id", "w0", "--engine", "torch"),
                *("--model", "llama-3-8b", "--num-gpu-blocks", "8"),
            ],
            "--engine (KVMESH_ENGINE): the torch back-end runs models up to hidden size 1024, "
            "this shape has 4096 (use --model tiny)",
        ),
    ],
)
def test_bad_worker_settings_fail_with_one_line_naming_the_setting(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVMESH_WORKER_ID", raising=False)
    assert main(argv) == 2
    assert capsys.readouterr().err == f"kvmesh worker: {message}\n"


def test_worker_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.cli import _service_settings
    from app.worker.settings import WorkerSettings

    monkeypatch.setenv("KVMESH_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("KVMESH_WORKER_ID", "from-env")
    args = build_parser().parse_args(["worker", "--max-batch-size", "9", "--no-allocate-pools"])
    settings = _service_settings(args, WorkerSettings)
    assert (settings.worker_id, settings.max_batch_size, settings.allocate_pools) == (
        "from-env",
        9,
        False,
    )


def test_every_registered_benchmark_resolves() -> None:
    for name in BENCHMARKS:
        assert callable(load_benchmark(name))


def test_bench_json_is_the_last_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert main(["bench", "redis", "--quick", "--json"]) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last_line)
    assert result["embedded"] is False
    assert result["ping_count"] == 200
    assert result["xadd_count"] == 1_000
    assert result["ping_p50_us"] > 0
    assert result["xadd_per_s"] > 0


def test_bench_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BENCHMARKS, "fixed", "tests.app.test_cli:_fixed_benchmark")
    assert main(["bench", "fixed"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "benchmark: fixed",
        "  ops_per_s       1234.5",
        "  latency_us.p50  7",
    ]


def _fixed_benchmark(args: object) -> dict[str, object]:
    return {"ops_per_s": 1234.5, "latency_us": {"p50": 7}}


def test_demo_refuses_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert main(["demo", "--no-browser", "--port", str(port)]) == 2
    assert capsys.readouterr().err == (
        f"kvmesh demo: port {port} is in use; choose another with --port\n"
    )


def test_parser_is_rebuilt_fresh() -> None:
    # test_compose.py and other callers rely on build_parser() having no shared state.
    assert build_parser() is not build_parser()
