"""gpt-oss's reasoning: the analysis channel's messages are reasoning, the final (and commentary) channel's are
content, their headers and end tokens dropped. A message to a recipient (a tool call) is passed on whole, as
content, for the `openai` tool-call parser to read. A reply that is not harmony at all is content."""

from __future__ import annotations

from enum import Enum

from cobali.frontend.parsers.harmony import (
    BODY_END,
    BODY_ENDS,
    HARMONY_TOKENS,
    MESSAGE,
    START,
    Header,
    header_end,
    may_be_header,
    open_header,
    read_header,
)
from cobali.frontend.parsers.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from cobali.frontend.parsers.text import held_tail


class Body(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    WHOLE = "whole"  # a message to a recipient: passed on with its header and end token


def body_of(header: Header) -> Body:
    if header.recipient is not None:
        return Body.WHOLE
    return Body.REASONING if header.channel == "analysis" else Body.CONTENT


class GptOss(ReasoningParser):
    name = "openai_gptoss"

    @property
    def special_tags(self) -> tuple[str, ...]:
        return HARMONY_TOKENS

    def stream(self, prompt: str = "") -> GptOssStream:
        header = open_header(prompt)
        return GptOssStream(body_of(header) if header is not None else None)


class GptOssStream(ReasoningStream):
    """Reads `held` once, from a position that only moves forward; what it keeps for the next feed is at most a
    header (MAX_HEADER) or the beginning of an end token, so that a feed costs O(its text)."""

    def __init__(self, body: Body | None) -> None:
        """body: the kind of message body the prompt left open; None: the reply starts with a header."""
        super().__init__()
        self.body = body

    def _advance(self, final: bool) -> ReasoningDelta:
        out: dict[Body, list[str]] = {Body.REASONING: [], Body.CONTENT: []}
        at, more = 0, True
        while more and at < len(self.held):
            read = self._read_header if self.body is None else self._read_body
            at, more = read(at, out, final)
        self.held = self.held[at:]
        return ReasoningDelta("".join(out[Body.REASONING]), "".join(out[Body.CONTENT]))

    def _read_header(self, at: int, out: dict[Body, list[str]], final: bool) -> tuple[int, bool]:
        """Read the header at `at`: where reading stopped, and whether it goes on (False: wait for more)."""
        text = self.held
        end = header_end(text, at)
        header = read_header(text[at:end]) if end >= 0 else None
        if header is not None:
            self.body = body_of(header)
            if self.body is Body.WHOLE:  # with its own `<|start|>`, so that it reads the same wherever it lands
                head = text[at:end + len(MESSAGE)]
                out[Body.CONTENT].append(head if head.startswith(START) else f"{START}assistant{head}")
            return end + len(MESSAGE), True
        if end < 0 and not final and may_be_header(text, at):
            return at, False
        # Not a header: text, from its first character on (a `<|start|>` it opens with is not read again).
        self.body = Body.CONTENT
        if text.startswith(START, at):
            out[Body.CONTENT].append(START)
            return at + len(START), True
        return at, True

    def _read_body(self, at: int, out: dict[Body, list[str]], final: bool) -> tuple[int, bool]:
        """Read the body from `at` up to its end token, as _read_header."""
        assert self.body is not None
        text = self.held
        into = out[Body.REASONING if self.body is Body.REASONING else Body.CONTENT]
        found = BODY_END.search(text, at)
        if found is None:  # all of it, but a tail that may be an end token's beginning
            end = len(text) - (0 if final else held_tail(text, BODY_ENDS, at))
            into.append(text[at:end])
            return end, False
        kept = found.end() if found.group() != START else found.start()  # a `<|start|>` opens the next header
        into.append(text[at:kept] if self.body is Body.WHOLE else text[at:found.start()])
        self.body = None
        return kept, True
