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
from collections.abc import Mapping
from typing import Any

from cobali.frontend.parsers.calls import ParsedCall, ToolSchemas, loads, new_call
from cobali.frontend.parsers.tools.base import Functions, json_rule, literal
from cobali.frontend.parsers.tools.tagged import TaggedCalls

_FUNCTION, _FUNCTION_END, _PARAMETER, _PARAMETER_END = "<function=", "</function>", "<parameter=", "</parameter>"
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
        body = body.lstrip()
        function = _tagged(body, _FUNCTION, 0)
        if function is None or function[0].strip() not in tools:
            return None
        name, inside = function[0].strip(), body[function[1]:]
        stripped = inside.rstrip()
        inside = stripped.removesuffix(_FUNCTION_END) if stripped.endswith(_FUNCTION_END) else inside
        arguments = _parameters(inside, tools[name].get("properties") or {})
        return new_call(name, arguments, self.new_id) if arguments is not None else None

    def call_rules(self, functions: Functions) -> tuple[list[str], list[str]]:
        calls, rules = [], []
        for i, (name, parameters) in enumerate(functions):
            body, body_rules = _parameters_rules(f"f{i}", parameters or {})
            calls.append(" ".join(filter(None, [literal(f"<tool_call>\n<function={name}>\n"), body, literal(_END)])))
            rules.extend(body_rules)
        return calls, rules


def _tagged(text: str, tag: str, at: int) -> tuple[str, int] | None:
    """`<tag=NAME>` at `at`: (NAME, where the text after it starts); None where no `>` ends NAME on its line."""
    if not text.startswith(tag, at):
        return None
    name = at + len(tag)
    close = text.find(">", name)
    if close <= name or text.find("\n", name, close) >= 0:
        return None
    return text[name:close], close + 1


def _parameters(inside: str, properties: Mapping[str, Any]) -> dict[str, Any] | None:
    """Each `<parameter=NAME>` up to its closing tag, the next parameter or the end; None where anything but
    whitespace lies outside them. Read with str.find, each character a bounded number of times: where a value
    ends by the next parameter, the closing tag looked for beyond it is kept for the values after."""
    arguments: dict[str, Any] = {}
    at, close = 0, -2  # close: the next closing tag at or after `at` (-1: none; -2: not looked for yet)
    while (start := inside.find(_PARAMETER, at)) >= 0:
        parameter = _tagged(inside, _PARAMETER, start)
        if inside[at:start].strip() or parameter is None:
            return None
        key, value = parameter[0].strip(), parameter[1]
        if close != -1 and close < value:
            close = inside.find(_PARAMETER_END, value)
        after = inside.find(_PARAMETER, value)
        if close >= 0 and (after < 0 or close < after):
            end, at = close, close + len(_PARAMETER_END)
        else:
            end = at = after if after >= 0 else len(inside)
        arguments[key] = _value(_unwrapped(inside[value:end]), properties.get(key))
    return arguments if not inside[at:].strip() else None


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
