"""The grammars the translators write for fuzzed JSON schemas and regular expressions (the inputs of
tests/unit/test_grammar_fuzz.py), read by llama.cpp itself: every grammar they return compiles (GrammarCheck: the
embedded model's vocabulary only, milliseconds a grammar). Derandomized and bounded to a few seconds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given

from cobali.backends.llama_cpp.grammar_check import GrammarCheck
from cobali.server.regex_grammar import json_string_expression, regex_grammar
from cobali.server.structured import schema_grammar
from tests.unit.test_grammar_fuzz import FUZZ, documents, grammar_or_refusal, regexes


@pytest.fixture(scope="module")
def checker(model_path: str) -> Iterator[GrammarCheck]:
    check = GrammarCheck(model_path)
    yield check
    check.close()


def assert_compiles(checker: GrammarCheck, grammar: str | None, given_input: object) -> None:
    assert grammar is None or checker.compiles(grammar), f"llama.cpp refuses the grammar for {given_input!r}"


def test_fuzzed_schema_grammars_compile(checker: GrammarCheck) -> None:
    @FUZZ
    @given(schema=documents)
    def compiles(schema: object) -> None:
        assert_compiles(checker, grammar_or_refusal(lambda s: schema_grammar(s, "json_schema"), schema), schema)

    compiles()


def test_fuzzed_regex_grammars_compile(checker: GrammarCheck) -> None:
    @FUZZ
    @given(pattern=regexes)
    def compiles(pattern: str) -> None:
        assert_compiles(checker, grammar_or_refusal(regex_grammar, pattern), pattern)
        inside = grammar_or_refusal(lambda p: f"root ::= {json_string_expression(p, 'char')}\nchar ::= [a-z]\n",
                                    pattern)
        assert_compiles(checker, inside, pattern)

    compiles()
