"""The fuzzed JSON schemas, regular expressions, GBNF grammars and choice lists of
tests/unit/structured/test_grammar_fuzz.py, compiled for the embedded model's vocabulary (several bytes a token,
special tokens, several end tokens): each is a grammar whose masks run for a few tokens, or a ValueError, within a
few seconds. Derandomized and bounded.

This vocabulary has no token for some bytes (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xF1, 0xF2), and llama.cpp's
tokenizer drops them (U+40000 to U+BFFFF come out as their other bytes): llguidance, which tokenizes the bytes a
grammar forces with it, then allows a token that writes something else, and the guide fails the request when it is
sampled (its own 400). Inputs holding a character the vocabulary cannot write are left out."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings

from cobali.frontend.parsers.tools.tagged import Hermes
from cobali.http.protocol.structured import check_json_schema, schema_grammar
from cobali.structured.compiler import GrammarCompiler
from cobali.structured.grammars import choice_grammar, gbnf_grammar, regex_grammar
from tests.structured_oracle import Oracle, real_oracle
from tests.unit.structured.test_grammar_fuzz import (
    choices,
    documents,
    grammar_or_refusal,
    grammar_texts,
    hostile,
    regexes,
)

FUZZ = settings(max_examples=int(os.environ.get("COBALI_GRAMMAR_FUZZ_EXAMPLES", "60")), deadline=None,
                derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fresh(model_path: str):
    """A compiler with nothing compiled, on the model's vocabulary, for each input (test_grammar_fuzz.fresh)."""
    real = real_oracle(model_path)
    tokenizer = real.compiler.tokenizer
    return lambda: Oracle(GrammarCompiler(lambda: tokenizer), real.tokens_of)


@pytest.fixture(scope="module")
def writable(model_path: str):
    """Whether this vocabulary writes every character of an input's strings (keys included) back as itself."""
    tokenizer = real_oracle(model_path).compiler.tokenizer

    def strings(value: Any) -> Iterator[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield key
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)

    def check(value: Any) -> bool:
        chars = {c for text in strings(value) for c in text}
        return all(tokenizer.decode_bytes(tokenizer.tokenize_bytes(c.encode())) == c.encode() for c in chars)

    return check


def test_fuzzed_schemas_compile_or_are_refused(fresh, writable) -> None:
    @FUZZ
    @given(schema=documents | hostile)
    def compiles(schema: Any) -> None:
        assume(writable(schema))
        grammar_or_refusal(fresh(), lambda s: schema_grammar(s, "json_schema"), schema)
        if isinstance(schema, dict):
            grammar_or_refusal(fresh(), lambda s: (check_json_schema(s),
                                                   Hermes().forced_call_grammar([("f", s)], True))[1], schema)

    compiles()


def test_fuzzed_regexes_compile_or_are_refused(fresh, writable) -> None:
    @FUZZ
    @given(pattern=regexes)
    def compiles(pattern: str) -> None:
        assume(writable(pattern))
        grammar_or_refusal(fresh(), regex_grammar, pattern)

    compiles()


def test_fuzzed_gbnf_grammars_and_choices_compile_or_are_refused(fresh, writable) -> None:
    @FUZZ
    @given(text=grammar_texts, listed=choices)
    def compiles(text: str, listed: list[str]) -> None:
        assume(writable(text) and writable(listed))
        grammar_or_refusal(fresh(), lambda t: gbnf_grammar(t, "grammar"), text)
        grammar_or_refusal(fresh(), lambda c: choice_grammar(c, "guided_choice"), listed)

    compiles()
