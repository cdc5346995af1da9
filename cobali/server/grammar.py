"""response_format and tools -> llama.cpp GBNF grammars: the schema check, and the forced tool call.

{"type": "json_object"} gets a generic JSON grammar (any object); {"type": "json_schema"} the schema's own
(json_schema_grammar.py says which keywords are held exactly and which are loosened).
"""

from __future__ import annotations

from typing import Any

import jsonschema

from cobali.server.gbnf import alternatives, json_literal
from cobali.server.json_schema_grammar import JSON_RULES, MAX_SCHEMA_DEPTH, SchemaConverter


def check_json_schema(schema: Any) -> None:
    """A schema that is not valid JSON Schema (draft 2020-12) is the client's bug: ValueError naming it."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object or a boolean")
    # Deeper schemas are refused (400): the conversion recurses, and a hostile schema would otherwise hit
    # Python's recursion limit (a 500). Real schemas nest a handful of levels.
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


# A forced call is written the Hermes way; the parser also reads the other formats a model may use unforced.
MAX_PARALLEL_CALLS = 8


def tool_call_grammar(functions: list[tuple[str, Any]], parallel: bool) -> str:
    """One `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (up to MAX_PARALLEL_CALLS with
    `parallel`) naming one of `functions` (name, parameters schema), its arguments following the schema."""
    converter = SchemaConverter()
    calls = []
    for name, parameters in functions:
        arguments = converter.visit_document(parameters if parameters is not None else {"type": "object"})
        calls.append(f'"{{\\"name\\": " {json_literal(name)} ", \\"arguments\\": " {arguments} "}}"')
    call = '"<tool_call>\\n" ' + alternatives(calls) + ' "\\n</tool_call>"'
    repeat = f' ( "\\n" call ){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    return f"root ::= call{repeat}\ncall ::= {call}\n{converter.rules_text()}{JSON_RULES}"
