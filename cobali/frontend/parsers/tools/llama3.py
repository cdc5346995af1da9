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
from cobali.frontend.parsers.tools.base import Context, Step, ToolFormat

PYTHON_TAG = "<|python_tag|>"
_KEYS = ("name", "parameters", "arguments")
# A call's opening as far as it has come: each part only once the one before it is whole.
_OPENING = re.compile(r'(?:\[\s*)?(?:\{\s*(?:"(?P<key>[^"\\]*)(?P<key_end>"\s*(?::\s*(?:"(?P<name>[^"\\]*)'
                      r'(?P<name_end>")?)?)?)?)?)?')


class Llama3Json(ToolFormat):
    name = "llama3_json"
    special_tags = (PYTHON_TAG,)
    separator = "; "
    call_tail = "}"

    def call_head(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": '

    def step(self, text: str, start: int, context: Context) -> Step:
        if start > 0:
            return Step(len(text))
        opens = opens_call(text, context)
        if opens is None or (opens and not context.final):
            return Step(start)
        return Step(len(text), read_calls(text, context.tools, self.new_id) if opens else None)


def opens_call(text: str, context: Context) -> bool | None:
    """Whether the reply opens with a call; None while its text so far cannot tell."""
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        return True
    if body and PYTHON_TAG.startswith(body):
        return None if not context.final else False
    opening = _OPENING.match(body)
    assert opening is not None  # every part of it is optional
    key = opening.group("key")
    if opening.group("key_end") and key in ("parameters", "arguments"):
        return True
    if opening.group("name_end"):
        return key == "name" and opening.group("name") in context.tools
    if key is not None and not any(k.startswith(key) and (k == key or not opening.group("key_end")) for k in _KEYS):
        return False
    name = opening.group("name")
    if name is not None and not any(tool.startswith(name) for tool in context.tools):
        return False
    return None if opening.end() == len(body) and not context.final else False


def read_calls(text: str, tools: ToolSchemas, new_id: NewId) -> tuple[ParsedCall, ...] | None:
    """The calls the whole reply is, or None where any part of it is not one."""
    values = json_values(text.strip().removeprefix(PYTHON_TAG), separators=";")
    if values is None:
        return None
    items = [item for value in values for item in (value if isinstance(value, list) else [value])]
    return every_call([call_from_json(item, tools, new_id) for item in items])
