"""Reading a JSON body whose prompt is a list of token ids without making a Python int per token.

A 4,096-token prompt is a 20 KB JSON array: ``orjson.loads`` made 4,096 ints, ``array("I",
...)`` copied them, and freeing them took as long again, a quarter of the router's CPU per
``POST /route``. ``parse_token_body`` finds the ``prompt_token_ids`` or ``prompt`` array, scans
it straight into a ``uint32`` array (a numba kernel), and parses only the rest with orjson.

It answers only plain bodies: a JSON object whose prompt array holds at least one decimal
integer within 0..2**32-1 (no sign, fraction, exponent or leading zero), every other member
valid JSON, no key given twice. Anything else is ``None``, and the caller leaves the body to
the FastAPI route, which parses it in full and names what is wrong. Why the key found is a
member of the outer object and not text inside a string: the bytes before it, closed with
``}``, parse as an object, so the key starts at depth one, outside any string.

The worker's fast path uses it too. Its block manager needs the prompt as ints (its keys are
tuples of them), and the scan plus ``words.tolist()`` cost what ``orjson.loads`` does (123-137
against 127-146 µs a 4,096-token body, caches cold as in a worker; ints shared from a table of
one per vocabulary id cost more, 175-181 µs: a cache miss per token); but the words go on to
the manager's hasher (``LlmRequest(token_words=...)``), which would otherwise convert the ints
back, and the vocabulary check reads their maximum: two conversions of ~25 µs saved.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

__all__ = ["TokenBody", "parse_token_body"]

_PROMPT_KEY = re.compile(rb'"(prompt_token_ids|prompt)"[ \t\n\r]*:[ \t\n\r]*\[')
_WS = b" \t\n\r"


@dataclass(slots=True)
class TokenBody:
    """A plain body: the prompt's key, its tokens, the other members, and where the array lies
    in the body (``body[start:end]`` is the array's JSON text, brackets included)."""

    key: str
    words: npt.NDArray[np.uint32]
    fields: dict[str, Any]
    start: int
    end: int


try:
    import numba
    from numba.cpython.unsafe.numbers import trailing_zeros

    _U = np.uint64
    _ZEROS = _U(0x3030303030303030)  # "0" in every byte
    _PAST_NINE = _U(0x7676767676767676)  # lifts a byte above 9 past 0x7f
    _HIGH_BITS = _U(0x8080808080808080)

    @numba.njit(cache=True, nogil=True, inline="always")
    def _value(digits: Any) -> Any:  # pragma: no cover - compiled
        """The number whose 1-8 decimal digits (0-9 each) fill the top bytes of ``digits``,
        the first one lowest: three multiply-and-mask steps, with no branch on its length."""
        digits = (digits * _U(10) + (digits >> _U(8))) & _U(0x00FF00FF00FF00FF)
        digits = (digits * _U(100) + (digits >> _U(16))) & _U(0x0000FFFF0000FFFF)
        return (digits * _U(10000) + (digits >> _U(32))) & _U(0xFFFFFFFF)

    @numba.njit(cache=True, nogil=True)
    def _scan(  # pragma: no cover - compiled
        buf: Any, words: Any, spaced: bool, i: int, out: Any
    ) -> tuple[int, int]:
        """Token ids from ``buf[i:]`` (just after ``[``) into ``out``: (count, the index after
        ``]``), or (-1, where it stopped) at anything but plain non-negative integers.

        ``words[j]`` is the 8 bytes at ``buf[j]`` as a little-endian uint64 (empty: the byte
        loop alone). While numbers are 1-7 digits, each right before ``,`` or ``]``, each is
        read whole from its word: its length from the lowest byte that is not a digit, its
        value by three multiply-and-mask steps, with no branch on its length; the byte loop
        mispredicted the end of each number (32.5 µs a 4,096-token body of varied ids; 24 µs
        this way). The separator is ``,`` (orjson's), or ``, `` (Python's) when ``spaced``:
        known before, because reading whether a space follows each comma would put that read
        on the chain from one number's position to the next (+10 µs). Anything else (other
        whitespace, 8 digits or more, the body's last 8 bytes) goes to the byte loop, from that
        number to the end."""
        n = buf.shape[0]
        k = 0
        while i < words.shape[0] and k < out.shape[0]:
            # A digit's byte becomes 0-9 here; none borrows below the first byte that is not one.
            word = words[i] - _ZEROS
            others = (word | (word + _PAST_NINE)) & _HIGH_BITS
            if others == 0:
                break  # 8 digits or more
            length = trailing_zeros(others) >> 3  # type: ignore[call-arg]  # a numba intrinsic
            if length == 0:
                break  # not a number here (whitespace?)
            if length > 1 and word & _U(0xFF) == 0:
                return -1, i  # a leading zero
            number = _value(word << _U(64 - 8 * length))  # its digits alone, shifted up
            after = buf[i + length]
            if after == 44:  # ,
                out[k] = np.uint32(number)
                k += 1
                i += length + 1
                if spaced:  # the same for every separator: a branch always predicted
                    if i >= n or buf[i] != 32:
                        break  # "," after all: the byte loop from this number
                    i += 1
            elif after == 93:  # ]
                out[k] = np.uint32(number)
                return k + 1, i + length + 1
            else:
                break
        while i < n and (buf[i] == 32 or buf[i] == 10 or buf[i] == 13 or buf[i] == 9):
            i += 1
        while True:
            if i >= n:
                return -1, i
            c = buf[i]
            if c < 48 or c > 57 or (c == 48 and i + 1 < n and 48 <= buf[i + 1] <= 57):
                return -1, i
            value = np.uint64(0)
            digits = 0
            while i < n and 48 <= buf[i] <= 57:
                value = value * np.uint64(10) + np.uint64(buf[i] - 48)
                digits += 1
                i += 1
                if digits > 10:
                    return -1, i
            if value > np.uint64(4294967295) or k >= out.shape[0]:
                return -1, i
            out[k] = np.uint32(value)
            k += 1
            while i < n and (buf[i] == 32 or buf[i] == 10 or buf[i] == 13 or buf[i] == 9):
                i += 1
            if i >= n:
                return -1, i
            if buf[i] == 44:  # ,
                i += 1
                while i < n and (buf[i] == 32 or buf[i] == 10 or buf[i] == 13 or buf[i] == 9):
                    i += 1
                continue
            if buf[i] == 93:  # ]
                return k, i + 1
            return -1, i

    _COMMAS = _U(0x2C2C2C2C2C2C2C2C)  # "," in every byte
    _LOW_BITS = _U(0x7F7F7F7F7F7F7F7F)
    _GATHER = _U(0x0102040810204080)  # a byte's high bit, each byte's, to one byte of bits

    @numba.njit(cache=True, nogil=True)
    def _scan_plain(  # pragma: no cover - compiled
        buf: Any, words: Any, start: int, end: int, spaced: bool, out: Any, commas: Any
    ) -> int:
        """The ids of ``buf[start:end]`` (an array's text between ``[`` and the first ``]``)
        into ``out``: how many, or -1 unless every id is 1-8 digits (no leading zero) and
        every separator is ``,`` (or ``, `` when ``spaced``); ``_scan`` then reads it, and says
        what is wrong if anything is.

        ``_scan`` reads id after id, each one's position from the one before: 7 ns an id on a
        dependency chain. Here the commas are found first, 64 bytes at a time (each 8-byte
        word's comma bytes as 8 bits, their positions from the set bits), and then every id is
        read from its own word, independently of the others: 29-30 → 20-21 µs for a
        4,096-token body."""
        n_words = words.shape[0]
        count = 0
        g = start
        while g + 64 <= end and g + 64 <= n_words:
            found = _U(0)
            for b in range(8):
                word = words[g + 8 * b] ^ _COMMAS
                zero = ~(((word & _LOW_BITS) + _LOW_BITS) | word | _LOW_BITS)  # exact
                found |= (((zero >> _U(7)) * _GATHER) >> _U(56)) << _U(8 * b)
            while found:
                if count >= commas.shape[0] - 1:
                    return -1
                commas[count] = g + np.int64(trailing_zeros(found))  # type: ignore[call-arg]
                count += 1
                found &= found - _U(1)
            g += 64
        while g < end:  # the last bytes (fewer than 64, or too near the body's end)
            if buf[g] == 44:
                if count >= commas.shape[0] - 1:
                    return -1
                commas[count] = g
                count += 1
            g += 1
        if count >= out.shape[0]:
            return -1
        commas[count] = end
        bad = _U(0)
        s = start
        for t in range(count + 1):
            e = commas[t]
            length = e - s
            if length < 1 or length > 8:
                return -1
            if s < n_words:
                word = words[s] - _ZEROS  # as in _scan, its digits alone after the shift
                shift = _U(64 - 8 * length)
                bad |= ((word | (word + _PAST_NINE)) & _HIGH_BITS) << shift
                bad |= _U(length > 1 and word & _U(0xFF) == 0)  # a leading zero
                number = _value(word << shift)
            else:  # the body's last 8 bytes: one at a time
                number = _U(0)
                for j in range(s, e):
                    digit = buf[j]
                    bad |= _U(digit < 48 or digit > 57)
                    number = number * _U(10) + _U(digit - 48)
                bad |= _U(length > 1 and buf[s] == 48)
            out[t] = np.uint32(number)
            if spaced and t < count:
                bad |= _U(buf[e + 1] != 32)
            s = e + 2 if spaced else e + 1
        return count + 1 if bad == 0 else -1

    SCAN_IMPL = "numba"
except ImportError:  # pragma: no cover - numba is a declared dependency
    _scan = None  # type: ignore[assignment]
    _scan_plain = None  # type: ignore[assignment]
    SCAN_IMPL = "orjson"


_NO_WORDS = np.zeros(0, dtype=np.uint64)


def _words(body: bytes) -> npt.NDArray[np.uint64]:
    """The 8 bytes at each offset of ``body`` as a uint64 (a view with a stride of one byte;
    none on a big-endian machine, where the byte loop reads everything)."""
    if len(body) < 8 or sys.byteorder != "little":
        return _NO_WORDS
    return np.ndarray((len(body) - 7,), dtype=np.uint64, buffer=body, strides=(1,))


def _words_of(body: bytes, start: int) -> tuple[npt.NDArray[np.uint32], int] | None:
    if _scan is None:  # pragma: no cover - numba is a declared dependency
        end = body.find(b"]", start) + 1
        try:
            tokens = orjson.loads(body[start - 1 : end])
        except orjson.JSONDecodeError:
            return None
        if not end or not tokens or any(type(t) is not int or not 0 <= t < 1 << 32 for t in tokens):
            return None
        return np.array(tokens, dtype=np.uint32), end
    comma = body.find(b",", start)
    spaced = comma >= 0 and body[comma + 1 : comma + 2] == b" "
    buf, words = np.frombuffer(body, dtype=np.uint8), _words(body)
    close = body.find(b"]", start)
    if close > start:
        size = (close - start) // 2 + 2
        out = np.empty(size, dtype=np.uint32)
        count = _scan_plain(buf, words, start, close, spaced, out, np.empty(size, dtype=np.int64))
        if count > 0:
            return out[:count], close + 1
    out = np.empty(len(body) // 2 + 1, dtype=np.uint32)
    count, end = _scan(buf, words, spaced, start, out)
    if count <= 0:
        return None
    return out[:count], end


def _members(text: bytes) -> dict[str, Any] | None:
    """``text`` (``{`` + members + ``}``) as a non-empty dict, or None."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if type(value) is dict and value else None


def parse_token_body(body: bytes) -> TokenBody | None:
    """The body as a ``TokenBody``, or None when it is not a plain one (see the module)."""
    found = _PROMPT_KEY.search(body)
    if found is None:
        return None
    before = body[: found.start()].strip(_WS)
    if before == b"{":
        head: dict[str, Any] = {}
    elif before[:1] == b"{" and before[-1:] == b",":
        members = _members(before[:-1] + b"}")
        if members is None:
            return None
        head = members
    else:
        return None
    scanned = _words_of(body, found.end())
    if scanned is None:
        return None
    words, end = scanned
    after = body[end:].lstrip(_WS)
    if after[:1] == b"}" and not after[1:].strip(_WS):
        tail: dict[str, Any] = {}
    elif after[:1] == b",":
        members = _members(b"{" + after[1:])
        if members is None:
            return None
        tail = members
    else:
        return None
    if head.keys() & tail.keys() or {"prompt", "prompt_token_ids"} & (head.keys() | tail.keys()):
        return None  # a key twice, or two prompts: the FastAPI route says what it makes of it
    key = found.group(1).decode()
    return TokenBody(key, words, {**head, **tail}, found.end() - 1, end)
