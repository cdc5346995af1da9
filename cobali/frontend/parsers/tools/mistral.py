"""Mistral's calls, after its `[TOOL_CALLS]` token, in either of its tokenizers' forms:

- v11 and later: `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`, the token again before each further call
  (some versions put `[CALL_ID]id` before `[ARGS]`);
- before: `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]`.

Both are read whatever the template; the template's form is the one a forced call is written in. Call ids are 9
letters or digits: Mistral's templates refuse any other.
"""

from __future__ import annotations

import json
import re
from typing import Any

from cobali.frontend.parsers.calls import (
    JsonScan,
    ParsedCall,
    ToolSchemas,
    call_from_json,
    every_call,
    loads,
    mistral_call_id,
    new_call,
)
from cobali.frontend.parsers.text import run_end
from cobali.frontend.parsers.tools.base import Context, Held, Step, ToolFormat, plain_text

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_SPACE = re.compile(r"\s*")
_NAME, _ID = re.compile(r"[A-Za-z0-9_.\-]*"), re.compile(r"[A-Za-z0-9]*")
# What follows the token, part by part: whitespace, then a JSON list (or object) of calls, or a call's name, maybe
# `[CALL_ID]id`, then `[ARGS]`, whitespace and its JSON arguments. Where the name's part fails, no call: the text
# is content up to the next `{`.
_START, _HEAD, _TAG, _CALL_ID, _ID_TAG, _ARGS, _JSON, _BRACE = range(8)


class Mistral(ToolFormat):
    name = "mistral"
    special_tags = TOOL_CALLS, ARGS, CALL_ID

    def __init__(self, named: bool = True) -> None:
        """named: forced calls in the v11 form (else the JSON list)."""
        self.named = named
        self.separator = "" if named else ", "
        self.opening, self.closing, self.call_tail = ("", "", "") if named else ("[TOOL_CALLS][", "]", "}")

    def new_id(self) -> str:
        return mistral_call_id()

    def call_head(self, name: str) -> str:
        if self.named:
            return f"{TOOL_CALLS}{name}{ARGS}"
        return f'{{"name": {json.dumps(name)}, "arguments": '

    def step(self, held: Held, context: Context) -> Step:
        if held.scan is None:  # not yet after the token
            text, base = held.text()
            at = text.find(TOOL_CALLS, held.start - base)
            if at < 0:
                return plain_text(held, (TOOL_CALLS,), context)
            if at + base > held.start:
                return Step(at + base)
            held.scan = _Calls(held.start + len(TOOL_CALLS))
        calls: _Calls = held.scan
        calls.read(*held.window(calls.at))
        value = calls.value
        if calls.text_to is not None:
            return Step(calls.text_to)
        if value is None or value.end is None:
            if not context.final:
                return Step(held.start)
            return Step(held.end, () if context.had_calls else None)  # cut short: see TaggedCalls
        text, base = held.text()
        value_text = text[value.start - base:value.end - base]  # read apart: a JSON error's message counts lines
        name = text[calls.name[0] - base:calls.name[1] - base] if calls.name is not None else None
        return Step(value.end, self._calls(name, loads(value_text), context.tools))

    def _calls(self, name: str | None, value: Any, tools: ToolSchemas) -> tuple[ParsedCall, ...] | None:
        """The calls a JSON value reads as: the arguments of a call of `name`, or (no name) a list of calls or
        one; None where it is not calls."""
        if name is None:
            items = value if isinstance(value, list) else [value]
            return every_call([call_from_json(item, tools, self.new_id) for item in items])
        call = new_call(name, value, self.new_id) if name in tools else None
        return (call,) if call is not None else None


class _Calls:
    """What follows a `[TOOL_CALLS]`, read part by part as it comes, each character once (held.scan)."""

    def __init__(self, at: int) -> None:
        self.at = at  # the first character not read yet
        self.part = _START
        self.name: tuple[int, int] | None = None  # where the call's name is (None: a JSON list of calls)
        self.value: JsonScan | None = None
        self.text_to: int | None = None  # no call: the text up to here is content

    def read(self, text: str, base: int) -> None:
        """Read on to the end of `text`, whose first character stands at `base`, or until decided."""
        at = self.at - base
        while at < len(text) and self.text_to is None:
            if self.value is not None:
                at = self.value.read(text, base).at - base
                if self.value.too_deep:  # no call: text, up to where it went too deep
                    self.text_to = self.value.at
                break
            part = self.part
            moved = self._read_part(text, at, base)
            if moved == at and self.part == part:
                break  # a tag's beginning: wait for the rest of it
            at = moved
        self.at = at + base

    def _read_part(self, text: str, at: int, base: int) -> int:
        """Read the part at `at`: where reading goes on."""
        if self.part in (_START, _ARGS):  # whitespace, then a JSON value (or, first, a name)
            at = run_end(_SPACE, text, at)
            if at < len(text):
                self._value_at(text[at], at + base)
            return at
        if self.part == _HEAD:
            assert self.name is not None
            at = run_end(_NAME, text, at)
            self.name = (self.name[0], at + base)
            if at < len(text):
                self.part = _TAG if self.name[1] > self.name[0] else _BRACE
            return at
        if self.part == _CALL_ID:
            at = run_end(_ID, text, at)
            self.part = _ID_TAG if at < len(text) else _CALL_ID
            return at
        if self.part == _BRACE:
            brace = text.find("{", at)
            self.text_to = brace + base if brace >= 0 else None
            return brace if brace >= 0 else len(text)
        for tag, part in ((ARGS, _ARGS), (CALL_ID, _CALL_ID))[:2 if self.part == _TAG else 1]:
            if text.startswith(tag, at):
                self.part = part
                return at + len(tag)
            if len(text) - at < len(tag) and tag.startswith(text[at:]):
                return at  # wait
        self.part = _BRACE
        return at

    def _value_at(self, char: str, at: int) -> None:
        if char in ("[{" if self.part == _START else '[{"'):
            self.value, self.part = JsonScan(at), _JSON
        elif self.part == _START:
            self.name, self.part = (at, at), _HEAD
        else:
            self.text_to = at  # arguments that are no JSON: no call
