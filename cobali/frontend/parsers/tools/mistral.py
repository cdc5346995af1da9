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
    DECODER,
    ParsedCall,
    ToolSchemas,
    call_from_json,
    every_call,
    mistral_call_id,
    new_call,
)
from cobali.frontend.parsers.tools.base import Context, Step, ToolFormat, plain_text

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


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

    def step(self, text: str, start: int, context: Context) -> Step:
        at = text.find(TOOL_CALLS, start)
        if at < 0:
            return plain_text(text, start, (TOOL_CALLS,), context)
        if at > start:
            return Step(at)
        body = at + len(TOOL_CALLS)
        stripped = len(text) - len(text[body:].lstrip())
        if stripped < len(text) and text[stripped] in "[{":
            read = self._json_calls(text, stripped, context.tools)
        else:
            read = self._named_call(text, body, context.tools)
        if read is not None:
            return Step(read[0], read[1])
        if not context.final:
            return Step(start)
        return Step(len(text), () if context.had_calls else None)  # cut short: see TaggedCalls

    def _json_calls(self, text: str, at: int, tools: ToolSchemas) -> tuple[int, tuple[ParsedCall, ...] | None] | None:
        """The JSON list (or one object) of calls at `at`: (its end, the calls or None where it is text); None
        while it has not closed."""
        value, end = _json_at(text, at)
        if end is None:
            return None
        items = value if isinstance(value, list) else [value]
        return end, every_call([call_from_json(item, tools, self.new_id) for item in items])

    def _named_call(self, text: str, at: int, tools: ToolSchemas) -> tuple[int, tuple[ParsedCall, ...] | None] | None:
        """`name[ARGS]{...}` at `at`, as _json_calls reads a list. Until `[ARGS]` comes it waits, unless a `{`
        comes first: then this is no call."""
        head = _NAMED.match(text, at)
        if head is None:
            brace = text.find("{", at)
            return None if brace < 0 else (brace, None)
        arguments, end = _json_at(text, head.end())
        if end is None:
            return None
        call = new_call(head.group(1), arguments, self.new_id) if head.group(1) in tools else None
        return end, (call,) if call is not None else None


def _json_at(text: str, at: int) -> tuple[Any, int | None]:
    """The JSON value at `at` (after whitespace) and its end; (None, None) while it is not whole."""
    try:
        return DECODER.raw_decode(text, len(text) - len(text[at:].lstrip()))
    except ValueError:
        return None, None
