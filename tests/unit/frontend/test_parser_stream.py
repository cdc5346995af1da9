"""The frame the reply parsers share: a whole reply is one feed and the finish, joined field by field; a piece
that is not the last never ends the stream, and the last one does."""

from __future__ import annotations

from cobali.frontend.parsers.calls import ParsedCall
from cobali.frontend.parsers.reply import ReplyDelta, ReplyParsers
from cobali.frontend.parsers.stream import joined, read_piece, read_whole
from cobali.frontend.parsers.tools import StreamDelta


def call(name: str) -> ParsedCall:
    return ParsedCall(name, "{}", f"call_{name}")


class Recorded:
    """A stream that hands back what it is told and records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def feed(self, delta: str) -> StreamDelta:
        self.asked.append(f"feed {delta}")
        return StreamDelta(delta.upper(), (call("fed"),))

    def finish(self) -> StreamDelta:
        self.asked.append("finish")
        return StreamDelta("!", (call("held"),))


def test_joined_is_field_by_field_and_keeps_the_type() -> None:
    both = joined(ReplyDelta("r1", "c1", ()), ReplyDelta("r2", "", (call("f"),)))
    assert both == ReplyDelta("r1r2", "c1", (call("f"),)) and type(both) is ReplyDelta


def test_a_piece_ends_the_stream_only_when_last() -> None:
    stream = Recorded()
    assert read_piece(stream, "ab", last=False) == StreamDelta("AB", (call("fed"),))
    assert read_piece(stream, "c", last=True) == StreamDelta("C!", (call("fed"), call("held")))
    assert stream.asked == ["feed ab", "feed c", "finish"]


def test_a_whole_reply_is_one_feed_and_the_finish() -> None:
    stream = Recorded()
    assert read_whole(stream, "x").content == "X!" and stream.asked == ["feed x", "finish"]
    parsers = ReplyParsers.for_template("", reasoning="qwen3", tools="hermes")
    read = parsers.parse('<think>why</think>so<tool_call>{"name": "f", "arguments": {}}</tool_call>', tools=["f"])
    assert (read.reasoning, read.content.strip(), [call.name for call in read.calls]) == ("why", "so", ["f"])
