"""response_format -> llama.cpp GBNF grammar.

{"type": "json_object"} gets a generic JSON grammar (any object). {"type": "json_schema"} is converted for a
practical subset of JSON Schema:

- "type": object (properties emitted in schema order), array (items), string, integer, number, boolean, null,
  or a list of these;
- "enum", "const", "anyOf", "oneOf".

Simplifications: every declared property is emitted, required or not (the order is fixed, so the model never
has to choose); an object without "properties" and any keyword outside the subset ("$ref", "pattern",
"format", "allOf", length and range bounds, ...) falls back to the generic JSON value there. The output is
always valid JSON; it may be looser than the schema where the schema uses those keywords.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

# llama.cpp's grammars/json.gbnf, with bounded whitespace so a model cannot pad forever.
_JSON_RULES = r"""
value ::= object | array | string | number | boolean | null
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
array ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\"" ws
number ::= "-"? ( [0-9] | [1-9] [0-9]{0,15} ) ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )? ws
integer ::= "-"? ( [0-9] | [1-9] [0-9]{0,15} ) ws
boolean ::= ( "true" | "false" ) ws
null ::= "null" ws
ws ::= | " " | "\n" [ \t]{0,20}
"""

# Deeper schemas are refused (400): the conversion recurses, and a hostile schema would otherwise hit
# Python's recursion limit (a 500). Real schemas nest a handful of levels.
MAX_SCHEMA_DEPTH = 64

_SCALARS = frozenset({"string", "number", "integer", "boolean", "null"})  # each has a rule of that name

JSON_OBJECT_GRAMMAR = "root ::= object" + _JSON_RULES


def check_json_schema(schema: Any) -> None:
    """A schema that is not valid JSON Schema (draft 2020-12) is the client's bug: ValueError naming it."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object or a boolean")
    if _nesting(schema) > MAX_SCHEMA_DEPTH:  # before the recursive checks below
        raise ValueError(f"response_format schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(part) for part in err.path) or "the top level"
        raise ValueError(f"invalid JSON schema at {where}: {err.message}") from None


def _nesting(value: Any) -> int:
    """How deep JSON containers nest, without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def json_schema_grammar(schema: Any) -> str:
    converter = _SchemaConverter()
    root = converter.visit(schema)
    rules = "".join(f"{name} ::= {body}\n" for name, body in converter.rules.items())
    return f"root ::= {root}\n{rules}{_JSON_RULES}"


def _literal(value: Any) -> str:
    """A GBNF literal matching `value` serialized as JSON (ASCII only, so only \\ and " need escaping)."""
    text = json.dumps(value, ensure_ascii=True)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _alternatives(options: list[str]) -> str:
    return "( " + " | ".join(options) + " )"


class _SchemaConverter:
    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self.depth = 0

    def visit(self, schema: Any) -> str:
        """A GBNF expression for `schema`; objects and arrays get rules of their own."""
        self.depth += 1
        try:
            if self.depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"response_format schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
            return self._visit(schema)
        finally:
            self.depth -= 1

    def _visit(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return "value"  # true, {} or anything unreadable: any JSON value
        if "const" in schema:
            return f"{_literal(schema['const'])} ws"
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return _alternatives([_literal(v) for v in schema["enum"]]) + " ws"
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return _alternatives([self.visit(s) for s in schema[key]])
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return _alternatives([self.visit({**schema, "type": k}) for k in kind])
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        return kind if kind in _SCALARS else "value"

    def _rule(self, body: str) -> str:
        name = f"schema{len(self.rules)}"
        self.rules[name] = body
        return name

    def _object(self, schema: dict) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return "object"
        members = [f"{_literal(str(key))} ws \":\" ws {self.visit(sub)}" for key, sub in properties.items()]
        return self._rule('"{" ws ' + ' "," ws '.join(members) + ' "}" ws')

    def _array(self, schema: dict) -> str:
        item = self.visit(schema.get("items", True))
        return self._rule(f'"[" ws ( {item} ( "," ws {item} )* )? "]" ws')


# A forced call is written the Hermes way; the parser also reads the other formats a model may use unforced.
MAX_PARALLEL_CALLS = 8


def tool_call_grammar(functions: list[tuple[str, Any]], parallel: bool) -> str:
    """One `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (up to MAX_PARALLEL_CALLS with
    `parallel`) naming one of `functions` (name, parameters schema), its arguments following the schema."""
    converter = _SchemaConverter()
    calls = []
    for name, parameters in functions:
        arguments = converter.visit(parameters if parameters is not None else {"type": "object"})
        calls.append(f'"{{\\"name\\": " {_literal(name)} ", \\"arguments\\": " {arguments} "}}"')
    call = '"<tool_call>\\n" ' + _alternatives(calls) + ' "\\n</tool_call>"'
    repeat = f' ( "\\n" call ){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    rules = "".join(f"{name} ::= {body}\n" for name, body in converter.rules.items())
    return f"root ::= call{repeat}\ncall ::= {call}\n{rules}{_JSON_RULES}"
