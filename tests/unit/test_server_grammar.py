"""response_format -> GBNF, checked for structure without a model (llama.cpp parses them in the
integration test)."""

from __future__ import annotations

import re

import pytest

from cobali.server.json_schema_grammar import JSON_OBJECT_GRAMMAR, MAX_SCHEMA_DEPTH, json_schema_grammar
from cobali.server.schema_merge import merge

_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')


def rules(grammar: str) -> dict[str, str]:
    out = {}
    for line in filter(None, grammar.splitlines()):
        name, sep, body = line.partition("::=")
        assert sep, f"not a rule: {line!r}"
        out[name.strip()] = body
    return out


def assert_closed(grammar: str) -> None:
    """Every rule referenced is defined, root exists, and every rule is referenced (none written for nothing)."""
    defined = rules(grammar)
    assert "root" in defined
    referenced = set()
    for name, body in defined.items():
        for ref in re.findall(r"[A-Za-z][A-Za-z0-9-]*", _LITERAL.sub(" ", body)):
            assert ref in defined, f"rule {name} references undefined {ref}"
            referenced.add(ref)
    unused = {name for name in defined if name not in referenced and not name.startswith("format-")} - {"root"}
    assert not unused - set(rules(JSON_OBJECT_GRAMMAR)), f"rules nothing references: {unused}"


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
    {"type": "object", "properties": {k: {"type": "integer"} for k in "abcde"}, "required": ["c"]},
    {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}},
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


@pytest.mark.parametrize("schema", [
    {"$defs": {"A": {"$ref": "#/$defs/A"}}, "allOf": [{"$ref": "#/$defs/A"}]},
    {"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
    {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
    {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}}, "type": "object",
     "properties": {"x": {"$ref": "#/$defs/A"}}},
    {"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}], "type": "object"}}, "$ref": "#/$defs/A"},
    {"$ref": "#"},
])
def test_a_ref_cycle_that_reaches_no_schema_is_refused(schema: dict) -> None:
    with pytest.raises(ValueError, match=r"\$ref '#(/\$defs/[AB])?' refers back to itself"):
        json_schema_grammar(schema)


@pytest.mark.parametrize("schema, body", [
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "null"),  # was ref0 ::= ( ref0 | null ): llama.cpp refuses it
    ({"anyOf": [{"type": "null"}, {"anyOf": [{"$ref": "#"}]}]}, "null"),
    ({"allOf": [{"anyOf": [{"$ref": "#"}, {"type": "null"}]}]}, "null"),
    ({"oneOf": [{"$ref": "#"}, {"type": "array", "items": {"$ref": "#"}}]}, "schema1"),
    ({"$defs": {"B": {"$ref": "#"}}, "anyOf": [{"$ref": "#/$defs/B"}, {"type": "null"}]}, "( ref1 | null )"),
])
def test_an_any_of_branch_referring_back_before_writing_anything_is_left_out(schema: dict, body: str) -> None:
    """Left-recursive, so it adds no value the other branches don't (the least fixed point)."""
    grammar = json_schema_grammar(schema)
    assert_closed(grammar)
    assert root_body(grammar) == body
    starts = [name for name, rule in rules(grammar).items() for alt in rule.split("|")
              if f"{alt.strip(' ()')} ".startswith(f"{name} ")]
    assert not starts, grammar  # no rule has an alternative that starts with the rule itself


def test_an_object_or_array_referring_back_is_not_left_recursive() -> None:
    grammar = json_schema_grammar({"anyOf": [{"type": "object", "properties": {"a": {"$ref": "#"}}}, {"$ref": "#"}]})
    assert root_body(grammar) == "schema1"
    assert '"\\"a\\"" ws ":" ws ref0' in grammar


@pytest.mark.parametrize("schema, refused", [
    ({"anyOf": [{"$ref": "#"}]}, r"\$ref '#' refers back to itself before writing anything"),
    ({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}]}}, "type": "array", "items": {"$ref": "#/$defs/A"}},
     r"\$ref '#/\$defs/A' refers back to itself before writing anything"),
    ({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/B"}, {"type": "null"}]},
                "B": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "integer"}]}}, "$ref": "#/$defs/A"},
     r"\$ref '#/\$defs/A' refers back to itself through \$ref '#/\$defs/B' before writing anything"),
    ({"$defs": {"C": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},  # back through C, built earlier
      "anyOf": [{"type": "object", "properties": {"a": {"$ref": "#/$defs/C"}}}, {"$ref": "#/$defs/C"}]},
     r"\$ref '#' refers back to itself through \$ref '#/\$defs/C' before writing anything"),
])
def test_a_ref_referring_back_to_itself_before_writing_anything_is_refused(schema: dict, refused: str) -> None:
    with pytest.raises(ValueError, match=refused):
        json_schema_grammar(schema)


def test_a_reference_no_value_meets_is_refused_wherever_it_is_referred_to() -> None:
    """Its rule is not kept with an empty body, which would allow an empty text where it is referred to again."""
    grammar = json_schema_grammar({"$defs": {"N": False}, "anyOf": [
        {"$ref": "#/$defs/N"}, {"type": "array", "items": {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]}}]})
    assert_closed(grammar)
    assert "ref1" not in grammar


@pytest.mark.parametrize("key", ["items", "allOf", "anyOf", "properties"])
def test_deep_schemas_are_refused_not_a_recursion_error(key: str) -> None:
    wrap = {"items": lambda s: s, "allOf": lambda s: [s], "anyOf": lambda s: [s], "properties": lambda s: {"x": s}}
    schema: dict = {}
    for _ in range(2000):
        schema = {key: wrap[key](schema)}
    with pytest.raises(ValueError, match=f"deeper than {MAX_SCHEMA_DEPTH}"):
        json_schema_grammar(schema)


def test_a_required_key_not_declared_is_written_as_its_extra_schema() -> None:
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"]})
    assert r'"\"z\"" ws ":" ws value' in grammar
    typed = json_schema_grammar({"type": "object", "required": ["z"], "additionalProperties": {"type": "null"}})
    assert r'"\"z\"" ws ":" ws null' in typed
    with pytest.raises(ValueError, match="required property 'z' is not allowed"):
        json_schema_grammar({"type": "object", "properties": {"a": {}}, "required": ["z"],
                             "additionalProperties": False})


def test_all_of_takes_the_tighter_bound_and_unites_the_rest() -> None:
    assert merge([{"type": "integer", "minimum": 3, "maxLength": 9, "exclusiveMaximum": 50},
                  {"minimum": 5, "maxLength": 4, "exclusiveMaximum": 60, "title": "t"}]) == \
        {"type": "integer", "minimum": 5, "maxLength": 4, "exclusiveMaximum": 50}
    assert merge([{"type": ["number", "string"]}, {"type": "integer"}])["type"] == ["integer"]
    assert merge([{"enum": [1, 2, True]}, {"enum": [2, 1.5, True]}])["enum"] == [2, True]
    assert merge([{"properties": {"a": {"minimum": 1}}, "required": ["a"]},
                  {"properties": {"a": {"maximum": 2}, "b": {}}, "required": ["b", "a"]}]) == \
        {"properties": {"a": {"allOf": [{"minimum": 1}, {"maximum": 2}]}, "b": {}}, "required": ["a", "b"]}
    assert merge([{"prefixItems": [{"type": "string"}], "items": False}, {"items": {"minLength": 1}}]) == \
        {"prefixItems": [{"allOf": [{"type": "string"}, {"minLength": 1}]}], "items": False}
    assert merge([{"type": "string"}, {"type": "null"}]) is False
    assert merge([{"const": 1}, {"const": 2}]) is False
    with pytest.raises(ValueError, match="'pattern' different values"):
        merge([{"pattern": "a"}, {"pattern": "b"}])


def test_all_of_holds_each_members_additional_properties() -> None:
    closed = merge([{"properties": {"a": {}}, "additionalProperties": False},
                    {"properties": {"b": {"type": "integer"}}, "additionalProperties": {"type": "integer"}}])
    assert closed == {"properties": {"a": {"type": "integer"}, "b": False}, "additionalProperties": False}


def test_keywords_beside_a_ref_or_an_any_of_are_held() -> None:
    beside_ref = json_schema_grammar({"$defs": {"S": {"type": "string"}}, "$ref": "#/$defs/S", "maxLength": 2})
    assert root_body(beside_ref) == r'"\"" ( char ){0,2} "\"" ws'
    inner = json_schema_grammar({"$defs": {"S": {"type": "string"}}, "type": "object", "required": ["s"],
                                 "properties": {"s": {"$ref": "#/$defs/S", "maxLength": 2}}})
    assert r'"\"s\"" ws ":" ws "\"" ( char ){0,2} "\"" ws' in inner
    either = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}},
                                  "anyOf": [{"required": ["a"]}, {"properties": {"a": {"minimum": 0}}}]})
    assert "value" not in root_body(either)
    assert root_body(json_schema_grammar({"anyOf": [{"type": "integer"}, {"type": "null"}], "type": "integer"})) == \
        "integer"  # the null branch meets no value beside "type": left out


def test_enum_keeps_only_the_values_the_rest_of_the_schema_allows() -> None:
    assert root_body(json_schema_grammar({"enum": ["a", 1, "bb"], "type": "string", "maxLength": 1})) == r'"\"a\"" ws'
    with pytest.raises(ValueError, match="no value of the schema's enum"):
        json_schema_grammar({"const": 1, "type": "string"})


def test_prefix_items_keep_min_and_max_items() -> None:
    grammar = json_schema_grammar({"prefixItems": [{"type": "string"}, {"type": "null"}], "minItems": 1,
                                   "maxItems": 1})
    assert rules(grammar)[root_body(grammar)].strip() == '"[" ws string "]" ws'
    with pytest.raises(ValueError, match="needs 2 items but allows at most 1"):
        json_schema_grammar({"prefixItems": [{}], "items": False, "minItems": 2})


@pytest.mark.parametrize("schema, refused", [
    ({"enum": [1], "anyOf": [{"$ref": "#"}]}, "recurse without end"),  # was a RecursionError in jsonschema
    ({"enum": [1], "anyOf": [{"$ref": ""}]}, "recurse without end"),
    ({"type": "integer", "minimum": 10**4000}, "more than 100 digits"),  # was a RecursionError digit by digit
    ({"type": "integer", "maximum": -(10**4000)}, "more than 100 digits"),
])
def test_fuzzed_schemas_that_broke_the_translator_are_refused(schema: dict, refused: str) -> None:
    with pytest.raises(ValueError, match=refused):
        json_schema_grammar(schema)


@pytest.mark.parametrize("schema", [
    {"type": "integer", "maximum": 10**400},  # math.isfinite of an int past floats overflowed
    {"enum": [10**400], "multipleOf": 0.5},  # jsonschema's multipleOf overflowed: loosened, as multiples are
])
def test_integers_past_floats_get_a_grammar(schema: dict) -> None:
    assert_closed(json_schema_grammar(schema))


def test_a_repeated_array_item_with_groups_is_one_rule() -> None:
    """llama.cpp refuses a repetition whose groups times its count pass 2000: the item is named once instead."""
    grammar = json_schema_grammar({"type": "array", "items": {"type": "integer", "minimum": -7, "maximum": 123456},
                                   "maxItems": 500})
    item = next(name for name, body in rules(grammar).items() if body.strip().startswith('( "-" [1-7]'))
    assert f'( "," ws {item} ){{0,499}}' in grammar
