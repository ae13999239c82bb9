"""Compile cache/'s hot modules with mypyc, in place: `python tools/build_native.py [--force]`.

`make setup` and `make test` run it; it does nothing when the build on disk was made from the
sources as they are. The modules, the shared library's name and the digest that ties a build to
its sources come from `cache/_native.py`, which decides at import time whether the build runs.

A build that cannot be made (no mypyc, no C compiler, a mypyc error) is not an error: the old
build is removed, a line says so, and cache/ runs as pure Python. Set KVMESH_NO_MYPYC=1 to skip
the build (and remove any old one).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = ROOT / "cache"
BUILD_DIR = ROOT / "build" / "native"


def _load_native() -> ModuleType:
    # cache/_native.py on its own: importing the package would import the modules being built.
    spec = importlib.util.spec_from_file_location("_kvmesh_native", PACKAGE_DIR / "_native.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_build(native: ModuleType) -> None:
    # Every extension in cache/ is ours: a module dropped from MODULES must not stay shadowed.
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for path in PACKAGE_DIR.glob(f"*{suffix}"):
            path.unlink()
    (PACKAGE_DIR / native.DIGEST_FILE).unlink(missing_ok=True)


def _compile(native: ModuleType) -> None:
    from mypyc.build import mypycify
    from setuptools import setup

    os.chdir(ROOT)  # mypycify names modules by their paths from here
    extensions = mypycify(
        [f"cache/{name}.py" for name in native.MODULES],
        opt_level="3",
        # The shared library lives in the package (cache/native__mypyc*.so), not at the top
        # level, where an editable install would not find it.
        group_name=f"{native.PACKAGE}.{native.SHARED_LIB.removesuffix('__mypyc')}",
        target_dir=str(BUILD_DIR),
    )
    setup(
        name="kvmesh-native",
        ext_modules=extensions,
        script_args=["--quiet", "build_ext", "--inplace", "--build-temp", str(BUILD_DIR / "tmp")],
    )


def main(argv: list[str]) -> int:
    native = _load_native()
    if os.environ.get("KVMESH_NO_MYPYC"):
        _remove_build(native)
        print("kvmesh: KVMESH_NO_MYPYC is set: cache/ runs as pure Python")
        return 0
    if "--force" not in argv and native.built():
        return 0
    _remove_build(native)
    digest = native.sources_digest()
    print(f"kvmesh: compiling {', '.join(native.MODULES)} with mypyc (a few minutes) ...")
    started = time.monotonic()
    try:
        _compile(native)
    except (Exception, SystemExit) as exc:  # setuptools reports a failed compile as SystemExit
        _remove_build(native)
        print(f"kvmesh: the mypyc build failed ({exc!r}); cache/ runs as pure Python")
        return 0
    (PACKAGE_DIR / native.DIGEST_FILE).write_text(digest + "\n")
    state = "compiled" if native.built() else "incomplete, so cache/ runs as pure Python"
    print(f"kvmesh: mypyc build {state} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
