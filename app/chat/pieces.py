"""``PieceEncoder``: a rendered chat encoded piece by piece, each piece's ids kept in a bounded LRU
cache, so that a conversation's next request encodes only its new turns.

A chat template writes a control token (an added token: ``<|im_start|>``, ``[INST]``,
``<start_of_turn>``) at every turn. Cut the text right before each one and the pieces encode
independently, with ids IDENTICAL to encoding the whole text, when the tokenizer is one whose
pipeline is proven to work split by split (``boundary_pattern`` checks it, from the tokenizer's
own description; where it cannot, it returns None and the caller encodes the whole text):

1. The tokenizers library first finds the added tokens whose ``normalized`` is false, in the raw
   text, leftmost-longest and without overlaps (``AddedVocabulary::extract_and_normalize``), and
   splits the text at them. A cut at the start of such a match leaves both sides with the same
   matches: the match at the cut is found again from the cut (it is the leftmost one there and
   the same text follows), and no match crosses the cut. ``boundary_pattern`` finds exactly
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
piece, which starts with none), recently used last; the cache holds at most ``max_tokens`` ids
(about 45 bytes each with its share of the text on CPython: 2**18 ids, about 12 MB).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_CACHE_TOKENS", "PieceCacheInfo", "PieceEncoder", "boundary_pattern"]

DEFAULT_CACHE_TOKENS = 1 << 18

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


def boundary_pattern(backend: Any) -> re.Pattern[str] | None:
    """The added tokens before which ``backend`` (a ``tokenizers.Tokenizer``) can be cut into
    independently encoded pieces, as one pattern; None when that is not proven for it."""
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
    literals = sorted({t.content for t in raw}, key=len, reverse=True)
    return re.compile("|".join(re.escape(literal) for literal in literals))


@dataclass(frozen=True, slots=True)
class PieceCacheInfo:
    """The cache's counters since it was made: pieces found and encoded, characters sent to the
    tokenizer, and what it holds."""

    hits: int
    misses: int
    encoded_chars: int
    pieces: int
    tokens: int
    max_tokens: int


class PieceEncoder:
    """Encodes rendered chats piece by piece through an LRU of piece ids; see the module
    docstring. ``max_tokens`` bounds the ids held (0: nothing is kept)."""

    def __init__(self, backend: Any, boundary: re.Pattern[str], max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self._encode = backend.encode
        self._boundary = boundary
        self.max_tokens = max_tokens
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._num_tokens = 0  # == sum of len(ids) over self._pieces
        self._hits = self._misses = self._encoded_chars = 0
        self._lock = threading.Lock()  # a router may encode from more than one thread

    def encode(self, text: str) -> list[int]:
        """``text``'s ids (no special tokens added): those of its pieces, in order."""
        cuts = [match.start() for match in self._boundary.finditer(text)]
        cuts.append(len(text))
        ids: list[int] = []
        get, move_to_end = self._pieces.get, self._pieces.move_to_end
        num_pieces = num_misses = encoded_chars = start = 0
        with self._lock:
            for end in cuts:
                if end == start:  # the text starts with a control token
                    continue
                piece = text[start:end]
                start = end
                num_pieces += 1
                found = get(piece)
                if found is None:
                    found = self._miss(piece)
                    num_misses += 1
                    encoded_chars += len(piece)
                else:
                    move_to_end(piece)
                ids += found
            self._hits += num_pieces - num_misses
            self._misses += num_misses
            self._encoded_chars += encoded_chars
        return ids

    def _miss(self, piece: str) -> list[int]:
        """Encode a piece the cache lacks, and keep it (unless empty or over the bound)."""
        ids: list[int] = self._encode(piece, add_special_tokens=False).ids
        if ids and len(ids) <= self.max_tokens:  # an empty piece would cost nothing, forever
            self._pieces[piece] = ids
            self._num_tokens += len(ids)
            while self._num_tokens > self.max_tokens:
                _, dropped = self._pieces.popitem(last=False)
                self._num_tokens -= len(dropped)
        return ids

    def info(self) -> PieceCacheInfo:
        with self._lock:
            return PieceCacheInfo(
                hits=self._hits,
                misses=self._misses,
                encoded_chars=self._encoded_chars,
                pieces=len(self._pieces),
                tokens=self._num_tokens,
                max_tokens=self.max_tokens,
            )

    def clear(self) -> None:
        """Forget every piece (the counters stay)."""
        with self._lock:
            self._pieces.clear()
            self._num_tokens = 0
