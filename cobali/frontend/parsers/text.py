"""Where a stream must stop sending (at the tail that may still grow into one of some tokens), and where a run
of characters ends."""

from __future__ import annotations

import re
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


def run_end(run: re.Pattern[str], text: str, at: int) -> int:
    """Where `run` (a pattern that may match no character, such as `\\s*`) ends, matched at `at`."""
    match = run.match(text, at)
    assert match is not None, run.pattern
    return match.end()
