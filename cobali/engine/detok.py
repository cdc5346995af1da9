"""Incremental detokenization with stop strings.

Token pieces are bytes that may split a UTF-8 character, so they go through an incremental decoder.
Text that could still become a stop string is held back, so a stop string is never emitted.
"""

from __future__ import annotations

import codecs


class TextStream:
    """live=False: the owner pushes all the text at the end instead of token by token (nobody streams it)."""

    def __init__(self, stop: tuple[str, ...] = (), live: bool = True) -> None:
        self.live = live
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._text = ""
        self._emitted = 0

    @property
    def text(self) -> str:
        return self._text

    def push(self, piece: bytes) -> tuple[str, bool]:
        """Add a token's bytes. Returns (text now safe to emit, whether a stop string was hit)."""
        self._text += self._decoder.decode(piece)
        if self._stop:
            cut = self._first_stop()
            if cut is not None:
                self._text = self._text[:cut]
                return self._release(cut), True
        return self._release(len(self._text) - self._held_back()), False

    def flush(self) -> str:
        """End of output: whatever was held back is final text."""
        self._text += self._decoder.decode(b"", final=True)
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _first_stop(self) -> int | None:
        # A stop string can only complete in the text added since the last emitted character.
        longest = max(map(len, self._stop))
        start = max(0, self._emitted - longest + 1)
        hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        tail = self._text[self._emitted :]
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(tail)), best, -1):
                if tail.endswith(stop[:k]):
                    best = k
                    break
        return best
