"""Formats whose calls sit between an opening and a closing tag, anywhere in the reply: Hermes / Qwen2.5's
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and the frame Qwen3-Coder's and DeepSeek's share."""

from __future__ import annotations

import json
from abc import abstractmethod

from cobali.frontend.parsers.calls import ParsedCall, ToolSchemas, call_from_json, loads
from cobali.frontend.parsers.tools.base import Context, Held, Step, ToolFormat, plain_text


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

    def step(self, held: Held, context: Context) -> Step:
        body = held.start + len(self.open_tag)
        if held.scan is None:  # not yet in a block
            text, base = held.text()
            at = text.find(self.open_tag, held.start - base)
            if at < 0:
                return plain_text(held, (self.open_tag,), context)
            if at + base > held.start:
                return Step(at + base)
            held.scan = body  # the closing tag is looked for from here on, each character once
        close = held.find(self.close_tag, held.scan)
        if close < 0 and not context.final:
            held.scan = max(body, held.end - len(self.close_tag) + 1)
            return Step(held.start)
        body_end, end = (close, close + len(self.close_tag)) if close >= 0 else (held.end, held.end)
        text, base = held.text()
        calls = self.read_block(text[body - base:body_end - base], context.tools, closed=close >= 0)
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

