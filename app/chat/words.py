"""``WordEncoder``: plain ASCII text encoded pre-token by pre-token, each pre-token's ids kept in
a bounded cache, for the byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's layouts) where
that gives the ids the tokenizers library gives.

Why: encoding a chat's new turn with ``Tokenizer.encode`` costs ~0.25 µs a character, and most of
it is not the BPE (whose own word cache hits) but the library's pre-tokenization and the
alignments it keeps for offsets (``pre_tokenize_str`` alone is ~60 % of ``encode``). A turn's
words are mostly words seen before, so a Python dict from pre-token to ids answers them for a
fraction of that.

Why it is the same, step by step through the library's pipeline (``Tokenizer::encode``), for a
text that holds no added token (``PieceEncoder`` hands it the text after its control token) and
only characters of ``SAFE_CHARS`` (tab, newline, carriage return, printable ASCII):

1. Added tokens: the caller's text holds none of the non-normalized ones (``PieceEncoder`` cut
   before every one), and ``encode`` refuses a text holding a normalized one's content.
2. Normalizer: none, or Unicode normalization (NFC, NFD, NFKC, NFKD, as Qwen's NFC), which
   leaves ASCII as it is (``for_backend`` requires it).
3. Pre-tokenizer: either ``ByteLevel(add_prefix_space=False, use_regex=True)``, which splits on
   GPT-2's pattern (``GPT2_PATTERN``), or ``Sequence([Split(Regex(p), "Isolated",
   invert=False), ByteLevel(add_prefix_space=False, use_regex=False)])``. Both split the text
   into the pattern's matches and the gaps between them (empty splits dropped), then map each
   byte to its ByteLevel character. Here the same pattern runs in Python's ``re``, its
   ``\\p{L}`` and ``\\p{N}`` written as their ASCII members (``_ascii_pattern``; the ``regex``
   module where it names another property): on these characters every class the patterns use
   (``\\s``, ``\\p{L}``, ``\\p{N}``, case-insensitive ASCII) has one meaning in every engine,
   and the engines are all leftmost-first backtracking ones. The byte map is read from the
   library's own ``ByteLevel``.
4. Model: each split goes through the BPE (no dropout) alone: ``model.tokenize`` of the mapped
   split is what a cache miss calls.
5. Post-processor: with ``add_special_tokens=False`` the ones ``PieceEncoder`` admits add
   nothing.

What the two engines read differently even on ASCII is refused outright (``_portable``):
anchors outside a character class (``^`` and ``$`` match at every line in Oniguruma's Ruby
syntax), ``\\A``, ``\\Z``, ``\\z``, ``\\G``, ``\\h`` (a hex digit in Oniguruma, a horizontal
space here) and the like, inline flags other than ``i``, and patterns that can match an empty
string (the engines step past an empty match differently). ``for_backend`` then also encodes
``CHECK_TEXTS`` both ways and gives up (None) on any difference; the tests compare both ways on
every test tokenizer with random ASCII.

The cache holds at most ``max_words`` words of at most ``MAX_WORD_CHARS`` characters (a longer
one, a run of letters or spaces, is encoded each time), the least recently added dropped first.
"""

from __future__ import annotations

import json
import re
import warnings
from collections import OrderedDict
from collections.abc import Callable
from itertools import chain
from typing import Any

import regex

__all__ = ["CHECK_TEXTS", "GPT2_PATTERN", "MAX_WORD_CHARS", "SAFE_CHARS", "WordEncoder"]

MAX_WORD_CHARS = 64
# Normalizers that leave ASCII text as it is, by their type in tokenizer.json.
_ASCII_NEUTRAL = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
# Escapes the engines read differently (or one of them lacks); see the module docstring.
_UNPORTABLE_ESCAPES = frozenset("AZzGhHRXKbBQEg")

SAFE_CHARS = "\t\n\r" + "".join(map(chr, range(0x20, 0x7F)))
_UNSAFE = re.compile(f"[^{re.escape(SAFE_CHARS)}]")
# tokenizers' ByteLevel pre-tokenizer with use_regex=True (pre_tokenizers/byte_level.rs)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Texts where the patterns' alternatives meet: contractions in both cases, runs of spaces and
# newlines before words and at the end, digits, punctuation runs, tabs and CRLF.
CHECK_TEXTS = (
    "Hello, World! It's 3:45pm; we'll see.",
    "don't DON'T they're I've I'M you'll he'd ''s 'x",
    "  two  spaces   three\n\nnewlines \n \n  indented\ttab\t\tend  ",
    "1234567 12,345.67 x1y22z333 1st 2nd",
    '...!!! ?!? (a) [b] {c} <d> "q" `code` #h $5 %p ^ & * _u_ ~t | \\ / @a',
    "line\r\nwindows\r\n\r\n trailing\n",
    " leading space",
    "\n",
    "   ",
    "a",
)


def _portable(pattern: str) -> bool:
    """Whether ``pattern`` avoids what Oniguruma and the ``regex`` module read differently:
    ``^``/``$`` outside a class, the escapes of ``_UNPORTABLE_ESCAPES``, inline flags but ``i``,
    and inside a class a nested class, an intersection (``&&``) or a leading ``]``."""
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            if i + 1 < len(pattern) and pattern[i + 1] in _UNPORTABLE_ESCAPES:
                return False
            i += 2
            continue
        if in_class:
            if char == "[" or pattern.startswith("&&", i):  # Oniguruma's nested classes and
                return False  # intersections are literal characters to the regex module
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 2 if pattern[i + 1 : i + 2] == "^" else 1  # a negated class's ^ is its own
            if pattern[i : i + 1] == "]":  # a leading ] is read two ways
                return False
            continue
        elif char in "^$":
            return False
        elif pattern.startswith("(?", i) and pattern[i + 2 : i + 3] not in ("", ":", "!", "=", "<"):
            flags = re.match(r"[a-zA-Z-]*", pattern[i + 2 :])
            if flags is None or set(flags.group()) - {"i"}:
                return False
        i += 1
    return True


# What ``\p{L}`` and ``\p{N}`` hold among ``SAFE_CHARS``: a class's members.
_ASCII_PROPERTIES = {"{L}": "A-Za-z", "{N}": "0-9"}


def _ascii_pattern(pattern: str) -> str | None:
    """``pattern`` for Python's ``re`` on ``SAFE_CHARS`` text: each ``\\p{L}`` and ``\\p{N}``
    as its ASCII members (bare in a class, a class of its own outside one), everything else as
    it is; None where it names another property, a negated one (``\\P``), or one that ends or
    starts a range in a class (``re`` would read a range of the members' ends). ``re`` runs
    the GPT-2 and Llama 3 patterns twice as fast as the ``regex`` module (16.5 → 7.6 µs a
    250-character turn); on these characters every class means the same in both."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            escape = pattern[i : i + 2]
            if escape in ("\\p", "\\P"):
                members = _ASCII_PROPERTIES.get(pattern[i + 2 : i + 5])
                ranged = in_class and (out[-1] == "-" or pattern[i + 5 : i + 6] == "-")
                if escape == "\\P" or members is None or ranged:
                    return None
                out.append(members if in_class else f"[{members}]")
                i += 5
                continue
            out.append(escape)
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            if pattern[i + 1 : i + 2] == "^":  # a negated class's ^ is its own
                out.append("[^")
                i += 2
                continue
        out.append(char)
        i += 1
    return "".join(out)


def _compiled(pattern: str) -> Any:
    """``pattern`` in ``re`` where ``_ascii_pattern`` writes it and ``re`` reads it, else in
    the ``regex`` module (which raises ``regex.error`` where it cannot read it either)."""
    ascii_pattern = _ascii_pattern(pattern)
    if ascii_pattern is not None:
        with warnings.catch_warnings():
            # ``re`` warns of what it may read otherwise one day (``--``, ``&&``, ``~~`` in a
            # class: set operations): such a pattern goes to the regex module
            warnings.simplefilter("error", FutureWarning)
            try:
                return re.compile(ascii_pattern)
            except (re.error, FutureWarning):
                pass
    return regex.compile(pattern)


def _matches_empty(split: Any) -> bool:
    """Whether the compiled pattern matches an empty string somewhere in a sample text."""
    sample = "".join((SAFE_CHARS, *CHECK_TEXTS))
    return any(m.end() == m.start() for m in split.finditer(sample)) or bool(split.match(""))


def _normalizer_ok(backend: Any) -> bool:
    """No normalizer, or one that leaves ASCII as it is (alone or in a ``Sequence``)."""
    if backend.normalizer is None:
        return True
    try:
        state = json.loads(backend.normalizer.__getstate__())
    except Exception:  # a custom (Python) normalizer: nothing is proven
        return False
    parts = state.get("normalizers") if state.get("type") == "Sequence" else [state]
    return parts is not None and all(part.get("type") in _ASCII_NEUTRAL for part in parts)


def _pattern_of(state: dict[str, Any]) -> str | None:
    """The split pattern of a pre-tokenizer (tokenizer.json state) this module handles."""
    kind = state.get("type")
    if kind == "ByteLevel":
        ok = state.get("add_prefix_space") is False and state.get("use_regex") is True
        return GPT2_PATTERN if ok else None
    if kind != "Sequence":
        return None
    parts = state.get("pretokenizers") or []
    if len(parts) != 2:
        return None
    split, byte_level = parts
    if not (
        split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and split.get("invert") is False
        and byte_level.get("type") == "ByteLevel"
        and byte_level.get("add_prefix_space") is False
        and byte_level.get("use_regex") is False
    ):
        return None
    pattern = split.get("pattern") or {}
    found = pattern.get("Regex")
    return found if isinstance(found, str) else None


class WordEncoder:
    """Encodes plain ASCII text pre-token by pre-token through a cache; see the module
    docstring. Build with ``for_backend``. ``canonical``: the int object to give for each id,
    made together by the caller, so that the cached words' tuples share them."""

    def __init__(
        self,
        backend: Any,
        pattern: str,
        canonical: list[int],
        max_words: int,
    ) -> None:
        self._split = _compiled(pattern)
        self._tokenize: Callable[[str], list[Any]] = backend.model.tokenize
        from tokenizers import pre_tokenizers

        mapped = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        ((chars, _),) = mapped.pre_tokenize_str(SAFE_CHARS)
        if len(chars) != len(SAFE_CHARS):
            raise ValueError("the ByteLevel map is not one character per ASCII byte")
        self._byte_level = str.maketrans(dict(zip(SAFE_CHARS, chars, strict=True)))
        added = backend.get_added_tokens_decoder().values()
        self._normalized_tokens = tuple(t.content for t in added if t.normalized and t.content)
        self._canonical = canonical
        self.max_words = max_words
        self._words: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    @classmethod
    def for_backend(cls, backend: Any, canonical: list[int], max_words: int) -> WordEncoder | None:
        """A ``WordEncoder`` for ``backend`` (a ``tokenizers.Tokenizer`` that ``PieceEncoder``
        already accepts), or None where the module docstring's conditions do not hold."""
        if max_words <= 0 or not _normalizer_ok(backend):
            return None
        if type(backend.model).__name__ != "BPE" or getattr(backend.model, "dropout", None):
            return None
        if backend.pre_tokenizer is None:
            return None
        try:
            state = json.loads(backend.pre_tokenizer.__getstate__())
        except Exception:  # a custom (Python) pre-tokenizer: nothing is proven
            return None
        pattern = _pattern_of(state)
        if pattern is None or not _portable(pattern):
            return None
        try:
            words = cls(backend, pattern, canonical, max_words)
        except (regex.error, ValueError):  # a pattern the regex module cannot read
            return None
        if _matches_empty(words._split):
            return None
        for text in CHECK_TEXTS:
            theirs = backend.encode(text, add_special_tokens=False).ids
            if words.encode(text) != theirs:
                return None
        words.clear()
        return words

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids (no special tokens added), or None when it holds a character outside
        ``SAFE_CHARS`` or a normalized added token (the caller encodes it whole)."""
        if _UNSAFE.search(text) is not None:
            return None
        if self._normalized_tokens and any(t in text for t in self._normalized_tokens):
            return None
        # findall gives the whole matches only for a pattern without capturing groups
        splits: list[str] = self._split.findall(text) if not self._split.groups else []
        if sum(map(len, splits)) != len(text):  # gaps between matches are splits too
            splits = self._splits_with_gaps(text)
        cache = self._words
        found = list(map(cache.get, splits))
        if None in found:
            found = [
                ids if ids is not None else self._miss(split)
                for split, ids in zip(splits, found, strict=True)
            ]
        return list(chain.from_iterable(found))  # type: ignore[arg-type]

    def _splits_with_gaps(self, text: str) -> list[str]:
        out: list[str] = []
        end = 0
        for match in self._split.finditer(text):
            if match.start() > end:
                out.append(text[end : match.start()])
            if match.end() > match.start():
                out.append(match.group())
            end = match.end()
        if end < len(text):
            out.append(text[end:])
        return out

    def _miss(self, split: str) -> tuple[int, ...]:
        tokens = self._tokenize(split.translate(self._byte_level))
        canonical = self._canonical
        ids = tuple(canonical[t.id] if t.id < len(canonical) else t.id for t in tokens)
        if len(split) <= MAX_WORD_CHARS:
            cache = self._words
            cache[split] = ids
            if len(cache) > self.max_words:
                cache.popitem(last=False)
        return ids

    def __len__(self) -> int:
        return len(self._words)

    def clear(self) -> None:
        self._words.clear()
