"""Where a stream must stop sending: at the first of some tokens, or at the tail that may still grow into one."""

from __future__ import annotations

from collections.abc import Iterable


def held_tail(text: str, tokens: Iterable[str], start: int = 0) -> int:
    """The length of the longest end of `text[start:]` that is the beginning of one of `tokens` (not a whole one):
    the part a stream holds until the next piece says whether the token is there."""
    longest = 0
    for token in tokens:
        for size in range(min(len(token) - 1, len(text) - start), longest, -1):
            if text.endswith(token[:size]):
                longest = size
                break
    return longest


def first_of(text: str, tokens: Iterable[str], start: int = 0) -> tuple[int, str] | None:
    """Where the earliest of `tokens` starts in `text` from `start`, and which one (the longest, where two start
    at the same place)."""
    found: tuple[int, str] | None = None
    for token in tokens:
        at = text.find(token, start)
        if at >= 0 and (found is None or at < found[0] or (at == found[0] and len(token) > len(found[1]))):
            found = (at, token)
    return found
