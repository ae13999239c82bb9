"""Generated ids to text as they come, without decoding the whole output at every step.

A stream that decoded ``job.output`` in full at each step did O(n) work per token: O(n²) over an
answer. ``IncrementalText`` decodes a small window instead, as vLLM's
``detokenize_incrementally`` does: the ids from ``prefix`` (the ids of the last text sent, as
context, so that a tokenizer that spells a word's leading space or merges bytes across ids
sees them) to the end, against the same window without the new ids; the difference is the
new text. It moves on only when the window's text does not end in U+FFFD (a byte-fallback
tokenizer's partial UTF-8 sequence, which later ids complete), so that no half character is
ever part of ``text``.

``text`` equals ``tokenizer.decode(ids)`` of the ids taken so far, up to the held partial
character (``tests/chat/test_detokenize.py`` checks it on every test tokenizer); ``final()``
decodes whatever is still held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalText"]


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalText:
    """The text of a growing list of ids; see the module docstring."""

    __slots__ = ("_decoder", "_ids", "_prefix", "_read", "text")

    def __init__(self, decoder: _Decoder) -> None:
        self._decoder = decoder
        self._ids: list[int] = []
        self._prefix = 0  # the window's first id
        self._read = 0  # ids before this one are in ``text``
        self.text = ""

    def update(self, ids: Sequence[int]) -> str:
        """Take the ids of ``ids`` beyond those taken before (``ids`` is the whole output so
        far, as a job holds it); the text so far, a trailing partial character held back."""
        taken = len(self._ids)
        if len(ids) <= taken:
            return self.text
        self._ids.extend(ids[taken:])
        window = self._ids[self._prefix :]
        before = self._decoder.decode(self._ids[self._prefix : self._read])
        after = self._decoder.decode(window)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            # The new window starts where the last text ended whole: never inside a run of
            # byte ids (a byte-fallback decoder turns a run that is not valid UTF-8 from its
            # start into one U+FFFD per byte, so a window cut inside one would never end whole).
            self._prefix = self._read
            self._read = len(self._ids)
        return self.text

    def final(self) -> str:
        """All the text, a partial character at the end included (the answer is over)."""
        if self._read < len(self._ids):
            before = self._decoder.decode(self._ids[self._prefix : self._read])
            after = self._decoder.decode(self._ids[self._prefix :])
            self.text += after[len(before) :]
            self._read = len(self._ids)
        return self.text
