"""The frame every reply parser's stream shares: a reply's text is fed as it comes (`feed`), and what is held is
read once the reply has ended (`finish`). Each hands back a delta, a NamedTuple of texts and tuples that two
deltas join field by field. A whole reply is one feed and the finish. The frame adds one join per reply, and per
piece only at the last: the parsers' own cost stays linear in the reply."""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

Delta = TypeVar("Delta", bound=tuple[Any, ...])
Delta_co = TypeVar("Delta_co", bound=tuple[Any, ...], covariant=True)


class ParserStream(Protocol[Delta_co]):
    def feed(self, delta: str) -> Delta_co: ...

    def finish(self) -> Delta_co: ...


def joined(first: Delta, then: Delta) -> Delta:
    """Two deltas of one stream as one: each field of `first` followed by the same field of `then`."""
    return type(first)(*(a + b for a, b in zip(first, then, strict=True)))


def read_whole(stream: ParserStream[Delta], text: str) -> Delta:
    """A whole reply through a fresh stream."""
    return joined(stream.feed(text), stream.finish())


def read_piece(stream: ParserStream[Delta], text: str, last: bool) -> Delta:
    """A piece of a reply as it streams; the last one also ends the stream."""
    fed = stream.feed(text)
    return joined(fed, stream.finish()) if last else fed
