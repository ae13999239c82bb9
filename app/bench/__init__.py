"""Benchmarks run by ``kvmesh bench NAME``.

``BENCHMARKS`` maps a name to ``"module:function"``; the module is imported only when that
benchmark runs, so a heavy benchmark costs nothing to the rest of the CLI. A benchmark is a
``Callable[[argparse.Namespace], dict[str, Any]]``: it reads its options from the namespace
(``--quick`` asks for a small run, as in tests) and returns flat-ish, JSON-serialisable results.
To add one, write ``app/bench/<name>.py`` with a ``run(args)`` and add a line here.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["BENCHMARKS", "Benchmark", "load_benchmark"]

Benchmark = Callable[[argparse.Namespace], dict[str, Any]]

BENCHMARKS: dict[str, str] = {
    "events": "app.bench.events:run",
    "index": "app.bench.index:run",
    "manager": "app.bench.manager:run",
    "transfer": "app.bench.transfer:run",
    "redis": "app.bench.redis_rtt:run",
    "worker": "app.bench.worker:run",
    "router": "app.bench.router:run",
    "faults": "app.bench.faults:run",
    "ingest": "app.bench.ingest:run",
}


def load_benchmark(name: str) -> Benchmark:
    """Import and return the benchmark registered as ``name`` (KeyError if unknown)."""
    module_name, _, attr = BENCHMARKS[name].partition(":")
    module = importlib.import_module(module_name)
    bench: Benchmark = getattr(module, attr)
    return bench
