"""The direction of imports (STYLE.md): cache <- events <- app, and nothing imports app; and
the repository stands on its own (no code reads the seed material beside it).

Every .py file of the repository is parsed with ``ast``; a wrong import fails here, not in
review.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".git", "build", "dist", "node_modules", "__pycache__"}

# cache/ is the pure, synchronous block manager.
CACHE_FORBIDDEN = {
    "events",
    "app",
    "asyncio",
    "fastapi",
    "starlette",
    "redis",
    "pydantic",
    "pydantic_settings",
    "uvicorn",
    "httpx",
}


def _python_files() -> list[Path]:
    return sorted(
        path
        for path in REPO_ROOT.rglob("*.py")
        if not SKIP_DIRS.intersection(path.relative_to(REPO_ROOT).parts)
    )


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, *, is_package: bool) -> set[str]:
    """Absolute names of every module that ``source`` imports (relative imports resolved)."""
    names: set[str] = set()
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def _top_level(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names if name}


def violations(path: Path, imports: set[str]) -> list[str]:
    relative = path.relative_to(REPO_ROOT)
    owner = relative.parts[0] if len(relative.parts) > 1 else ""
    top = _top_level(imports)
    problems: list[str] = []
    if owner == "cache":
        problems += [f"cache/ must not import {name}" for name in sorted(top & CACHE_FORBIDDEN)]
    if owner == "events" and "app" in top:
        problems.append("events/ must not import app")
    if owner not in ("app", "tests", "tools", "cache", "events") and "app" in top:
        problems.append("only app/, tests/ and tools/ may import app")
    return [f"{relative}: {problem}" for problem in problems]


def test_import_direction() -> None:
    problems: list[str] = []
    files = _python_files()
    assert any(path.parts[-2:] == ("app", "cli.py") for path in files)
    for path in files:
        imports = imported_modules(
            path.read_text(), _module_name(path), is_package=path.name == "__init__.py"
        )
        problems += violations(path, imports)
    assert problems == []


@pytest.mark.parametrize(
    ("relative", "source", "expected"),
    [
        ("cache/pool.py", "import asyncio", ["cache/ must not import asyncio"]),
        ("cache/pool.py", "from redis.asyncio import Redis", ["cache/ must not import redis"]),
        ("cache/pool.py", "from ..events import x", ["cache/ must not import events"]),
        ("cache/pool.py", "from ..app.cli import main", ["cache/ must not import app"]),
        ("cache/pool.py", "from . import radix\nimport numpy", []),
        ("events/index.py", "from app.cli import main", ["events/ must not import app"]),
        ("events/index.py", "from cache import BlockKey", []),
        ("tools/x.py", "import app.cli", []),  # the docs tool renders the services' schemas
        ("benchmarks/x.py", "import app.cli", ["only app/, tests/ and tools/ may import app"]),
        ("tests/app/test_x.py", "from app.cli import main", []),
    ],
)
def test_the_checker_catches_wrong_imports(relative: str, source: str, expected: list[str]) -> None:
    path = REPO_ROOT / relative
    imports = imported_modules(source, _module_name(path), is_package=False)
    assert violations(path, imports) == [f"{relative}: {problem}" for problem in expected]


# A clone of kvmesh has no seed folder beside it: code, tests and build files must not read it
# (docs may name it as an optional input of a benchmark). Spelled so this file does not match.
SIBLING = "sha" + "red"
READS_SIBLING = re.compile(
    r"\.\./" + SIBLING + r"\b|/\s*[\"']" + SIBLING + r"[\"']|[\"']" + SIBLING + r"[\"']\s*/"
)
CODE_SUFFIXES = {".py", ".toml", ".yml", ".yaml", ".cfg", ".sh", ".txt"}
CODE_NAMES = {"Makefile", "Dockerfile", "run"}


def test_nothing_reads_the_seed_folder_beside_the_repository() -> None:
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for path in sorted(REPO_ROOT.rglob("*"))
        if path.is_file()
        and not SKIP_DIRS.intersection(path.relative_to(REPO_ROOT).parts)
        and (path.suffix in CODE_SUFFIXES or path.name in CODE_NAMES)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if READS_SIBLING.search(line)
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("line", "reads"),
    [
        ('Path(__file__).parents[3] / "' + SIBLING + '" / "testdata"', True),
        ("open('../" + SIBLING + "/data/x.jsonl')", True),
        ('("first_len", "' + SIBLING + '", "copies")', False),
        ("the " + SIBLING + " prefix of every request", False),
        ('Path(__file__).parents[1] / "data" / "block_hash_golden.json"', False),
    ],
)
def test_the_seed_folder_check(line: str, reads: bool) -> None:
    assert bool(READS_SIBLING.search(line)) is reads
