"""Incremental detokenization with stop strings, and when a request's text is handed on.

Token pieces are bytes that may split a UTF-8 character, so they go through an incremental decoder.
Text that could still become a stop string is held back, so a stop string is never emitted.
"""

from __future__ import annotations

import codecs


class TextStream:
    """One request's output text. The engine pushes the bytes of output tokens `decoded` and on, as late as it
    can: each token where stop strings must be checked, else only when text is due (every `interval` tokens
    for a streamed request, the first text at once) or at the end."""

    def __init__(self, stop: tuple[str, ...] = (), interval: int = 1, min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        assert interval >= 1, interval
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        # As vLLM: stop strings count once min_tokens are out, where they end in the text of the token that made it
        # so or later (one may start in the characters before it), never wholly in text that came before.
        self._min_tokens = min_tokens
        self._stop_end_from = 0  # where that token's text starts
        self._include_stop = include_stop
        self.stop_hit: str | None = None  # the stop string that ended the text
        self.interval = interval
        self.decoded = 0  # output tokens whose bytes are in the text
        self.sent_at = 0  # output tokens when text was last taken (0: none yet)
        self._text = ""
        self._emitted = 0

    @property
    def text(self) -> str:
        return self._text

    @property
    def checks_each_token(self) -> bool:
        return bool(self._stop)

    def is_due(self, n_tokens: int) -> bool:
        """Is text owed to a reader, with n_tokens of output so far?"""
        return self.sent_at == 0 or n_tokens - self.sent_at >= self.interval

    def push(self, piece: bytes, decoded: int | None = None) -> bool:
        """Add tokens' bytes (decoded: the output tokens in the text with them); True when a stop string was hit
        (the text ends before it)."""
        was_short, before = self.decoded < self._min_tokens, len(self._text)
        if decoded is not None:
            self.decoded = decoded
        self._text += self._decoder.decode(piece)
        if self._stop and self.decoded >= self._min_tokens:
            if was_short:
                self._stop_end_from = before
            hit = self._first_stop()
            if hit is not None:
                cut, self.stop_hit = hit
                self._text = self._text[: cut + (len(self.stop_hit) if self._include_stop else 0)]
                return True
        return False

    def take(self, n_tokens: int) -> str:
        """The text now safe to emit, not emitted before; a non-empty take restarts the interval."""
        delta = self._release(len(self._text) - self._held_back())
        if delta:
            self.sent_at = n_tokens
        return delta

    def close(self, stopped: bool) -> str:
        """End of output: the rest of the text is final (after a stop string, the decoder's partial bytes
        belong to text that was cut)."""
        if not stopped:
            self._text += self._decoder.decode(b"", final=True)
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _first_stop(self) -> tuple[int, str] | None:
        """Where the first stop string in the text starts, and which it is (the first listed, of those there)."""
        # A stop string can only complete in the text added since the last emitted character (and, each by its own
        # length, from min_tokens' token on: a short one may lie wholly in the window of a longer one).
        end_from = max(self._stop_end_from, self._emitted)
        hits = [(i, s) for s in self._stop if (i := self._text.find(s, max(0, end_from - len(s) + 1))) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

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
