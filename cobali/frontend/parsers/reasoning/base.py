"""What every reasoning parser is: a stream fed the reply's text, handing back its reasoning and its content as
they come; a whole reply is one feed and the finish."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

from cobali.frontend.parsers.stream import read_whole


class ReasoningDelta(NamedTuple):
    reasoning: str = ""
    content: str = ""


class ReasoningStream(ABC):
    def __init__(self) -> None:
        self.held = ""  # text fed and not yet handed back

    def feed(self, delta: str) -> ReasoningDelta:
        self.held += delta
        return self._advance(final=False)

    def finish(self) -> ReasoningDelta:
        """The rest, once the reply has ended."""
        return self._advance(final=True)

    @abstractmethod
    def _advance(self, final: bool) -> ReasoningDelta:
        """Hand back what `held` can give now; everything when `final`. Model output is hostile: `held` is read
        once, forward, and what is kept in it for the next feed is bounded (a tag's beginning, a short header),
        so that a feed costs O(its text) and a whole reply O(its length)."""


class ReasoningParser(ABC):
    name: str

    @property
    @abstractmethod
    def special_tags(self) -> tuple[str, ...]:
        """The tags it reads (`<think>`): where a model's vocabulary holds one as a control token, which llama.cpp
        shows as no text, the server keeps its text in the reply (SamplingParams.preserved_tokens)."""

    @abstractmethod
    def stream(self, prompt: str = "") -> ReasoningStream:
        """A stream for a reply to `prompt` (the rendered prompt tells whether the reply starts inside a think
        block its template opened; '' where it is not known)."""

    def parse(self, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """(the reasoning, the content) of a whole reply, each None where there is none."""
        read = read_whole(self.stream(prompt), text)
        return read.reasoning or None, read.content or None
