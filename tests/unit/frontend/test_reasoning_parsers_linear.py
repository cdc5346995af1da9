"""Issue 44: every reasoning parser costs time linear in the reply, read whole or streamed, over replies made of
its own tags (openers, closers, every tag, partial tags, a run of spaces after an opener, whole messages back to
back). Checked three ways: what a stream keeps between feeds stays bounded (so a feed costs O(its text)); the
characters a parse copies into what it holds grow as the reply does, counted, not timed; and a reply four times
as long takes under eight times as long (linear: four; quadratic: sixteen), the best of three runs each. And the
parser benchmark (bench/parsers/linearity.py) runs, in its smallest setting, over every parser."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cobali.frontend.parsers.harmony import MAX_HEADER
from cobali.frontend.parsers.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream

ROOT = Path(__file__).resolve().parents[3]
PIECE = 4  # characters a streamed feed


def hostile(parser: ReasoningParser) -> dict[str, tuple[str, str]]:
    """Hostile replies from the parser's own tags: (a head written once, a unit repeated to the reply's size)."""
    tags = parser.special_tags
    opener, closer = tags[0], tags[1]
    return {"openers": ("", opener), "closers": ("", closer), "all tags": ("", "".join(tags)),
            "tag prefixes": ("", "".join(t[:-1] for t in tags)), "spaces": ("", " "), "opener, spaces": (opener, " "),
            "messages": ("", f"{opener}x{closer}"),
            "headers": ("", "<|channel|>analysis<|message|>x<|end|><|start|>assistant")}


CASES = [(name, case) for name, parser in REASONING_PARSERS.items() for case in hostile(parser)]


def reply(name: str, case: str, size: int) -> str:
    head, unit = hostile(REASONING_PARSERS[name])[case]
    return (head + unit * (size // len(unit) + 1))[:size]


def counted(stream: ReasoningStream) -> list[int]:
    """The length of every text the stream stores as what it holds, recorded as it stores it."""
    sizes: list[int] = []

    class Counting(type(stream)):  # type: ignore[misc]
        @property
        def held(self) -> str:
            return self.__dict__["held"]

        @held.setter
        def held(self, value: str) -> None:
            sizes.append(len(value))
            self.__dict__["held"] = value

    stream.__class__ = Counting
    return sizes


def read(name: str, text: str, streamed: bool) -> list[int]:
    """Read `text`, whole (one feed) or in PIECE-character pieces, and finish: the sizes `counted` saw."""
    stream = REASONING_PARSERS[name].stream()
    sizes = counted(stream)
    for piece in [text[at:at + PIECE] for at in range(0, len(text), PIECE)] if streamed else [text]:
        stream.feed(piece)
    stream.finish()
    return sizes


@pytest.mark.parametrize(("name", "case"), CASES)
def test_a_stream_keeps_no_more_than_a_header_between_feeds(name: str, case: str) -> None:
    """O(new text) a feed: what is kept is at most a header (gpt-oss) or a tag's beginning, and the new piece."""
    stream, text = REASONING_PARSERS[name].stream(), reply(name, case, 8192)
    kept = 0
    for at in range(0, len(text), PIECE):
        stream.feed(text[at:at + PIECE])
        kept = max(kept, len(stream.held))
    assert kept <= MAX_HEADER + PIECE, (name, case, kept)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("name", "case"), CASES)
def test_what_a_parse_copies_grows_as_the_reply_does(name: str, case: str, streamed: bool) -> None:
    small, large = (sum(read(name, reply(name, case, size), streamed)) for size in (4096, 16384))
    assert large <= 5 * small + MAX_HEADER, (name, case, small, large)  # linear: 4; quadratic: 16


def best_of_three(runs: list[Callable[[], object]]) -> list[float]:
    """Each run's best time of three, the runs taking turns, in this thread's CPU time: a slow moment of the machine
    hits them alike, and time the thread waits preempted is not counted."""
    best = [float("inf")] * len(runs)
    for _ in range(3):
        for i, run in enumerate(runs):
            start = time.thread_time()
            run()
            best[i] = min(best[i], time.thread_time() - start)
    return best


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("name", "case"), CASES)
def test_four_times_the_reply_takes_under_eight_times_as_long(name: str, case: str, streamed: bool) -> None:
    small, large = (32768, 131072) if not streamed else (8192, 32768)  # a stream's feeds cost more per character
    texts = [reply(name, case, size) for size in (small, large)]
    times = best_of_three([functools.partial(read, name, text, streamed) for text in texts])
    assert times[1] <= 8 * times[0] + 0.005, (name, case, times)  # 5 ms: the timer's and the machine's noise


def test_the_parser_benchmark_runs_over_every_parser() -> None:
    run = subprocess.run([sys.executable, "bench/parsers/linearity.py", "--smoke"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and not line.startswith("| parser")]
    assert {row.split(" | ")[0].removeprefix("| ").split("/")[1] for row in rows if "reasoning/" in row} == set(
        REASONING_PARSERS)
    assert all(row.endswith(" linear |") for row in rows), run.stdout
