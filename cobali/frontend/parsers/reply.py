"""A reply through its model's parsers: reasoning first, then tool calls in the content it leaves.

The parsers are chosen once, when the model loads, from its chat template or by the operator's flags
(`--reasoning-parser NAME`, `--tool-call-parser NAME`; `none` turns reasoning parsing off). Every API face (chat
completions, Responses, Anthropic Messages) reads replies through one ReplyStream a choice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from cobali.frontend.parsers.calls import ParsedCall, ToolSchemas
from cobali.frontend.parsers.reasoning import (
    ReasoningParser,
    ReasoningStream,
    choose_reasoning_parser,
    reasoning_parser,
)
from cobali.frontend.parsers.stream import read_piece, read_whole
from cobali.frontend.parsers.tools import ToolCallStream, ToolFormat, choose_tool_parser, tool_parser

AUTO = "auto"  # a flag's default: the parser the chat template calls for
NONE = "none"


class ReplyDelta(NamedTuple):
    reasoning: str = ""
    content: str = ""
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class ReplyParsers:
    reasoning: ReasoningParser | None  # None: the reply is all content
    tools: ToolFormat

    @classmethod
    def for_template(cls, template: str, reasoning: str = AUTO, tools: str = AUTO) -> ReplyParsers:
        """The parsers named (ValueError for an unknown name), or those the template calls for."""
        chosen_reasoning = (choose_reasoning_parser(template) if reasoning == AUTO
                            else None if reasoning == NONE else reasoning_parser(reasoning))
        chosen_tools = choose_tool_parser(template) if tools == AUTO else tool_parser(tools)
        return cls(chosen_reasoning, chosen_tools)

    def stream(self, prompt: str = "", tools: Iterable[str] | ToolSchemas = ()) -> ReplyStream:
        """A stream for one choice's reply to `prompt` (its rendered text: whether the template opened a think
        block); tools: the request's active tools, none: no calls are read."""
        tools = tuple(tools) if not isinstance(tools, dict) else tools
        return ReplyStream(self.reasoning.stream(prompt) if self.reasoning is not None else None,
                           self.tools.stream(tools) if tools else None)

    def parse(self, text: str, prompt: str = "", tools: Iterable[str] | ToolSchemas = ()) -> ReplyDelta:
        """A whole reply: its reasoning, its content and its calls."""
        return read_whole(self.stream(prompt, tools), text)


class ReplyStream:
    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, delta: str) -> ReplyDelta:
        if self._reasoning is None:
            return self._content("", delta, final=False)
        split = self._reasoning.feed(delta)
        return self._content(split.reasoning, split.content, final=False)

    def finish(self) -> ReplyDelta:
        split = self._reasoning.finish() if self._reasoning is not None else None
        return self._content(split.reasoning if split else "", split.content if split else "", final=True)

    def _content(self, reasoning: str, content: str, final: bool) -> ReplyDelta:
        if self._tools is None:
            return ReplyDelta(reasoning, content)
        if not content:  # nothing to feed: the stream's rest, if it ends here
            return ReplyDelta(reasoning, *self._tools.finish()) if final else ReplyDelta(reasoning)
        read = read_piece(self._tools, content, last=final)
        return ReplyDelta(reasoning, read.content, read.calls)
