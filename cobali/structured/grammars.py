"""Each kind of constraint a request may name, as an llguidance grammar (the JSON text LLMatcher compiles).

Nothing here compiles: llguidance checks a grammar when it is compiled (compiler.py), under the operator's
limits. What is checked here is what the builders themselves would otherwise trip on.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

if TYPE_CHECKING:  # a TypedDict of llguidance's stub only: the compiled module does not export it
    from llguidance._lib import JsonCompileOptions

# JSON as a model should write it: one space after ':' and ',', no free whitespace. Free whitespace lets a small
# model write newlines until max_tokens runs out, with every token allowed.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                                    "lenient": False}
MAX_CHOICES = 256  # alternatives of a choice


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """A JSON Schema's grammar: every keyword llguidance implements is held exactly; a keyword it does not
    implement fails the compile (llguidance is strict by default), so the client gets a 400, never an output
    that breaks its schema."""
    if schema is False:
        raise ValueError("the schema is `false`: it allows no output")
    # Overrides, not defaults: a schema's own "x-guidance" must not make the server loosen what it holds.
    return LLMatcher.grammar_from_json_schema({} if schema is True else prepared(schema), overrides=JSON_OPTIONS)


def prepared(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as cobali holds it:
    - every object that lists its properties and says nothing of others is closed to others, as vLLM's default
      backend and llama-server read a schema: a model then writes the properties asked for, not keys of its own
      invention until max_tokens (not where allOf merges objects: a closed member would refuse its siblings');
    - a `format` llguidance does not assert is an annotation, as JSON Schema 2020-12 reads every format by
      default (llguidance would refuse the whole schema)."""
    try:
        text = json.dumps(schema)
    except (RecursionError, ValueError):  # too deep to copy: llguidance refuses it with its own message
        return schema
    close = "allOf" not in text
    copy = json.loads(text)
    stack: list[Any] = [copy]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        properties = node.get("properties")
        if close and isinstance(properties, dict) and not OPEN_KEYWORDS & node.keys() and _lists_all(node, properties):
            node["additionalProperties"] = False
        if isinstance(node.get("format"), str) and node["format"] not in ASSERTED_FORMATS:
            del node["format"]
        for key, value in node.items():  # only where a schema stands: a property may be named "properties"
            if key in SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in SCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            elif key in SCHEMA_KEYS:
                stack.append(value)
    return copy


def _lists_all(node: dict[str, Any], properties: dict[str, Any]) -> bool:
    """Every required key is among the properties (one that is not is written as an additional property)."""
    required = node.get("required")
    return not isinstance(required, list) or all(key in properties for key in required)


SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SCHEMA_LISTS = frozenset({"prefixItems", "anyOf", "oneOf", "allOf"})
SCHEMA_KEYS = frozenset({"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                         "unevaluatedItems", "unevaluatedProperties"})
ASSERTED_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                              "uuid"})  # those llguidance holds
OPEN_KEYWORDS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})


JSON_OBJECT_GRAMMAR = json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """A regular expression's grammar (Rust's `regex` syntax: no lookarounds or backreferences, which
    llguidance refuses at compile time); the output must match it whole."""
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:  # llguidance would drop a dangling escape unseen
        raise ValueError("the regex ends in a lone backslash")
    return LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: list[str], name: str) -> str:
    """Exactly one of `choices`."""
    if not choices or len(choices) > MAX_CHOICES or not all(choices):
        raise ValueError(f"{name} must be 1 to {MAX_CHOICES} non-empty strings")
    return LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_literal(c) for c in choices))


def gbnf_grammar(text: str, name: str) -> str:
    """A llama.cpp GBNF (or Lark) grammar, read by llguidance's converter, never by llama.cpp's parser. The
    converter recurses once per nested group: a deep one is a 400 here, not the process's stack."""
    if not text.strip():
        raise ValueError(f"{name} is empty")
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(text))
    except RecursionError:
        raise ValueError(f"{name} nests too deeply") from None
    except Exception as err:  # the converter's own parse errors: any of several exception types
        raise ValueError(f"{name} is not a valid GBNF or Lark grammar: {err}") from None


# A forced tool call's grammar is its model's format's (cobali.frontend.parsers.tools): at most this many calls.
MAX_PARALLEL_CALLS = 8


def _lark_literal(text: str) -> str:
    """A Lark string literal: JSON's quoting, which llguidance's Lark reads."""
    return json.dumps(text)
