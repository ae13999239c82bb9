"""The commands in README.md and docs/*.md run as written in a clone.

Every fenced ``sh`` block is either run here or listed in ``NOT_RUN`` with the reason, so a new
block needs a decision, and a block that changes needs another look. Run here: the README's
five-minute tour, as one script of its blocks in order, with real processes (a
``redis-server``, two ``kvmesh worker``, a ``kvmesh router``; its ports swapped for free ones,
so that a machine using 8000 can run the suite), its answers checked against what the README
says they are, then stopped as the README says (``kill $(jobs -p)``), every process exiting
0. Every other ``kvmesh`` command line in any fenced block is parsed by
the CLI's own parser (a flag that does not exist, like ``--allocate-pools=false``, fails), and
the files it names (``--trace``, ``--tokenizer``) exist in the repository.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from app.cli import parse_args
from app.core.net import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOUR_PORTS = (6390, 8000, 8001, 8002)  # Redis, the router, the two workers

# Fenced sh blocks that are not run, by (file, first command line): why not.
PLACEHOLDERS = {"NAME", "URL", "FREE_PORT", "..."}  # words a docs command has for a value
_BENCH = "minutes (a benchmark); tests/app/test_bench_*.py run it with --quick"
NOT_RUN = {
    ("README.md", "make demo"): "make test is what CI runs; the demo is tests/app/test_demo.py",
    ("README.md", "KVMESH_ADMIN_TOKEN=change-me docker compose up --build"): (
        "needs a Docker engine; tests/app/test_compose.py parses its commands"
    ),
    ("docs/benchmarks.md", ".venv/bin/kvmesh bench NAME"): "a placeholder (NAME)",
    (
        "docs/benchmarks.md",
        "kvmesh worker --engine sim --model tiny --vocab-size 32000 --num-gpu-blocks 32768 "
        "--num-host-blocks 0 --no-allocate-pools --max-batch-size 64 --max-tokens-per-step 16384 "
        "--max-queue-len 256 --sim-step-overhead-ms 0 --sim-prefill-us-per-token 0 "
        "--sim-decode-us-per-sequence 0 --drain-timeout-s 5 --worker-id bench-XXXXXX "
        "--host 127.0.0.1 --port FREE_PORT --redis-url URL",
    ): "what kvmesh bench worker starts (placeholders); tests/app/test_bench_worker.py runs it",
    ("docs/benchmarks.md", ".venv/bin/kvmesh bench manager --json"): _BENCH,
    ("docs/benchmarks.md", ".venv/bin/kvmesh bench index --json"): _BENCH,
    ("docs/benchmarks.md", ".venv/bin/kvmesh bench transfer --json"): _BENCH,
    ("docs/benchmarks.md", ".venv/bin/kvmesh bench events --json"): _BENCH,
    ("docs/benchmarks.md", ".venv/bin/kvmesh bench worker --json"): _BENCH,
    ("docs/benchmarks.md", ".venv/bin/kvmesh bench router --json"): _BENCH,
    ("docs/benchmarks.md", ".venv/bin/kvmesh bench ingest --json"): _BENCH,
    ("docs/benchmarks.md", ".venv/bin/python tools/cold_route.py"): (
        "a minute (a benchmark); tests/test_tools_cold_route.py runs it smaller"
    ),
    (
        "docs/benchmarks.md",
        ".venv/bin/kvmesh replay --trace benchmarks/traces/mooncake_conversation.jsonl.gz "
        "--workers 8 --tokens-per-block 64 --blocks-per-worker 38613 --policy kv_aware "
        "--policy round_robin --policy pooled --policy dynamo --policy sglang "
        "--policy least_loaded --plot docs/img/replay --json",
    ): "minutes (5,719 requests, 6 policies)",
    (
        "docs/benchmarks.md",
        ".venv/bin/kvmesh replay --trace benchmarks/traces/mooncake_conversation.jsonl.gz "
        "--workers 8 --tokens-per-block 64 --blocks-per-worker 38613 --policy kv_aware "
        "--routers 4 --event-delay-ms 50 --json",
    ): "a minute (5,719 requests); tests/app/test_replay.py runs the replica options",
    (
        "docs/operations.md",
        "redis-server --port 6379 --save '' --appendonly no --protected-mode no",
    ): "several machines (redis-host, gpu3)",
    (
        "docs/operations.md",
        "kvmesh register --url http://gpu7:8080 --worker-id gpu7 --served-model-name llama "
        "--block-size 16 --capacity-blocks 65536 --redis-url redis://redis-host:6379/0",
    ): "an engine on another machine (gpu7); tests/app/test_register.py runs kvmesh register",
    (
        "docs/operations.md",
        "vllm serve meta-llama/Llama-3.1-8B-Instruct --port 8000 --block-size 16 "
        '--max-model-len 8192 --kv-events-config \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq",',
    ): "a vLLM server on a GPU machine",
    (
        "docs/operations.md",
        "python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
        '--port 30000 --page-size 16 --kv-events-config \'{"publisher": "zmq", '
        '"endpoint": "tcp://*:5557",',
    ): "an SGLang server on a GPU machine",
    ("docs/operations.md", "kvmesh worker --help"): (
        "help, and a placeholder (...); tests/app/test_cli.py walks every subcommand's help"
    ),
    (
        "docs/worker.md",
        "kvmesh worker --worker-id w0 --port 8001 --redis-url redis://localhost:6379/0",
    ): ("servers that run until stopped (the README's tour runs two)"),
}


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    text: str

    @property
    def key(self) -> tuple[str, str]:
        """(file, its first command line without its comment)."""
        return self.path, " ".join(re.sub(r"\s+#.*$", "", self.commands()[0]).split())

    def commands(self) -> list[str]:
        """Command lines: continuations joined, comments and blank lines dropped. Outside an
        ``sh`` block only the lines shown after a ``$`` prompt (the rest is output)."""
        out: list[str] = []
        pending = ""
        for raw in self.text.splitlines():
            line = raw.rstrip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            line = (pending + line).strip()
            pending = ""
            if self.lang != "sh":
                if not line.startswith("$ "):
                    continue
                line = line.removeprefix("$ ")
            if line and not line.startswith("#"):
                out.append(line)
        return out


def fenced_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            match = re.match(r"^(\s*)```(\w*)\s*$", lines[i])  # indented too (in a list)
            if match is None:
                i += 1
                continue
            indent, lang = match.groups()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            text = "\n".join(line.removeprefix(indent) for line in lines[i + 1 : end])
            blocks.append(Block(str(path.relative_to(ROOT)), i + 1, lang, text))
            i = end + 1
    return blocks


def sh_blocks() -> list[Block]:
    return [b for b in fenced_blocks() if b.lang == "sh"]


def _tour_blocks() -> list[Block]:
    readme = [b for b in sh_blocks() if b.path == "README.md"]
    return [b for b in readme if b.key not in NOT_RUN]


def test_every_sh_block_is_run_or_says_why_not() -> None:
    keys = [block.key for block in sh_blocks()]
    tour = [block.key for block in _tour_blocks()]
    assert tour == [
        ("README.md", ". .venv/bin/activate"),
        ("README.md", 'PROMPT="[$(seq -s, 100 199)]"'),
        (
            "README.md",
            "curl -s -w '\\n' localhost:8000/route/explain -H 'content-type: application/json' "
            '-d "{\\"prompt\\": $PROMPT}"',
        ),
        ("README.md", "python - <<'EOF'"),
    ], "a new sh block in README.md: run it in the tour, or say in NOT_RUN why not"
    unclassified = [key for key in keys if key not in NOT_RUN and key[0] != "README.md"]
    assert unclassified == [], "run these, or say in NOT_RUN why not"
    assert sorted(set(NOT_RUN) - set(keys)) == [], "NOT_RUN names blocks that are gone"


def _kvmesh_argv(command: str) -> list[str] | None:
    """The arguments after ``kvmesh`` in a command line (None: not a kvmesh command, or one
    with placeholders)."""
    plain = [w for w in command.split() if not re.match(r"^[A-Z_]+=", w)]
    if not plain or Path(plain[0]).name != "kvmesh":
        return None
    words = shlex.split(command, comments=True)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words or Path(words[0]).name != "kvmesh":
        return None
    if words[-1] == "&":
        words = words[:-1]
    if PLACEHOLDERS & set(words):
        return None
    return words[1:]


def _kvmesh_commands() -> list[tuple[Block, list[str]]]:
    out = []
    for block in fenced_blocks():
        for command in block.commands():
            argv = _kvmesh_argv(command)
            if argv is not None:
                out.append((block, argv))
    return out


def test_every_kvmesh_command_in_the_docs_parses_and_names_files_that_exist() -> None:
    commands = _kvmesh_commands()
    assert len(commands) >= 20  # the extraction found them
    for block, argv in commands:
        where = f"{block.path}:{block.line}: kvmesh {' '.join(argv)}"
        try:
            args = parse_args(argv)
        except SystemExit as exc:
            assert exc.code == 0, where  # --help exits 0; a bad flag exits 2
            continue
        paths = [getattr(args, name, None) for name in ("trace", "tokenizer")]
        paths += [item.partition("=")[2] for item in getattr(args, "models", None) or ()]
        for value in paths:
            if value is not None:
                assert (ROOT / str(value)).exists(), f"{where}: {value} is not in the repository"


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _documented_answers() -> list[Any]:
    """The README's json blocks, in order (``[...]`` elisions replaced by an empty list)."""
    readme = [b for b in fenced_blocks() if b.path == "README.md" and b.lang == "json"]
    return [json.loads(line.replace("[...]", "[]")) for b in readme for line in b.text.splitlines()]


@pytest.mark.timeout(180)
def test_the_readme_tour_runs_as_written() -> None:
    ports = {port: free_port() for port in TOUR_PORTS}
    script = "\n".join(block.text for block in _tour_blocks())
    assert all(re.search(rf"\b{port}\b", script) for port in TOUR_PORTS)
    for port, free in ports.items():
        script = re.sub(rf"\b{port}\b", str(free), script)
    # How the README says to stop it all (kill $(jobs -p)), then each job's exit status.
    script += (
        '\npids="$(jobs -p)"\nkill $pids\n'
        'for pid in $pids; do wait "$pid" || echo "job $pid exited with $?" >&2; done\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVMESH_", "REDIS_URL"))}
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    answers = _json_lines(out)
    documented = _documented_answers()
    assert len(answers) == len(documented) == 6, (out, err[-3000:])
    ready, first, second, explain, turn1, turn2 = answers
    assert ready["ready"] is True and ready["reasons"] == []
    assert set(ready["workers_up"]) <= {"w0", "w1"} and ready["workers_up"]
    # What the README shows and says: the same output, 0 then 99 cached tokens, on one worker.
    for got, shown in ((first, documented[1]), (second, documented[2])):
        assert got["choices"][0]["token_ids"] == shown["choices"][0]["token_ids"]
        assert got["usage"] == shown["usage"]
    assert first["kvmesh"]["worker_id"] == second["kvmesh"]["worker_id"]
    assert explain["worker"] == first["kvmesh"]["worker_id"]
    for field in ("policy", "expected_cached_tokens", "num_tokens", "num_blocks"):
        assert explain[field] == documented[3][field], field
    # The chat: the same prompt and cached tokens as shown, both turns on one worker.
    for got, shown in ((turn1, documented[4]), (turn2, documented[5])):
        assert (got["prompt_tokens"], got["cached_tokens"]) == (
            shown["prompt_tokens"],
            shown["cached_tokens"],
        )
    assert turn1["worker"] == turn2["worker"]
    assert proc.returncode == 0, err[-3000:]
    assert "exited with" not in err, err[-3000:]
    assert all(_port_free(port) for port in ports.values()), "the tour left a process behind"
