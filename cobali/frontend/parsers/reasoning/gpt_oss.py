"""gpt-oss's reasoning: the analysis channel's messages are reasoning, the final (and commentary) channel's are
content, their headers and end tokens dropped. A message to a recipient (a tool call) is passed on whole, as
content, for the `openai` tool-call parser to read. A reply that is not harmony at all is content."""

from __future__ import annotations

from enum import Enum

from cobali.frontend.parsers.harmony import (
    BODY_ENDS,
    HARMONY_TOKENS,
    MESSAGE,
    START,
    Header,
    may_be_header,
    open_header,
    read_header,
)
from cobali.frontend.parsers.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from cobali.frontend.parsers.text import first_of, held_tail


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
    def __init__(self, body: Body | None) -> None:
        """body: the kind of message body the prompt left open; None: the reply starts with a header."""
        super().__init__()
        self.body = body

    def _advance(self, final: bool) -> ReasoningDelta:
        out: dict[Body, list[str]] = {Body.REASONING: [], Body.CONTENT: []}
        while self.held:
            if self.body is None and not self._read_header(out, final):
                break
            if self.body is not None and not self._read_body(out, final):
                break
        return ReasoningDelta("".join(out[Body.REASONING]), "".join(out[Body.CONTENT]))

    def _read_header(self, out: dict[Body, list[str]], final: bool) -> bool:
        """Read the header `held` starts with; False to wait for more."""
        at = self.held.find(MESSAGE)
        header = read_header(self.held[:at]) if at >= 0 else None
        if header is not None:
            self.body = body_of(header)
            if self.body is Body.WHOLE:  # with its own `<|start|>`, so that it reads the same wherever it lands
                head = self.held[:at + len(MESSAGE)]
                out[Body.CONTENT].append(head if head.startswith(START) else f"{START}assistant{head}")
            self.held = self.held[at + len(MESSAGE):]
            return True
        if at < 0 and may_be_header(self.held) and not final:
            return False
        # Not a header: text, from its first character on (a `<|start|>` it opens with is not read again).
        self.body = Body.CONTENT
        opener = len(START) if self.held.startswith(START) else 0
        out[Body.CONTENT].append(self.held[:opener])
        self.held = self.held[opener:]
        return True

    def _read_body(self, out: dict[Body, list[str]], final: bool) -> bool:
        """Read the body up to its end token; False to wait for more."""
        assert self.body is not None
        into = out[Body.REASONING if self.body is Body.REASONING else Body.CONTENT]
        found = first_of(self.held, BODY_ENDS)
        if found is None:
            keep = 0 if final else held_tail(self.held, BODY_ENDS)
            into.append(self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            return False
        at, token = found
        kept = at + len(token) if token != START else at  # a `<|start|>` opens the next header
        into.append(self.held[:kept] if self.body is Body.WHOLE else self.held[:at])
        self.held = self.held[kept:]
        self.body = None
        return True
