"""Formats whose calls sit between an opening and a closing tag, anywhere in the reply: Hermes / Qwen2.5's
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and the frame Qwen3-Coder's and DeepSeek's share."""

from __future__ import annotations

import json
from abc import abstractmethod

from cobali.frontend.parsers.calls import ParsedCall, ToolSchemas, call_from_json, loads
from cobali.frontend.parsers.tools.base import Context, Step, ToolFormat, plain_text


class TaggedCalls(ToolFormat):
    """From the opening tag on, a block is held until its closing tag, then read: one that reads is calls, one
    that does not is sent as text. One the reply's end cuts short (max_tokens) is read as it stands, and dropped
    when it does not read but calls came before it (half a call is neither a call nor an answer)."""

    open_tag: str
    close_tag: str

    @abstractmethod
    def read_block(self, body: str, tools: ToolSchemas, closed: bool) -> tuple[ParsedCall, ...] | None:
        """The calls between the tags (`closed`: the closing tag came; else the reply ended first), or None where
        `body` is not calls."""

    def step(self, text: str, start: int, context: Context) -> Step:
        at = text.find(self.open_tag, start)
        if at < 0:
            return plain_text(text, start, (self.open_tag,), context)
        if at > start:
            return Step(at)
        body = at + len(self.open_tag)
        close = text.find(self.close_tag, body)
        if close < 0 and not context.final:
            return Step(start)
        body_end, end = (close, close + len(self.close_tag)) if close >= 0 else (len(text), len(text))
        calls = self.read_block(text[body:body_end], context.tools, closed=close >= 0)
        if calls:
            return Step(end, calls)
        return Step(end, () if close < 0 and context.had_calls else None)


class Hermes(TaggedCalls):
    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    special_tags = open_tag, close_tag
    call_tail = "}\n</tool_call>"

    def read_block(self, body: str, tools: ToolSchemas, closed: bool) -> tuple[ParsedCall, ...] | None:
        call = call_from_json(loads(body), tools, self.new_id)
        return (call,) if call is not None else None

    def call_head(self, name: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '

