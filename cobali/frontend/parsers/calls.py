"""A tool call read from a reply, and what every format's reader shares: the request's tools, a call from a JSON
value, the JSON values a text holds."""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The request's tools: name -> its parameters' JSON schema ({} where only the name is known).
ToolSchemas = Mapping[str, Mapping[str, Any]]
NewId = Callable[[], str]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def tool_schemas(tools: Iterable[str] | ToolSchemas) -> ToolSchemas:
    """The request's tools as name -> parameters schema, from either that mapping or the names alone."""
    if isinstance(tools, Mapping):
        return tools
    return {name: {} for name in tools}


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates refuse a call id that is not 9 letters or digits."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def new_call(name: str, arguments: Any, new_id: NewId) -> ParsedCall | None:
    """A call of `name` with `arguments` (an object, or JSON text of one, as some models write them); None when
    they are neither."""
    if isinstance(arguments, str):
        arguments = loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False), new_id())


def call_from_json(value: Any, tools: ToolSchemas, new_id: NewId) -> ParsedCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` naming one of `tools`, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in tools:
        return None
    return new_call(value["name"], value.get("arguments", value.get("parameters", {})), new_id)


def every_call(calls: list[ParsedCall | None]) -> tuple[ParsedCall, ...] | None:
    """The calls, where there are some and each of them read; else None (the text they came from is text)."""
    if not calls or None in calls:
        return None
    return tuple(call for call in calls if call is not None)


MAX_JSON_DEPTH = 128  # a model's JSON nested deeper is no call: it stays text, and never meets a recursive codec
DECODER = json.JSONDecoder()
_MARK = re.compile(r'[\[\]{}"]')  # what a bracket-and-string scan stops at, outside a string
_STRING_MARK = re.compile(r'["\\]')  # and inside one


def loads(text: str) -> Any:
    """The JSON value `text` holds, or None (also where it nests deeper than MAX_JSON_DEPTH)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: a model's `[[[[…`, thousands deep
        return None
    return value if not JsonScan(0).read(text, 0).too_deep else None


def json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values `text` holds one after another (whitespace and `separators` between them), or None when
    anything else is there."""
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values or None
        try:
            value, end = DECODER.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        if JsonScan(at).read(text, 0, end).too_deep:
            return None
        values.append(value)
        at = end


class JsonScan:
    """A JSON value read as its text comes, only as far as its brackets and strings go: where it ends (a value
    that opens with a bracket or a quote), and whether it nests deeper than MAX_JSON_DEPTH. Each character is
    read once, however the text is cut; what lies between brackets and quotes is skipped in one regex step."""

    def __init__(self, at: int) -> None:
        self.start = self.at = at  # where the value starts; the first character not read yet
        self.depth = 0
        self.in_string = False
        self.end: int | None = None  # just past the value, once it has closed
        self.too_deep = False  # it went deeper than MAX_JSON_DEPTH: no more is read

    def read(self, text: str, base: int, stop: int | None = None) -> JsonScan:
        """Read on to `stop` (the end of `text` by default), `text`'s first character standing at position `base`."""
        at, stop = self.at - base, len(text) if stop is None else stop - base
        while self.end is None and not self.too_deep:
            mark = (_STRING_MARK if self.in_string else _MARK).search(text, at, stop)
            if mark is None or (mark.group() == "\\" and mark.end() == stop):
                at = stop if mark is None else mark.start()  # an escape waits for the character it escapes
                break
            at = mark.end()
            if mark.group() == "\\":
                at += 1
            elif mark.group() == '"':
                self.in_string = not self.in_string
            else:
                self.depth += 1 if mark.group() in "[{" else -1
                self.too_deep = self.depth > MAX_JSON_DEPTH
            if self.depth <= 0 and not self.in_string:
                self.end = at + base
        self.at = at + base
        return self
