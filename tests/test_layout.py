"""The layout the code must keep, checked on every .py file parsed with ``ast``, so that a wrong
import fails here, not in review:

* the direction of imports: cache <- events <- app, and nothing but tests and tools imports app;
* inside app: ``core`` imports no other part of app; ``cluster`` and ``chat`` only ``core``;
  the services (``worker``, ``router``, ``dashboard``) never import each other (they meet
  through Redis and HTTP; ``app.services`` composes the router with its dashboard); ``replay``
  may use the router's core and policies but no service's runtime or HTTP side;
* no import circle anywhere in the package (the whole graph is walked, ``TYPE_CHECKING``
  imports included, so that none can hide one);
* every module under ``MAX_LINES`` lines, but the few named in ``LONG_MODULES`` with why;
* the repository stands on its own (no code reads the seed material beside it).
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


def _graph() -> dict[str, set[str]]:
    """Module -> the modules of cache/, events/ and app/ it imports (any kind of import)."""
    modules = {
        _module_name(path): path
        for path in _python_files()
        if path.relative_to(REPO_ROOT).parts[0] in ("app", "cache", "events")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = imported_modules(path.read_text(), name, is_package=path.name == "__init__.py")
        targets: set[str] = set()
        for target in imported:
            # "from app.x import y" names app.x.y: a module if there is one, else app.x.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle() -> None:
    # A package's __init__ that re-exports its modules imports them and they may import their
    # siblings through it; that is one package, not a circle between concepts.
    graph = {
        name: {t for t in targets if not (name.startswith(t + ".") and _is_package(t))}
        for name, targets in _graph().items()
    }
    assert _cycles(graph) == []


def _is_package(module: str) -> bool:
    return (REPO_ROOT / module.replace(".", "/") / "__init__.py").exists()


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


# Inside app/: who may import whom (by the first part below app).
SERVICES = {"worker", "router", "dashboard"}
APP_RULES: dict[str, set[str]] = {
    "core": set(),
    "cluster": {"core"},
    "chat": {"core"},  # models, tokenizers and OpenAI's chat request: below the services
    "worker": {"core", "chat"},
    "router": {"core", "cluster", "chat"},
    "dashboard": {"core", "cluster"},
    "replay": {"core", "router"},  # the router's core and policies
}


def app_violations(module: str, targets: set[str]) -> list[str]:
    parts = module.split(".")
    if parts[0] != "app" or len(parts) < 2:
        return []
    owner = parts[1]
    allowed = APP_RULES.get(owner)
    if allowed is None:
        return []
    problems = []
    for target in sorted(targets):
        tparts = target.split(".")
        if tparts[0] != "app" or len(tparts) < 2 or tparts[1] == owner:
            continue
        if tparts[1] not in allowed:
            problems.append(f"{module} imports {target}: app/{owner}/ may import {sorted(allowed)}")
        elif (
            owner == "replay"
            and tparts[1] == "router"
            and tparts[2:3]
            not in (
                ["core"],
                ["policies"],
            )
        ):
            problems.append(f"{module} imports {target}: replay uses the router's core only")
    return problems


def test_services_never_import_each_other() -> None:
    problems: list[str] = []
    for module, targets in _graph().items():
        problems += app_violations(module, targets)
    assert problems == []


@pytest.mark.parametrize(
    ("module", "targets", "expected"),
    [
        ("app.dashboard.state", {"app.router.policies"}, 1),
        ("app.router.runtime", {"app.dashboard.runtime"}, 1),
        ("app.worker.api", {"app.router.core"}, 1),
        ("app.cluster.view", {"app.router.core"}, 1),
        ("app.core.http", {"app.cluster.view"}, 1),
        ("app.replay.cluster", {"app.router.runtime"}, 1),
        ("app.replay.cluster", {"app.router.core", "app.router.policies.base"}, 0),
        ("app.services", {"app.router.app", "app.dashboard.app"}, 0),
        ("app.router.api", {"app.cluster.view", "app.core.http"}, 0),
    ],
)
def test_the_service_rules_catch_wrong_imports(
    module: str, targets: set[str], expected: int
) -> None:
    assert len(app_violations(module, targets)) == expected


MAX_LINES = 600
# Modules that hold one concept needing more room; each says why.
LONG_MODULES: dict[str, str] = {
    "app/worker/engine.py": (
        "the engine loop and the scheduler it runs every step read as one: splitting them would "
        "pass the queues, the running list and the manager back and forth"
    ),
}


def test_every_module_is_one_room() -> None:
    long = {
        str(path.relative_to(REPO_ROOT)): n
        for path in _python_files()
        if path.relative_to(REPO_ROOT).parts[0] in ("app", "cache", "events")
        and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert {p: n for p, n in long.items() if p not in LONG_MODULES} == {}
    assert sorted(set(LONG_MODULES) - set(long)) == [], "LONG_MODULES names a module now short"


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
