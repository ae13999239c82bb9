from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.bench import BENCHMARK_HELP, BENCHMARKS, load_benchmark
from app.cli import build_parser, main, parse_args

SUBCOMMANDS = [
    "demo",
    "worker",
    "router",
    "dashboard",
    "replay",
    "bench",
    "wait-ready",
    "ingest",
    "register",
]


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
        f"kvmesh {command}: --redis-url (KVMESH_REDIS_URL / REDIS_URL): it reads the workers' "
        "streams; give the Redis they publish to\n"
    )


def test_bad_router_settings_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--redis-url", "redis://x", "--sglang-balance-rel", "0.5"]) == 2
    assert capsys.readouterr().err == (
        "kvmesh router: --sglang-balance-rel (KVMESH_SGLANG_BALANCE_REL): "
        "Input should be greater than or equal to 1\n"
    )


@pytest.mark.parametrize("command", ["router", "dashboard"])
def test_reading_the_streams_too_seldom_is_refused(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command, "--redis-url", "redis://x", "--event-read-interval-ms", "600"]
    assert main([*argv, "--max-lag-ms", "1000"]) == 2
    assert capsys.readouterr().err == (
        f"kvmesh {command}: --event-read-interval-ms (KVMESH_EVENT_READ_INTERVAL_MS): 600 is "
        "more than half of max_lag_ms (1000); entries unread that long make a worker look stale\n"
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


# -- a bad setting: one line naming it, exit status 2, before anything starts -------------------

SCHEME_ERROR = (
    "expected a URL starting with redis://, rediss://, unix://, redis+cluster:// or "
    "rediss+cluster://; this one has no scheme"
)
REDIS_URL_SETTING = "--redis-url (KVMESH_REDIS_URL / REDIS_URL)"


def _started(*args: object, **kwargs: object) -> None:
    raise AssertionError("the command started despite a bad setting")


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """What each command would start, replaced: a check that let a bad setting through fails
    the test instead of starting a service."""
    import app.bench.redis_rtt
    import app.core.serving
    import app.demo.runner
    import app.ingest.trtllm
    import app.ingest.vllm
    import app.worker.app

    monkeypatch.setattr(app.worker.app, "serve", _started)
    monkeypatch.setattr(app.core.serving, "serve", _started)
    monkeypatch.setattr(app.demo.runner, "run_demo", _started)
    monkeypatch.setattr(app.ingest.trtllm, "run_trtllm_ingest", _started)
    monkeypatch.setattr(app.ingest.vllm, "run_vllm_ingest", _started)
    monkeypatch.setattr(app.bench.redis_rtt, "run", _started)


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--worker-id", "w0", "--redis-url", "notaurl"],
        ["router", "--redis-url", "notaurl"],
        ["dashboard", "--redis-url", "notaurl"],
        ["demo", "--no-browser", "--redis-url", "notaurl"],
        ["ingest", "trtllm", "--url", "http://x", "--worker-id", "w0", "--redis-url", "notaurl"],
        ["ingest", "vllm", "--worker-id", "w0", "--redis-url", "notaurl"],
        ["ingest", "sglang", "--worker-id", "w0", "--redis-url", "notaurl"],
    ],
)
def test_a_bad_redis_url_flag_is_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err == f"kvmesh {argv[0]}: {REDIS_URL_SETTING}: {SCHEME_ERROR}\n"


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(
    ("variable", "url", "argv", "message"),
    [
        (
            "REDIS_URL",
            "http://user:s3cret@host:6379/0",
            ["router"],
            "kvmesh router: --redis-url (KVMESH_REDIS_URL / REDIS_URL): expected a URL starting "
            "with redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://; this one "
            "starts with http://",
        ),
        (
            "KVMESH_REDIS_URL",
            "redis://host:abc/0",
            ["bench", "redis", "--quick"],
            "kvmesh bench: --redis-url (KVMESH_REDIS_URL / REDIS_URL): Port could not be cast "
            "to integer value as 'abc'",
        ),
        (
            "REDIS_URL",
            "rediss+cluster://host:99999",
            ["worker", "--worker-id", "w0"],
            "kvmesh worker: --redis-url (KVMESH_REDIS_URL / REDIS_URL): Port out of range 0-65535",
        ),
    ],
)
def test_a_bad_redis_url_variable_is_one_line_and_exit_2(
    variable: str,
    url: str,
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("KVMESH_REDIS_URL", raising=False)
    monkeypatch.setenv(variable, url)
    assert main(argv) == 2
    assert capsys.readouterr().err == f"{message}\n"


def test_replay_does_not_read_the_redis_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It runs its cluster in process: a REDIS_URL meant for the services is no concern of it.
    monkeypatch.setenv("REDIS_URL", "notaurl")
    assert main(["replay", "--trace", "/nonexistent/trace.jsonl"]) == 2
    assert capsys.readouterr().err == (
        "kvmesh replay: error: /nonexistent/trace.jsonl: cannot read the trace "
        "(No such file or directory)\n"
    )


def _garbage(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer.json"
    path.write_text("garbage\n")
    return path


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(
    ("make_path", "problem"),
    [
        (lambda tmp: tmp / "nonexistent" / "tokenizer.json", "no such file or directory"),
        (
            lambda tmp: tmp,
            "a tokenizer directory needs a tokenizer.json (the fast tokenizer the engines load)",
        ),
        (
            _garbage,
            "not a tokenizer.json the tokenizers library can load "
            "(expected value at line 1 column 1)",
        ),
    ],
)
def test_a_bad_tokenizer_is_one_line_and_exit_2(
    make_path: Callable[[Path], Path],
    problem: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = make_path(tmp_path)
    argv = ["router", "--redis-url", "redis://localhost:1/0", "--tokenizer", str(path)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"kvmesh router: --tokenizer (KVMESH_TOKENIZER): {path}: {problem}\n"
    )


def _kvmesh(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KVMESH_REDIS_URL")}
    script = Path(sys.executable).parent / "kvmesh"
    return subprocess.run([script, *argv], capture_output=True, text=True, timeout=60, env=env)


def test_the_real_command_says_one_line_for_a_bad_redis_url() -> None:
    result = _kvmesh("worker", "--worker-id", "w0", "--redis-url", "notaurl")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"kvmesh worker: {REDIS_URL_SETTING}: {SCHEME_ERROR}\n"


def test_the_real_command_says_one_line_for_a_garbage_tokenizer(tmp_path: Path) -> None:
    path = _garbage(tmp_path)
    result = _kvmesh("router", "--redis-url", "redis://localhost:1/0", "--tokenizer", str(path))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"kvmesh router: --tokenizer (KVMESH_TOKENIZER): {path}: not a tokenizer.json the "
        "tokenizers library can load (expected value at line 1 column 1)\n"
    )


# -- help and usage ------------------------------------------------------------------------------


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every parser of its subcommands, recursively."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


ALL_PARSERS = [
    "kvmesh",
    *(f"kvmesh {name}" for name in SUBCOMMANDS),
    *(f"kvmesh bench {name}" for name in sorted(BENCHMARKS)),
    *(f"kvmesh ingest {source}" for source in ("trtllm", "vllm", "sglang")),
]


def test_the_help_walk_sees_every_subcommand() -> None:
    assert sorted(p.prog for p in _parsers(build_parser())) == sorted(ALL_PARSERS)


@pytest.mark.parametrize("prog", ALL_PARSERS)
def test_every_option_has_a_help_that_gives_its_default_once(prog: str) -> None:
    parser = next(p for p in _parsers(build_parser()) if p.prog == prog)
    text = parser.format_help()
    assert "(default: None)" not in text
    for action in parser._actions:
        if not action.option_strings:
            continue
        flag = action.option_strings[-1]
        assert action.help and action.help.strip(), (prog, flag)
        assert action.help.count("(default") <= 1, (prog, flag, action.help)
        # Only what has no default (a required flag or setting) or says nothing about one
        # (help, version) may leave it out.
        if action.required or "(required" in action.help or flag in ("--help", "--version"):
            continue
        assert "default" in action.help, (prog, flag, action.help)


def test_a_worker_flag_with_a_preset_default_says_it_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["worker", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # as wrapped for any terminal width
    assert "--num-layers NUM_LAYERS layers (default: the preset's) --num-heads" in text
    assert "--max-batch-size MAX_BATCH_SIZE most sequences running at once (default: 64)" in text


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_name_help_describes_that_benchmark(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    about, quick = BENCHMARK_HELP[name]
    assert text.startswith(f"usage: kvmesh bench {name} [-h] [--json] [--quick] ")
    assert f"kvmesh bench {name}: {about}." in text
    assert f"--quick a small run: {quick} (default: the full run)" in text


def test_every_benchmark_has_a_help() -> None:
    assert sorted(BENCHMARK_HELP) == sorted(BENCHMARKS)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "redis"], (False, False)),
        (["bench", "redis", "--quick", "--json"], (True, True)),
        (["bench", "redis", "--json"], (True, False)),
        (["bench", "--json", "redis"], (True, False)),  # the flags before the name, as before
        (["bench", "--quick", "redis", "--json"], (True, True)),
    ],
)
def test_bench_flags_go_before_or_after_the_name(
    argv: list[str], expected: tuple[bool, bool]
) -> None:
    args = parse_args(argv)
    assert (args.name, (args.json, args.quick)) == ("redis", expected)


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["worker", "--bogus"], "kvmesh worker"),
        (["router", "--bogus"], "kvmesh router"),
        (["dashboard", "--bogus"], "kvmesh dashboard"),
        (["demo", "--bogus"], "kvmesh demo"),
        (["replay", "--trace", "t.jsonl", "--bogus"], "kvmesh replay"),
        (["bench", "redis", "--bogus"], "kvmesh bench redis"),
        (["ingest", "vllm", "--worker-id", "w0", "--bogus"], "kvmesh ingest vllm"),
        (
            ["ingest", "trtllm", "--url", "http://x", "--worker-id", "w0", "--bogus"],
            "kvmesh ingest trtllm",
        ),
    ],
)
def test_an_unknown_flag_is_reported_by_its_subcommand(
    argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} [-h]")
    assert err.splitlines()[-1] == f"{prog}: error: unrecognized arguments: --bogus"


def test_kvmesh_worker_bogus_names_kvmesh_worker() -> None:
    result = _kvmesh("worker", "--bogus")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == "kvmesh worker: error: unrecognized arguments: --bogus"


def test_wait_ready_prints_the_answer_once_ready(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvmesh wait-ready`` polls /ready through 503s until a 200, and prints its body."""
    answers = iter([(503, b'{"ready":false}'), (503, b'{"ready":false}'), (200, b'{"ready":true}')])
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            status, body = next(answers)
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            code = main(["wait-ready", f"127.0.0.1:{server.server_address[1]}/", "--timeout", "10"])
        finally:
            server.shutdown()
    assert code == 0
    assert seen == ["/ready"] * 3
    assert capsys.readouterr().out == '{"ready":true}\n'


def test_wait_ready_gives_up_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        code = main(["wait-ready", f"http://127.0.0.1:{port}", "--timeout", "0.5"])
    assert code == 1
    assert capsys.readouterr().err == (
        f"kvmesh wait-ready: http://127.0.0.1:{port}/ready not ready after 0.5 s: "
        "no answer (ConnectError)\n"
    )
