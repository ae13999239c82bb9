"""The mypyc build of cache/'s hot modules (cache/_native.py, tools/build_native.py): it runs only
when made from the sources as they are, the sources run otherwise, and both give the same run."""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cache
from cache import _native

REPO = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _fake_build(directory: Path) -> None:
    """What a build leaves: an extension per module, the shared library, the digest."""
    for name in (*_native.MODULES, _native.SHARED_LIB):
        (directory / f"{name}{SUFFIX}").write_bytes(b"")
    (directory / _native.DIGEST_FILE).write_text(_native.sources_digest(directory) + "\n")


def test_a_build_counts_only_when_complete_and_made_from_these_sources(tmp_path: Path) -> None:
    for source in (REPO / "cache").glob("*.py"):
        shutil.copy(source, tmp_path)
    assert not _native.built(tmp_path)
    _fake_build(tmp_path)
    assert _native.built(tmp_path)

    # An edit to any source, compiled or imported by the compiled ones, makes the build stale.
    retention = tmp_path / "retention.py"
    retention.write_text(retention.read_text() + "\n# edited\n")
    assert not _native.built(tmp_path)
    _fake_build(tmp_path)
    assert _native.built(tmp_path)

    (tmp_path / f"{_native.SHARED_LIB}{SUFFIX}").unlink()
    assert not _native.built(tmp_path)


def test_the_digest_is_sha256_over_names_and_bytes_in_name_order(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_bytes(b"x = 2\n")
    (tmp_path / "a.py").write_bytes(b"x = 1\n")
    (tmp_path / "notes.txt").write_bytes(b"not a source")
    expected = hashlib.sha256(b"a.py\0x = 1\nb.py\0x = 2\n").hexdigest()
    assert _native.sources_digest(tmp_path) == expected


def test_the_source_finder_loads_the_py_ahead_of_an_extension(tmp_path: Path) -> None:
    package = tmp_path / "kvmesh_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hot.py").write_text("WHERE = 'source'\n")
    (package / f"hot{SUFFIX}").write_bytes(b"not an extension")  # a broken, stale build
    script = (
        "import sys; from pathlib import Path; from cache._native import SourceFinder\n"
        "if sys.argv[1] == 'finder':\n"
        f"    sys.meta_path.insert(0, SourceFinder('kvmesh_probe_pkg', Path({str(package)!r}),"
        " ['hot']))\n"
        "import kvmesh_probe_pkg.hot as hot; print(hot.WHERE)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    with_finder = subprocess.run(
        [sys.executable, "-c", script, "finder"], env=env, capture_output=True, text=True
    )
    assert (with_finder.returncode, with_finder.stdout) == (0, "source\n")
    without = subprocess.run(
        [sys.executable, "-c", script, "none"], env=env, capture_output=True, text=True
    )
    assert without.returncode == 1
    assert "ImportError" in without.stderr


# The bench's prompts on a pool small enough to evict, offload to the host tier and onboard
# back: every event, every block id and the stats, hashed.
_RUN = """
import hashlib, json, cache
from app.bench.manager import make_prompts
from cache import KVCacheManager, LlmRequest
from events.codec import encode_events
mgr = KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=16,
                     blocks_per_window={4096: (1100, 300)}, max_num_sequences=4,
                     max_attention_window=[4096], max_sequence_length=4096,
                     event_buffer_max_size=100_000, allocate_pools=False)
digest = hashlib.sha256()
live = []
kinds = {}
for rid, tokens in enumerate(make_prompts(40)):
    if len(live) == 3:
        old = live.pop(0)
        mgr.remove_sequence(old.request_id, old)
    request = LlmRequest(rid, tokens)
    mgr.add_sequence(request)
    live.append(request)
    digest.update(repr(mgr.get_cache_block_ids(rid)).encode())
    events = mgr.take_events()
    for event in events:
        kinds[event.data.type] = kinds.get(event.data.type, 0) + 1
    digest.update(encode_events(events))
stats = mgr.get_kv_cache_stats()
print(json.dumps({"impl": cache.CACHE_IMPL, "digest": digest.hexdigest(), "kinds": kinds,
                  "reused": stats.reused_blocks, "free": mgr.get_num_free_blocks()}))
"""


def _run(pure: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != _native.PURE_ENV}
    if pure:
        env[_native.PURE_ENV] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _RUN], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.mark.timeout(300)
def test_the_compiled_build_and_the_sources_give_the_same_run() -> None:
    default, pure = _run(pure=False), _run(pure=True)
    # The default is the build whenever it matches the sources (make test builds it first).
    assert default["impl"] == ("mypyc" if _native.built() else "python")
    assert pure["impl"] == "python"
    assert default == {**pure, "impl": default["impl"]}
    # the run took every path: stored, evicted (removed), offloaded and onboarded (updated)
    assert pure["kinds"].keys() == {"created", "stored", "removed", "updated"}


# One implementation runs in both builds, but compiled it reads its arguments as native types
# (numpy's integers crashed only the compiled build once): these files hold both to the same
# cases (lent keys, numpy tokens, every field of a Stored event, the tree's writes, pins, admin).
BOTH_BUILDS = (
    "tests/cache/test_lending.py",
    "tests/cache/test_events.py",
    "tests/cache/test_radix.py",
    "tests/cache/test_keys_and_retention.py",
    "tests/cache/test_admin.py",
)


def _other_build_env() -> tuple[dict[str, str], str]:
    """The environment that runs the build this process does not, and that build's name."""
    env = {k: v for k, v in os.environ.items() if k != _native.PURE_ENV}
    if cache.CACHE_IMPL == "mypyc":
        return {**env, _native.PURE_ENV: "1"}, "python"
    # Without a build matching the sources there is no second build to compare: that is a
    # failure to say, not a pass (make test builds it first; a stale build does not count).
    assert _native.built(), (
        "no compiled build made from these sources: run make native "
        "(python tools/build_native.py), then the tests"
    )
    return env, "mypyc"


@pytest.mark.timeout(300)
def test_the_same_cases_pass_on_the_other_build() -> None:
    """This run covers one build; a child process runs BOTH_BUILDS on the other one."""
    env, other = _other_build_env()
    impl = subprocess.run(
        [sys.executable, "-c", "import cache; print(cache.CACHE_IMPL)"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert impl.stdout.strip() == other, impl.stderr
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *BOTH_BUILDS],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert " passed" in out.stdout and "skipped" not in out.stdout
