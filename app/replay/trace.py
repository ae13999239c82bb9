"""Mooncake-format traces: parsing, checking, and the prompt tokens a request stands for.

A trace is JSON lines, one request each (the format of Mooncake's published traces)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in milliseconds from the start, ``hash_ids`` name the request's
prompt blocks of ``TRACE_BLOCK_TOKENS`` (512) tokens: equal ids are equal content. The last
block may be partial: ``input_length`` lies in ``((len(hash_ids) - 1) * 512, len(hash_ids) *
512]``, and a partial block is a prefix of the same id's full block elsewhere.

``TokenSource`` turns ids into tokens: block id ``b`` is 512 tokens from a counter-based
generator (splitmix64 of the seed, ``b`` and the position), so equal ids give equal tokens in
every run and every process; a request's prompt is its blocks' tokens concatenated and cut to
``input_length``. Token ids lie in ``0..vocab_size - 1``; the default vocabulary of 256 keeps
every token a cached small ``int`` in the manager's keys (a cluster's cache holds tens of
millions of them), and 64 tokens of 8 bits still make distinct blocks distinct.

A file whose name ends in ``.gz`` is read through gzip (the full Mooncake traces ship that way,
in ``benchmarks/traces/``). Errors: ``TraceError`` (a ``ValueError``) names the file, the line
and the field.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO

import numpy as np
import numpy.typing as npt

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "TokenSource",
    "TraceError",
    "TraceRequest",
    "load_trace",
    "parse_trace",
]

TRACE_BLOCK_TOKENS: Final = 512
_MASK64: Final = np.uint64(0xFFFFFFFFFFFFFFFF)


class TraceError(ValueError):
    """A trace line that is not a valid request (the message names the line and field)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # 0-based position in the trace
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int_field(row: dict[str, Any], name: str, where: str, minimum: int) -> int:
    if name not in row:
        raise TraceError(f"{where}: field {name!r} is missing")
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(f"{where}: field {name!r} must be an integer, got {value!r}")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise TraceError(f"{where}: field {name!r} must be an integer, got {value!r}")
        value = int(value)
    if value < minimum:
        raise TraceError(f"{where}: field {name!r} must be >= {minimum}, got {value}")
    return value


def _request(index: int, line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    timestamp = _int_field(row, "timestamp", where, 0)
    input_length = _int_field(row, "input_length", where, 1)
    output_length = _int_field(row, "output_length", where, 1)
    if "hash_ids" not in row:
        raise TraceError(f"{where}: field 'hash_ids' is missing")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise TraceError(f"{where}: field 'hash_ids' must be a non-empty list of integers")
    for i, b in enumerate(ids):
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 2**63:
            raise TraceError(f"{where}: field 'hash_ids'[{i}] must be an integer >= 0, got {b!r}")
    low, high = (len(ids) - 1) * TRACE_BLOCK_TOKENS, len(ids) * TRACE_BLOCK_TOKENS
    if not low < input_length <= high:
        raise TraceError(
            f"{where}: field 'input_length' {input_length} does not fit {len(ids)} hash_ids "
            f"of {TRACE_BLOCK_TOKENS} tokens (must be in {low + 1}..{high})"
        )
    return TraceRequest(index, timestamp, input_length, output_length, tuple(ids))


def parse_trace(
    lines: Iterable[str], *, source: str = "trace", limit: int | None = None
) -> list[TraceRequest]:
    """Parse trace lines (blank lines skipped); timestamps must not go backwards."""
    out: list[TraceRequest] = []
    last = 0
    for number, line in enumerate(lines, start=1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        where = f"{source}:{number}"
        request = _request(len(out), line, where)
        if request.timestamp_ms < last:
            raise TraceError(
                f"{where}: field 'timestamp' {request.timestamp_ms} goes back in time "
                f"(previous {last})"
            )
        last = request.timestamp_ms
        out.append(request)
    return out


def _open_text(path: Path) -> TextIO:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace file; ``TraceError`` for a missing/unreadable file or a bad line."""
    path = Path(path)
    try:
        with _open_text(path) as f:
            requests = parse_trace(f, source=str(path), limit=limit)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:  # a damaged .gz (before OSError:
        raise TraceError(f"{path}: not a readable gzip file ({exc})") from None  # its subclass)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return requests


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser, element-wise (uint64 arithmetic wraps, as intended)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class TokenSource:
    """Prompt tokens of trace requests; one array per block id, made once and cached."""

    def __init__(self, seed: int = 0, vocab_size: int = 256) -> None:
        if not 2 <= vocab_size <= 2**31:
            raise ValueError(f"vocab_size: must be within 2..2**31, got {vocab_size}")
        self.seed = seed
        self.vocab_size = vocab_size
        # uint32: what the hasher mixes, so the router hashes the array without a copy.
        self._dtype = np.uint32
        self._blocks: dict[int, npt.NDArray[Any]] = {}
        self._positions = np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)
        self._seed_key = _splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]

    def _make(self, block_ids: list[int]) -> None:
        """Generate the blocks ``block_ids`` (not cached yet) in one vectorised pass."""
        ids = np.array(block_ids, dtype=np.uint64)
        with np.errstate(over="ignore"):
            keys = _splitmix64(ids ^ self._seed_key) * np.uint64(TRACE_BLOCK_TOKENS)
            counters = keys[:, None] + self._positions[None, :]
            values = _splitmix64(counters) % np.uint64(self.vocab_size)
        rows = values.astype(self._dtype)
        for block_id, row in zip(block_ids, rows, strict=True):
            self._blocks[block_id] = row

    def block(self, block_id: int) -> npt.NDArray[Any]:
        """The 512 tokens of one trace block."""
        if block_id not in self._blocks:
            self._make([block_id])
        return self._blocks[block_id]

    def tokens(self, request: TraceRequest) -> npt.NDArray[np.uint32]:
        """The request's prompt: its blocks' tokens concatenated, cut to input_length."""
        blocks = self._blocks
        missing = [b for b in dict.fromkeys(request.hash_ids) if b not in blocks]
        if missing:
            self._make(missing)
        joined = np.concatenate([blocks[b] for b in request.hash_ids])
        return joined[: request.input_length]

    def token_list(self, request: TraceRequest) -> list[int]:
        """``tokens`` as a list of ints (what ``LlmRequest`` keeps)."""
        result: list[int] = self.tokens(request).tolist()
        return result

    def __len__(self) -> int:
        return len(self._blocks)
