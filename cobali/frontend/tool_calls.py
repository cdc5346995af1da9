"""Tool calls read from a model's output, in the formats models are trained on:

- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them;
- Llama 3.x: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
  several separated by `;`, or a JSON list of calls.

Only calls naming one of the request's tools count; anything else stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
# What a call may start with: text from there on is held back from a stream until the reply ends.
_CALL_OPENERS = ("<", "{", "[")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(value: Any, names: set[str]) -> ParsedCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """(the text that is not a call, or None if nothing is left; the calls, in order)."""
    if "<tool_call>" in text:
        return _hermes(text, names)
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    value = _json(body)
    if value is None and ";" in body:
        value = [_json(part) for part in body.split(";")]
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    if calls and all(calls):
        return None, calls  # type: ignore[return-value]
    return text, []


def _hermes(text: str, names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """Blocks that parse are calls; one that does not stays text, unless it is the last, cut short by
    max_tokens (it is dropped: half a call is neither a call nor an answer)."""
    calls, kept, end = [], [], 0
    for match in _HERMES.finditer(text):
        call = _call(_json(match.group(1)), names)
        kept.append(text[end:match.start()])
        if call is not None:
            calls.append(call)
        elif match.group(0).endswith("</tool_call>"):
            kept.append(match.group(0))
        end = match.end()
    if not calls:
        return text, []
    rest = "".join([*kept, text[end:]]).strip()
    return rest or None, calls


class ToolCallStream:
    """A streamed reply when tools are on: text is sent as it comes until something that may open a call
    appears; from there it is held, and parsed when the reply ends."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.text = ""
        self.sent = ""
        self.holding = False

    def push(self, delta: str) -> str:
        """The part of `delta` that can be sent now."""
        self.text += delta
        if self.holding or not self.text.strip():
            return ""
        start = len(self.sent)
        cuts = [i for i in (self.text.find(c, start) for c in _CALL_OPENERS) if i >= 0]
        end = min(cuts) if cuts else len(self.text)
        self.holding = bool(cuts)
        ready = self.text[start:end]
        self.sent += ready
        return ready

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The rest of the text to send, and the calls."""
        content, calls = parse_tool_calls(self.text, self.names)
        content = content or ""
        if not calls:
            return self.text[len(self.sent):], []
        sent = self.sent.strip()
        return (content[len(sent):] if content.startswith(sent) else ""), calls
