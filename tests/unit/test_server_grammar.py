"""response_format -> GBNF, checked for structure without a model (llama.cpp parses them in the
integration test)."""

from __future__ import annotations

import re

import pytest

from cobali.server.json_schema_grammar import JSON_OBJECT_GRAMMAR, json_schema_grammar

_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')


def rules(grammar: str) -> dict[str, str]:
    out = {}
    for line in filter(None, grammar.splitlines()):
        name, sep, body = line.partition("::=")
        assert sep, f"not a rule: {line!r}"
        out[name.strip()] = body
    return out


def assert_closed(grammar: str) -> None:
    """Every rule referenced is defined, and root exists."""
    defined = rules(grammar)
    assert "root" in defined
    for name, body in defined.items():
        for ref in re.findall(r"[A-Za-z][A-Za-z0-9-]*", _LITERAL.sub(" ", body)):
            assert ref in defined, f"rule {name} references undefined {ref}"


def test_json_object_grammar_roots_at_object() -> None:
    assert_closed(JSON_OBJECT_GRAMMAR)
    assert rules(JSON_OBJECT_GRAMMAR)["root"].strip() == "object"


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    {"type": "array", "items": {"type": "number"}},
    {"type": ["string", "null"]},
    {"anyOf": [{"type": "boolean"}, {"const": 3}]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}}}},
    {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"},
    {"type": "object", "properties": {"child": {"$ref": "#"}, "n": {"type": "integer"}}, "required": ["n"]},
    True,
    {},
])
def test_schema_grammars_are_closed(schema: object) -> None:
    assert_closed(json_schema_grammar(schema))


def root_body(grammar: str) -> str:
    """The root's expression: the document's own rule (ref0), or root's body when that is a plain rule name."""
    defined = rules(grammar)
    return defined["ref0"].strip() if defined["root"].strip() == "ref0" else defined["root"].strip()


def test_object_properties_in_schema_order_with_escaped_keys() -> None:
    grammar = json_schema_grammar({"type": "object", "properties": {'say "hi"': {"type": "boolean"},
                                                                     "n": {"type": "null"}},
                                   "required": ['say "hi"', "n"]})
    body = rules(grammar)[root_body(grammar)]
    # The key is emitted as its JSON text, "say \"hi\"", inside a GBNF literal.
    assert r'"\"say \\\"hi\\\"\""' in body
    assert body.index("boolean") < body.index("null")


def test_enum_and_const_are_literal_json() -> None:
    grammar = json_schema_grammar({"enum": ["red", 1, None]})
    assert root_body(grammar) == r'( "\"red\"" | "1" | "null" ) ws'
    assert root_body(json_schema_grammar({"const": True})) == '"true" ws'


def test_unsupported_keywords_fall_back_to_any_value() -> None:
    assert root_body(json_schema_grammar({"$ref": "https://example.com/s.json"})) == "value"
    assert root_body(json_schema_grammar({"type": "object"})) == "object"
    assert root_body(json_schema_grammar({"type": "string", "pattern": "(?=x)"})) == "string"


def test_a_reference_to_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="points at nothing"):
        json_schema_grammar({"$ref": "#/$defs/missing"})


@pytest.mark.parametrize("bounds", [{"minimum": 5, "maximum": 4}, {"exclusiveMinimum": 3, "exclusiveMaximum": 4},
                                    {"minimum": 2.5, "maximum": 2.9}])
def test_integer_bounds_no_integer_meets_are_refused(bounds: dict) -> None:
    with pytest.raises(ValueError, match="no integer lies between"):
        json_schema_grammar({"type": "integer", **bounds})
