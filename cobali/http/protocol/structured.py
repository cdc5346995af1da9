"""Structured outputs as vLLM and llama-server spell them, beside OpenAI's response_format.

- vLLM: `structured_outputs` with one of `choice`, `json`, `regex`, `grammar`, `json_object`, and its older
  top-level extras `guided_choice`, `guided_json`, `guided_regex`, `guided_grammar`;
- llama-server: top-level `grammar` (GBNF) and `json_schema`.

Each becomes an llguidance grammar (cobali.structured.grammars), compiled under the operator's limits before the
request is queued: whatever llguidance cannot hold exactly (an unknown schema keyword, a lookaround in a regex)
is a 400 naming it, never an output that breaks the constraint. At most one may be given: two would constrain
the output in ways the client cannot have meant together.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
from pydantic import Field, model_validator

from cobali.http.protocol.bodies import Body, RequestBody
from cobali.structured.grammars import (
    JSON_OBJECT_GRAMMAR,
    choice_grammar,
    gbnf_grammar,
    json_schema_grammar,
    regex_grammar,
)
from cobali.structured.schema_size import check_inlined_size

# jsonschema's metaschema check recurses once per level: deeper schemas are a 400, not a RecursionError.
MAX_SCHEMA_DEPTH = 64


def check_json_schema(schema: Any, name: str = "the schema") -> None:
    """A schema that is not valid JSON Schema (draft 2020-12) is the client's bug: ValueError naming it."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{name} must be a JSON object or a boolean")
    if _nesting(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{name} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(part) for part in err.path) or "the top level"
        raise ValueError(f"invalid JSON schema ({name}) at {where}: {err.message}") from None
    try:
        check_inlined_size(schema)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def _nesting(value: Any) -> int:
    """How deep JSON containers nest, without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def schema_grammar(schema: Any, name: str) -> str:
    """vLLM takes a JSON schema as an object or as its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} is not valid JSON: {err}") from None
    check_json_schema(schema, name)
    return json_schema_grammar(schema)


class StructuredOutputs(Body):
    """vLLM's `structured_outputs`: exactly one constraint."""

    choice: list[str] | None = None
    json_schema: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    grammar: str | None = None
    regex: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [k for k in ("choice", "json_schema", "grammar", "regex", "json_object")
                 if getattr(self, k) is not None and (k != "json_object" or self.json_object)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of choice, json, regex, grammar, json_object")
        return self

    def to_grammar(self) -> str:
        if self.choice is not None:
            return choice_grammar(self.choice, "structured_outputs.choice")
        if self.json_schema is not None:
            return schema_grammar(self.json_schema, "structured_outputs.json")
        if self.grammar is not None:
            return gbnf_grammar(self.grammar, "structured_outputs.grammar")
        if self.regex is not None:
            return regex_grammar(self.regex)
        return JSON_OBJECT_GRAMMAR


class StructuredRequest(RequestBody):
    """The structured-output fields of a generation request, beside response_format (schemas.py)."""

    structured_outputs: StructuredOutputs | None = None
    guided_choice: list[str] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_grammar: str | None = None
    guided_regex: str | None = None
    grammar: str | None = None  # llama-server
    json_schema: dict[str, Any] | bool | None = None  # llama-server

    def asks_grammar(self) -> bool:
        """Whether the output is constrained: a grammar to build and compile, never on the event loop however
        short the body (a short regex or schema can compile to a large automaton)."""
        return any(getattr(self, name) is not None for name in _GRAMMARS)

    def structured_grammar(self, response_format_grammar: str | None) -> str | None:
        """The one grammar asked for (response_format's, already built, included); ValueError for several."""
        grammars = {name: build(getattr(self, name), name) for name, build in _GRAMMARS.items()
                    if getattr(self, name) is not None}
        if response_format_grammar is not None:
            grammars["response_format"] = response_format_grammar
        if len(grammars) > 1:
            raise ValueError(f"{' and '.join(sorted(grammars))} constrain the output together: give one")
        return next(iter(grammars.values()), None)


# Each field's grammar, from its value and its name (for the error that refuses it).
_GRAMMARS: dict[str, Callable[[Any, str], str]] = {
    "structured_outputs": lambda value, _name: value.to_grammar(),
    "guided_choice": choice_grammar,
    "guided_json": schema_grammar,
    "guided_grammar": gbnf_grammar,
    "guided_regex": lambda value, _name: regex_grammar(value),
    "grammar": gbnf_grammar,
    "json_schema": schema_grammar,
}
