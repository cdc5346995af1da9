"""Structured outputs as vLLM and llama-server spell them, beside OpenAI's response_format.

- vLLM: `structured_outputs` with one of `choice`, `json`, `regex`, `grammar`, `json_object`, and its older
  top-level extras `guided_choice`, `guided_json`, `guided_regex`, `guided_grammar`;
- llama-server: top-level `grammar` (GBNF) and `json_schema`.

Each becomes a llama.cpp GBNF grammar for the request's sampler chain. At most one may be given: two would
constrain the output in ways the client cannot have meant together. A regex the grammar cannot express
(regex_grammar.py: lookarounds, backreferences, ...) is a 400 naming it, never an output it does not hold.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import Field, model_validator

from cobali.server.bodies import Body, RequestBody
from cobali.server.gbnf import gbnf_literal
from cobali.server.grammar import check_json_schema
from cobali.server.json_schema_grammar import JSON_OBJECT_GRAMMAR, json_schema_grammar
from cobali.server.regex_grammar import regex_grammar

MAX_CHOICES = 256  # alternatives of a choice; each is one literal of the grammar


def choice_grammar(choices: list[str], name: str) -> str:
    if not choices or len(choices) > MAX_CHOICES or not all(choices):
        raise ValueError(f"{name} must be 1 to {MAX_CHOICES} non-empty strings")
    return "root ::= " + " | ".join(gbnf_literal(c) for c in choices)


def schema_grammar(schema: Any, name: str) -> str:
    """vLLM takes a JSON schema as an object or as its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name} is not valid JSON: {err}") from None
    check_json_schema(schema)
    return json_schema_grammar(schema)


def raw_grammar(grammar: str, name: str) -> str:
    if not grammar.strip():
        raise ValueError(f"{name} is empty")
    return grammar  # compiled by llama.cpp when the request is checked: a bad one is a 400 then


def pattern_grammar(pattern: str, name: str) -> str:
    try:
        return regex_grammar(pattern)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


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
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of choice, json, regex, grammar, json_object")
        return self

    def to_grammar(self) -> str:
        if self.choice is not None:
            return choice_grammar(self.choice, "structured_outputs.choice")
        if self.json_schema is not None:
            return schema_grammar(self.json_schema, "structured_outputs.json")
        if self.grammar is not None:
            return raw_grammar(self.grammar, "structured_outputs.grammar")
        if self.regex is not None:
            return pattern_grammar(self.regex, "structured_outputs.regex")
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
    "guided_grammar": raw_grammar,
    "guided_regex": pattern_grammar,
    "grammar": raw_grammar,
    "json_schema": schema_grammar,
}
