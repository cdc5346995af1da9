"""Qwen3-Coder's XML calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text, read as its schema's type says (a string stays text; a number, boolean, object
or array is read as JSON, and stays text where it does not read), as Qwen's own parser does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from cobali.frontend.parsers.calls import ParsedCall, ToolSchemas, loads, new_call
from cobali.frontend.parsers.tools.base import Functions, json_rule, literal
from cobali.frontend.parsers.tools.tagged import TaggedCalls

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_TEXT_TYPES = ("string", None)  # read as the text itself; None: a parameter the schema does not type
_CLOSE, _END = "\n</parameter>\n", "</function>\n</tool_call>"


class Qwen3Coder(TaggedCalls):
    name = "qwen3_coder"
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    special_tags = open_tag, close_tag

    def read_block(self, body: str, tools: ToolSchemas, closed: bool) -> tuple[ParsedCall, ...] | None:
        call = self._read_call(body, tools)
        return (call,) if call is not None else None

    def _read_call(self, body: str, tools: ToolSchemas) -> ParsedCall | None:
        function = _FUNCTION.match(body)
        if function is None or function.group(1).strip() not in tools:
            return None
        name, inside = function.group(1).strip(), function.group(2)
        properties = tools[name].get("properties") or {}
        arguments = {}
        for parameter in _PARAMETER.finditer(inside):
            key = parameter.group(1).strip()
            arguments[key] = _value(_unwrapped(parameter.group(2)), properties.get(key))
        if _PARAMETER.sub("", inside).strip():
            return None  # text between the parameters: not this format
        return new_call(name, arguments, self.new_id)

    def call_rules(self, functions: Functions) -> tuple[list[str], list[str]]:
        calls, rules = [], []
        for i, (name, parameters) in enumerate(functions):
            body, body_rules = _parameters_rules(f"f{i}", parameters or {})
            calls.append(" ".join(filter(None, [literal(f"<tool_call>\n<function={name}>\n"), body, literal(_END)])))
            rules.extend(body_rules)
        return calls, rules


def _unwrapped(value: str) -> str:
    """The value between the newline after its tag and the one before the closing tag."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _value(text: str, schema: Mapping[str, Any] | None) -> Any:
    kind = schema.get("type") if schema else None
    if kind in _TEXT_TYPES:
        return text
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    value = loads(text)
    return text if value is None and text.strip() != "null" else value


def _parameters_rules(prefix: str, parameters: Mapping[str, Any]) -> tuple[str, list[str]]:
    """A function's parameters in schema order (each optional unless required), or any named parameters where
    the schema lists none."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    if not properties:
        rule = f"{prefix}_any"
        return f"{rule}*", [f'{rule}: "<parameter=" /[A-Za-z0-9_.-]+/ ">\\n" {prefix}_text',
                            _text_rule(f"{prefix}_text")]
    parts, rules = [], []
    for j, (key, schema) in enumerate(properties.items()):
        rule = f"{prefix}_p{j}"
        head = literal(f"<parameter={key}>\n")
        if isinstance(schema, dict) and schema.get("type") == "string":
            rules.extend([f"{rule}: {head} {rule}_text", _text_rule(f"{rule}_text")])
        else:
            rules.extend([f"{rule}: {head} {rule}_json {literal(_CLOSE)}", json_rule(f"{rule}_json", schema)])
        parts.append(rule if key in required else f"{rule}?")
    return " ".join(parts), rules


def _text_rule(rule: str) -> str:
    """Any text up to the first closing tag, which ends it."""
    return f"{rule}[suffix={json.dumps(_CLOSE)}]: /(?s:.*)/"
