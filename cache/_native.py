"""Which build of cache/'s hot modules runs: compiled by mypyc, or the pure-Python sources.

`tools/build_native.py` (run by `make setup` and `make test`) compiles the modules named in
`MODULES` with mypyc, in place: each gets an extension module beside its `.py`, and all share one
library, `cache/native__mypyc*.so`. The `.py` files stay the source of truth and the fallback.
Python would load an extension before a `.py` of the same name, so this module, imported by
`cache/__init__` before anything else, decides first and, where the compiled build must not run,
`select()` puts a finder in front that loads these modules from their sources:

* `KVMESH_PURE=1` asks for the sources;
* a build whose digest (written by the build, `DIGEST_FILE`) is not the digest of the package's
  sources is stale: an edited `.py` is never shadowed by an old extension;
* a missing piece (no build, a failed build, another interpreter's build) leaves the sources.

All or none: compiled classes are laid out in C and compiled callers read them directly, so a
compiled module never runs against a pure one. Nothing here is compiled, and nothing here may
import the rest of cache/ (the build loads this file on its own).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = "cache"
# The hot paths of an allocation and a release, and what they read: KVCacheBlock (block.py) and
# BlockKey (key.py) are native classes for them all; store.py stores every finished request.
# Left out: manager.py (tests replace methods of its instances) and the modules off the hot path
# (pins, admin, precheck, stats, capacity, events, hashing, pools, ...).
MODULES = ("key", "block", "eviction", "radix", "dryrun", "request", "store", "window")
SHARED_LIB = "native__mypyc"
DIGEST_FILE = "native.digest"
PURE_ENV = "KVMESH_PURE"
HERE = Path(__file__).resolve().parent


def sources_digest(directory: Path = HERE) -> str:
    """sha256 over every source of the package (names and bytes, in name order): the compiled
    modules are checked against the types of the pure ones they import, so any edit counts."""
    digest = hashlib.sha256()
    for source in sorted(directory.glob("*.py")):
        digest.update(source.name.encode() + b"\0")
        digest.update(source.read_bytes())
    return digest.hexdigest()


def built(directory: Path = HERE, modules: Sequence[str] = MODULES) -> bool:
    """A complete build for this interpreter, made from exactly the sources in `directory`."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    digest_file = directory / DIGEST_FILE
    return (
        digest_file.is_file()
        and all((directory / f"{name}{suffix}").is_file() for name in (*modules, SHARED_LIB))
        and digest_file.read_text().strip() == sources_digest(directory)
    )


class SourceFinder(importlib.abc.MetaPathFinder):
    """Loads the named modules of a package from their `.py` files, ahead of any extension."""

    def __init__(self, package: str, directory: Path, modules: Sequence[str]) -> None:
        self._paths = {f"{package}.{name}": directory / f"{name}.py" for name in modules}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        source = self._paths.get(fullname)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def select() -> str:
    """ "mypyc" when the compiled modules will be imported, else "python" (and make it so)."""
    if not os.environ.get(PURE_ENV) and built():
        return "mypyc"
    if not any(isinstance(f, SourceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SourceFinder(PACKAGE, HERE, MODULES))
    return "python"
