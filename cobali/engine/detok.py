"""Incremental detokenization with stop strings, and when a request's text is handed on.

Token pieces are bytes that may split a UTF-8 character, so they go through an incremental decoder.
Text that could still become a stop string is held back, so a stop string is never emitted.

A token's work is bounded by its own text and the longest stop string, never by the text so far: the text is
kept in pieces (one string grown by += would be copied whole every token), stop strings are looked for only
where they can end in the new text, and what is held back is read from the text's last characters.
"""

from __future__ import annotations

import codecs


def _last(text: str, k: int) -> str:
    """The last k characters (none for k <= 0, where text[-0:] would be all of it)."""
    return text[max(0, len(text) - k):] if k > 0 else ""


class TextStream:
    """One request's output text. The engine pushes the bytes of output tokens `decoded` and on, as late as it
    can: each token where stop strings must be checked, else only when text is due (every `interval` tokens
    for a streamed request, the first text at once) or at the end."""

    def __init__(self, stop: tuple[str, ...] = (), interval: int = 1, min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        assert interval >= 1, interval
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = stop
        self._reach = max(map(len, stop), default=1) - 1  # characters of old text a stop string can reach back
        # Each stop string's proper-prefix lengths by their last character, longest first: what may be held back.
        self._prefix_ends: list[dict[str, list[int]]] = [_prefix_ends(s) for s in stop]
        # As vLLM: stop strings count once min_tokens are out, where they end in the text of the token that made it
        # so or later (one may start in the characters before it), never wholly in text that came before.
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self.stop_hit: str | None = None  # the stop string that ended the text
        self.interval = interval
        self.decoded = 0  # output tokens whose bytes are in the text
        self.sent_at = 0  # output tokens when text was last taken (0: none yet)
        self._parts: list[str] = []  # the text
        self._joined: str | None = ""  # the parts joined, until more come
        self._length = 0
        self._tail = ""  # the text's last `_reach` characters
        self._fresh: list[str] = []  # the text not emitted yet, in pieces
        self._emitted = 0

    @property
    def text(self) -> str:
        if self._joined is None:
            self._joined = "".join(self._parts)
            self._parts = [self._joined]
        return self._joined

    @property
    def checks_each_token(self) -> bool:
        return bool(self._stop)

    def is_due(self, n_tokens: int) -> bool:
        """Is text owed to a reader, with n_tokens of output so far?"""
        return self.sent_at == 0 or n_tokens - self.sent_at >= self.interval

    def push(self, piece: bytes, decoded: int | None = None) -> bool:
        """Add tokens' bytes (decoded: the output tokens in the text with them); True when a stop string was hit
        (the text ends before it)."""
        if decoded is not None:
            self.decoded = decoded
        new = self._decoder.decode(piece)
        if not new:
            return False
        window = self._tail + new  # every stop string that ends in the new text starts in here
        before = self._length
        self._append(new)
        if self._stop and self.decoded >= self._min_tokens:
            hit = self._first_stop(window, len(self._tail))
            if hit is not None:
                at, self.stop_hit = hit
                self._cut(before - len(self._tail) + at + (len(self.stop_hit) if self._include_stop else 0))
                return True
        self._tail = _last(window, self._reach)
        return False

    def take(self, n_tokens: int) -> str:
        """The text now safe to emit, not emitted before; a non-empty take restarts the interval."""
        delta = self._release(self._length - self._held_back())
        if delta:
            self.sent_at = n_tokens
        return delta

    def close(self, stopped: bool) -> str:
        """End of output: the rest of the text is final (after a stop string, the decoder's partial bytes
        belong to text that was cut)."""
        if not stopped:
            self._append(self._decoder.decode(b"", final=True))
        return self._release(self._length)

    def _append(self, new: str) -> None:
        if new:
            self._parts.append(new)
            self._fresh.append(new)
            self._length += len(new)
            self._joined = None

    def _cut(self, end: int) -> None:
        """The text ends at `end` (a stop string's start, or its end with include_stop)."""
        text = self.text[:end]
        self._parts, self._joined, self._length = [text], text, end
        self._fresh = [text[self._emitted:]]

    def _release(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        fresh = "".join(self._fresh)
        delta, rest = fresh[: end - self._emitted], fresh[end - self._emitted:]
        self._fresh = [rest] if rest else []
        self._emitted = end
        return delta

    def _first_stop(self, window: str, new_from: int) -> tuple[int, str] | None:
        """Where in `window` the first stop string ending after `new_from` starts, and which it is (the first
        listed, of those there). One ending earlier was looked for when its own text came, or lay wholly before
        min_tokens' token."""
        hits = [(i, s) for s in self._stop if (i := window.find(s, max(0, new_from - len(s) + 1))) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the unemitted text that is a proper prefix of some stop string."""
        tail = _last(self._tail, self._length - self._emitted)
        if not tail:
            return 0
        best = 0
        for stop, ends in zip(self._stop, self._prefix_ends, strict=True):
            for k in ends.get(tail[-1], ()):  # only prefixes ending in the text's last character can match
                if k <= best:
                    break
                if k <= len(tail) and tail.endswith(stop[:k]):
                    best = k
                    break
        return best


def _prefix_ends(stop: str) -> dict[str, list[int]]:
    ends: dict[str, list[int]] = {}
    for k in range(len(stop) - 1, 0, -1):
        ends.setdefault(stop[k - 1], []).append(k)
    return ends
