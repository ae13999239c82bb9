"""``PieceEncoder``: a rendered chat encoded piece by piece, each piece's ids kept in a bounded LRU
cache, so that a conversation's next request encodes only its new turns.

A chat template writes a control token (an added token: ``<|im_start|>``, ``[INST]``,
``<start_of_turn>``) at every turn. Cut the text right before each one and the pieces encode
independently, with ids IDENTICAL to encoding the whole text, when the tokenizer is one whose
pipeline is proven to work split by split (``control_tokens`` checks it, from the tokenizer's
own description; where it cannot, it returns None and the caller encodes the whole text):

1. The tokenizers library first finds the added tokens whose ``normalized`` is false, in the raw
   text, leftmost-longest and without overlaps (``AddedVocabulary::extract_and_normalize``), and
   splits the text at them. A cut at the start of such a match leaves both sides with the same
   matches: the match at the cut is found again from the cut (it is the leftmost one there and
   the same text follows), and no match crosses the cut. ``PieceEncoder`` finds exactly
   those matches (the literals longest first, so Python's leftmost-first alternation is
   leftmost-longest), and only if no such token has ``lstrip``, ``rstrip`` or ``single_word``
   (they move or veto a match by looking at its neighbours) and special tokens are split out
   (``encode_special_tokens`` off).
2. Everything after works on one split at a time, and from the split's text alone: the
   normalizer, the normalized added tokens, the pre-tokenizer and the model, each of a type
   listed below (a BPE without dropout). The one thing a split may know beyond its text is
   whether it starts the input (``Metaspace``'s ``prepend_scheme: "first"`` adds its ``▁``
   only there): the first piece starts the input both alone and in the whole text, and every
   other piece starts with its control token, so its text split never does.
3. With ``add_special_tokens=False`` (the template wrote them) the post-processors listed below
   add nothing (no BOS), and truncation and padding must be off.

Pieces are cached by their text (a piece starting with a control token can never equal a first
piece, which starts with none), recently used last; the cache holds at most ``max_tokens`` ids.
Ids are kept as read-only ``uint32`` arrays (4 bytes an id, plus ~100 bytes a piece and its
text's share), and a request's ids are one ``numpy.concatenate`` of its prefix's array and its
pieces' (``encode_words``): no Python int per id. Lists of one int object per id made a 4k-id
request touch 4k scattered objects to copy them (their reference counts), twice, and the
router then converted the list back to an array for the hasher: in ``kvmesh bench router``'s
chat case the tokenizing took 155 µs and the hash 63, against 124 and 25 with the arrays.
``encode`` gives a list for the callers that need one.

A piece the cache lacks is encoded by the tokenizers library, or, when its text after its
control token is plain ASCII and the tokenizer a byte-level BPE where that is proven the same,
word by word through ``app.chat.words`` (a cache of each word's ids, ``max_tokens //
WORD_IDS`` words): the library spends most of a new turn's time splitting it into words, not in
the BPE. The control token's own id comes first, as the library splits the text at it first.

A request's whole prefix is remembered too: its text up to its last cut (in a chat, up to the
generation prompt, which the next request replaces with the reply) and those ids, keyed by the
cut and the ``KEY_CHARS`` before it. The next request looks among its last ``PREFIX_CUTS``
control tokens for a remembered prefix and starts from it, so it neither scans nor looks up
the conversation's earlier pieces. Starting at an earlier request's cut ``c`` is exact when
the new text equals that request's text up to ``c`` (``startswith``), holds a control token at
``c``, and no control token in it crosses ``c``: then the scan of the new text finds the same
matches before ``c`` as the earlier one (each was leftmost-longest among more candidates) and
none between the last of them and ``c``, so it finds a match at ``c``, a cut of the new text.
The prefixes hold up to ``PREFIX_FACTOR * max_tokens`` ids (an array of their own each: about
7 bytes an id with its text); a prefix a longer one of the same conversation replaces is
dropped.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from app.chat.words import WordEncoder

__all__ = [
    "DEFAULT_CACHE_TOKENS",
    "PieceCacheInfo",
    "PieceEncoder",
    "U32Array",
    "control_tokens",
    "words_of",
]

DEFAULT_CACHE_TOKENS = 1 << 18
PREFIX_FACTOR = 4
KEY_CHARS = 32
PREFIX_CUTS = 16  # a new request adds at most this many control tokens to find its prefix
PREFIX_WINDOWS = (1_024, 16_384)  # ... within this many characters of its end, nearest first
WORD_IDS = 4  # the word cache holds max_tokens // WORD_IDS words (a word is 1 to 3 ids, mostly)

U32Array = npt.NDArray[np.uint32]
_NO_IDS: U32Array = np.zeros(0, dtype=np.uint32)


def words_of(ids: Sequence[int]) -> U32Array:
    """``ids`` as a uint32 array (through ``array``: a C loop, where ``np.array`` of a list
    inspects every element's type first)."""
    return np.frombuffer(array("I", ids), dtype=np.uint32)


def _frozen(ids: list[int]) -> U32Array:
    out = words_of(ids)
    out.flags.writeable = False  # shared by every request that holds the piece
    return out


# Components that transform each split from its text alone (``Metaspace``: and from whether it
# starts the input; see the module docstring), by their ``type`` in tokenizer.json.
_NORMALIZERS = frozenset(
    {
        *("BertNormalizer", "Strip", "StripAccents", "NFC", "NFD", "NFKC", "NFKD"),
        *("Lowercase", "Nmt", "Precompiled", "Replace", "Prepend", "ByteLevel"),
    }
)
_PRE_TOKENIZERS = frozenset(
    {
        *("BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Metaspace", "Whitespace"),
        *("WhitespaceSplit", "Split", "Punctuation", "Digits", "UnicodeScripts"),
    }
)
_POST_PROCESSORS = frozenset(
    {"ByteLevel", "TemplateProcessing", "BertProcessing", "RobertaProcessing"}
)
_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})
_SEQUENCE_KEYS = {"normalizers", "pretokenizers", "processors"}


def _component_ok(component: Any, allowed: frozenset[str]) -> bool:
    """Is this tokenizer.json component (a dict, or None) made only of ``allowed`` types?"""
    if component is None:
        return True
    try:
        state = json.loads(component.__getstate__())
    except Exception:  # a custom (Python) component cannot say what it is: nothing is proven
        return False
    return _state_ok(state, allowed)


def _state_ok(state: Any, allowed: frozenset[str]) -> bool:
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        parts = next((state[key] for key in _SEQUENCE_KEYS if key in state), None)
        return parts is not None and all(_state_ok(part, allowed) for part in parts)
    return kind in allowed


def control_tokens(backend: Any) -> tuple[str, ...] | None:
    """The added tokens before which ``backend`` (a ``tokenizers.Tokenizer``) can be cut into
    independently encoded pieces; None when that is not proven for it."""
    if backend.encode_special_tokens or backend.truncation or backend.padding:
        return None
    model = backend.model
    if type(model).__name__ not in _MODELS or getattr(model, "dropout", None):
        return None
    if not (
        _component_ok(backend.normalizer, _NORMALIZERS)
        and _component_ok(backend.pre_tokenizer, _PRE_TOKENIZERS)
        and _component_ok(backend.post_processor, _POST_PROCESSORS)
    ):
        return None
    raw = [t for t in backend.get_added_tokens_decoder().values() if not t.normalized]
    if not raw or any(t.lstrip or t.rstrip or t.single_word or not t.content for t in raw):
        return None
    return tuple(sorted({t.content for t in raw}, key=lambda t: (-len(t), t)))


@dataclass(frozen=True, slots=True)
class PieceCacheInfo:
    """The cache's counters since it was made (pieces found and encoded, characters encoded,
    by the tokenizer or word by word, requests that started from a remembered prefix) and what
    it holds."""

    hits: int
    misses: int
    encoded_chars: int
    prefix_hits: int
    pieces: int
    tokens: int
    max_tokens: int
    prefixes: int
    prefix_tokens: int


def _key(text: str, cut: int) -> tuple[int, str]:
    """A remembered prefix's key: where it ends, and the ``KEY_CHARS`` before."""
    return cut, text[max(0, cut - KEY_CHARS) : cut]


@dataclass(frozen=True, slots=True)
class _Prefix:
    """A request's text up to one of its cuts (``len(text)``), and that text's ids."""

    text: str
    ids: U32Array


class PieceEncoder:
    """Encodes rendered chats piece by piece through an LRU of piece ids, from a remembered
    prefix where one is found; see the module docstring. ``tokens``: ``control_tokens``'
    answer; ``max_tokens`` bounds the ids the pieces hold (0: none are kept, nor prefixes)."""

    def __init__(self, backend: Any, tokens: tuple[str, ...], max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if not tokens or not all(tokens):
            raise ValueError("control tokens must be non-empty strings")
        self._encode = backend.encode
        # a new piece's text after its control token, word by word where proven the same; its
        # cached words share one int object per id, made together
        vocab = backend.get_vocab(with_added_tokens=True).values()
        canonical = list(range(max(vocab, default=-1) + 1))
        self._words = WordEncoder.for_backend(backend, canonical, max_tokens // WORD_IDS)
        self._token_ids = {token: backend.token_to_id(token) for token in tokens}
        # longest first: Python's leftmost-first alternation is then leftmost-longest
        literals = sorted(set(tokens), key=lambda t: (-len(t), t))
        self._boundary = re.compile("|".join(re.escape(literal) for literal in literals))
        self._longest = len(literals[0])
        self._first_chars = frozenset(literal[0] for literal in literals)
        self.max_tokens = max_tokens
        self.max_prefix_tokens = PREFIX_FACTOR * max_tokens
        self._pieces: OrderedDict[str, U32Array] = OrderedDict()
        self._num_tokens = 0  # == sum of len(ids) over self._pieces
        self._prefixes: OrderedDict[tuple[int, str], _Prefix] = OrderedDict()
        self._num_prefix_tokens = 0  # == sum of len(prefix.ids) over self._prefixes
        self._hits = self._misses = self._encoded_chars = self._prefix_hits = 0
        self._lock = threading.Lock()  # a router may encode from more than one thread

    def encode(self, text: str) -> list[int]:
        """``encode_words`` as a list."""
        ids: list[int] = self.encode_words(text).tolist()
        return ids

    def encode_words(self, text: str) -> U32Array:
        """``text``'s ids (no special tokens added), a new array: a remembered prefix's, then
        its pieces'."""
        with self._lock:
            prefix = self._take_prefix(text)
            parts: list[U32Array] = []
            start = 0
            if prefix is not None:
                parts.append(prefix.ids)
                start = len(prefix.text)
                self._prefix_hits += 1
            last_cut = self._add_pieces(text, start, parts)
            ids = np.concatenate(parts) if parts else _NO_IDS.copy()
            if last_cut > start:  # a cut past the prefix it started from: its own prefix
                kept = ids[: len(ids) - len(parts[-1])].copy()  # all but the last piece's
                kept.flags.writeable = False
                prefix = _Prefix(text[:last_cut], kept)
            if prefix is not None:
                self._keep_prefix(prefix)
        return ids

    def _take_prefix(self, text: str) -> _Prefix | None:
        """The longest remembered prefix ``text`` can start from (the module docstring says
        when it can), among its last ``PREFIX_CUTS`` control tokens, taken out of the LRU."""
        if not self._prefixes:
            return None
        looked = 0
        end = len(text)  # the cuts from here on were looked at
        for size in PREFIX_WINDOWS:
            low = max(0, len(text) - size)
            high = min(len(text), end + self._longest)  # a token across ``end`` too
            starts = [match.start() for match in self._boundary.finditer(text, low, high)]
            for cut in reversed(starts):
                if cut >= end:
                    continue
                key = _key(text, cut)
                prefix = self._prefixes.get(key)
                exact = prefix is not None and text.startswith(prefix.text)
                if exact and self._uncrossed(text, cut):
                    taken = self._prefixes.pop(key)
                    self._num_prefix_tokens -= len(taken.ids)
                    return taken
                looked += 1
                if looked == PREFIX_CUTS:
                    return None
            if low == 0:
                return None
            end = low
        return None

    def _uncrossed(self, text: str, cut: int) -> bool:
        """Does no control token in ``text`` start before ``cut`` and end after it?"""
        match_at = self._boundary.match
        for start in range(max(0, cut - self._longest + 1), cut):
            if text[start] in self._first_chars:
                found = match_at(text, start)  # the longest token there
                if found is not None and found.end() > cut:
                    return False
        return True

    def _add_pieces(self, text: str, start: int, parts: list[U32Array]) -> int:
        """Append the ids of ``text[start:]`` (``start``: 0 or a cut) to ``parts``, piece by
        piece; return where the last piece starts (``start`` when it has no cut)."""
        cuts = [match.start() for match in self._boundary.finditer(text, start)]
        cuts.append(len(text))
        get, move_to_end = self._pieces.get, self._pieces.move_to_end
        num_pieces = num_misses = encoded_chars = 0
        last_cut = start
        for end in cuts:
            if end == start:  # the text, or its tail, starts with a control token
                continue
            piece = text[start:end]
            last_cut, start = start, end
            num_pieces += 1
            found = get(piece)
            if found is None:
                found = self._miss(piece)
                num_misses += 1
                encoded_chars += len(piece)
            else:
                move_to_end(piece)
            parts.append(found)
        self._hits += num_pieces - num_misses
        self._misses += num_misses
        self._encoded_chars += encoded_chars
        return last_cut

    def _encode_words(self, piece: str) -> list[int] | None:
        """The piece's ids through the ``WordEncoder``: its control token's id, then its text's
        (the library splits the text at the token first); None where it cannot."""
        words = self._words
        if words is None:
            return None
        token = self._boundary.match(piece)  # the cut's: the longest token there
        if token is None:  # the first piece
            return words.encode(piece)
        ids = words.encode(piece[token.end() :])
        return None if ids is None else [self._token_ids[token.group()], *ids]

    def _miss(self, piece: str) -> U32Array:
        """Encode a piece the cache lacks, and keep it (unless empty or over the bound)."""
        listed = self._encode_words(piece)
        if listed is None:
            listed = self._encode(piece, add_special_tokens=False).ids
        ids = _frozen(listed)
        if len(ids) and len(ids) <= self.max_tokens:  # an empty piece would cost nothing, ever
            self._pieces[piece] = ids
            self._num_tokens += len(ids)
            while self._num_tokens > self.max_tokens:
                _, dropped = self._pieces.popitem(last=False)
                self._num_tokens -= len(dropped)
        return ids

    def _keep_prefix(self, prefix: _Prefix) -> None:
        """Remember ``prefix`` as the most recently used (unless over the bound)."""
        if len(prefix.ids) > self.max_prefix_tokens:
            return
        key = _key(prefix.text, len(prefix.text))
        old = self._prefixes.pop(key, None)
        if old is not None:
            self._num_prefix_tokens -= len(old.ids)
        self._prefixes[key] = prefix
        self._num_prefix_tokens += len(prefix.ids)
        while self._num_prefix_tokens > self.max_prefix_tokens:
            _, dropped = self._prefixes.popitem(last=False)
            self._num_prefix_tokens -= len(dropped.ids)

    def info(self) -> PieceCacheInfo:
        with self._lock:
            return PieceCacheInfo(
                hits=self._hits,
                misses=self._misses,
                encoded_chars=self._encoded_chars,
                prefix_hits=self._prefix_hits,
                pieces=len(self._pieces),
                tokens=self._num_tokens,
                max_tokens=self.max_tokens,
                prefixes=len(self._prefixes),
                prefix_tokens=self._num_prefix_tokens,
            )

    def clear(self) -> None:
        """Forget every piece and prefix (the counters stay)."""
        with self._lock:
            self._pieces.clear()
            self._prefixes.clear()
            if self._words is not None:
                self._words.clear()
            self._num_tokens = self._num_prefix_tokens = 0
