"""Llama 3.x's JSON calls: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`, or a JSON list of them.

A call can only open the reply, so a stream holds at most its opening: `{"name": "get_weather"` naming a tool (or
`{"parameters"`, `{"arguments"`, or the python tag) is a call's start, held to the end and read then; anything else
(`{"a": 1}`, prose) is sent at once, and so is the rest of that reply.
"""

from __future__ import annotations

import json
import re

from cobali.frontend.parsers.calls import NewId, ParsedCall, ToolSchemas, call_from_json, every_call, json_values
from cobali.frontend.parsers.text import run_end
from cobali.frontend.parsers.tools.base import Context, Held, Step, ToolFormat

PYTHON_TAG = "<|python_tag|>"
_KEYS = ("name", "parameters", "arguments")
_SPACE = re.compile(r"\s*")
_CHARS = re.compile(r'[^"\\]*')  # of a key or a name, up to its closing quote
# What an opening is made of, in order: `[`? `{` `"KEY"` `:` `"NAME"`, whitespace allowed before each part but
# the key's and the name's characters; a part is the character it starts with.
_LEAD, _BRACE, _KEY_OPEN, _KEY, _COLON, _NAME_OPEN, _NAME, _TAG = range(8)
_NEXT = {_LEAD: {"[": _BRACE, "{": _KEY_OPEN, "<": _TAG}, _BRACE: {"{": _KEY_OPEN}, _KEY_OPEN: {'"': _KEY},
         _COLON: {":": _NAME_OPEN}, _NAME_OPEN: {'"': _NAME}}


class Llama3Json(ToolFormat):
    name = "llama3_json"
    special_tags = (PYTHON_TAG,)
    separator = "; "
    call_tail = "}"

    def call_head(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": '

    def step(self, held: Held, context: Context) -> Step:
        if held.start > 0:
            return Step(held.end)
        opens = opens_call(held, context)
        if opens is None or (opens and not context.final):
            return Step(held.start)
        text, base = held.text()
        return Step(held.end, read_calls(text[held.start - base:], context.tools, self.new_id) if opens else None)


def opens_call(held: Held, context: Context) -> bool | None:
    """Whether the reply opens with a call; None while its text so far cannot tell. Reads only what came since
    the last time."""
    assert held.start == 0, "a call can only open the reply"
    if held.opening is None:
        held.opening = Opening()
    opening: Opening = held.opening
    if opening.opens is None:
        opening.read(*held.window(opening.at), context.tools)
    return opening.opens if opening.opens is not None or not context.final else False


class Opening:
    """A reply's opening, read as it comes, each character once: whether it is a call's (`opens`, None while
    it may still be one), as far as it has come. The key must be one of _KEYS, the name one of the tools."""

    def __init__(self) -> None:
        self.at = 0  # the first character not read yet
        self.part = _LEAD
        self.chars = ""  # the key or the name read so far, or the python tag's part
        self.opens: bool | None = None

    def read(self, text: str, base: int, tools: ToolSchemas) -> None:
        """Read on to the end of `text`, whose first character stands at `base`."""
        at = self.at - base
        while self.opens is None and at < len(text):
            if self.part in (_KEY, _NAME):
                end = run_end(_CHARS, text, at)
                self.chars += text[at:end]
                at = end
                if at == len(text):
                    self.opens = self._judge(tools, closed=False)
                elif text[at] == '"':
                    self.opens = self._judge(tools, closed=True)
                    at += 1
                else:  # a backslash ends the opening: none of ours is written with one
                    self.opens = False
            elif self.part == _TAG:
                size = min(len(PYTHON_TAG) - len(self.chars), len(text) - at)
                self.chars += text[at:at + size]
                at += size
                if self.chars == PYTHON_TAG or not PYTHON_TAG.startswith(self.chars):
                    self.opens = self.chars == PYTHON_TAG
            else:
                at = run_end(_SPACE, text, at)
                if at < len(text):
                    self.part = _NEXT[self.part].get(text[at], -1)
                    self.chars = text[at] if self.part == _TAG else ""
                    self.opens = False if self.part < 0 else None
                    at += 1
                    if self.part in (_KEY, _NAME):
                        self.opens = self._judge(tools, closed=False)
        self.at = at + base

    def _judge(self, tools: ToolSchemas, closed: bool) -> bool | None:
        """After a key's or a name's characters (`closed`: and its closing quote): whether the reply opens with
        a call, or None while it may; the part read next is the one after it."""
        if self.part == _KEY:
            if closed:
                self.part = _COLON
                return None if self.chars == "name" else self.chars in ("parameters", "arguments")
            return None if any(key.startswith(self.chars) for key in _KEYS) else False
        if closed:
            return self.chars in tools
        return None if any(tool.startswith(self.chars) for tool in tools) else False


def read_calls(text: str, tools: ToolSchemas, new_id: NewId) -> tuple[ParsedCall, ...] | None:
    """The calls the whole reply is, or None where any part of it is not one."""
    values = json_values(text.strip().removeprefix(PYTHON_TAG), separators=";")
    if values is None:
        return None
    items = [item for value in values for item in (value if isinstance(value, list) else [value])]
    return every_call([call_from_json(item, tools, new_id) for item in items])
