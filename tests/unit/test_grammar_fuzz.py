"""Property-based fuzzing of the grammar translators with hypothesis: whatever JSON schema or regular expression a
client sends, the translator returns a grammar or refuses it with a ValueError (a 400), within a few seconds:
never another exception (a 500) and never a hang. (That llama.cpp compiles what they return is fuzzed in
tests/integration/test_grammar_fuzz_real.py.) Derandomized and bounded, so every run tries the same inputs in a
few seconds; COBALI_GRAMMAR_FUZZ_EXAMPLES raises the count for a longer hunt by hand."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cobali.server.grammar import check_json_schema, tool_call_grammar
from cobali.server.json_schema_grammar import json_schema_grammar
from cobali.server.regex_grammar import json_string_expression, regex_grammar
from cobali.server.structured import pattern_grammar, schema_grammar

EXAMPLES = int(os.environ.get("COBALI_GRAMMAR_FUZZ_EXAMPLES", "400"))
TIME_LIMIT_S = 5
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


class Hang(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def alarm(_signum: int, _frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def grammar_or_refusal(translate: Callable[[Any], str], given_input: Any) -> str | None:
    """The grammar `translate` writes for the input, or None when it refuses it with a ValueError; anything else
    (another exception, a hang) fails the test, naming the input."""
    try:
        with time_limit(TIME_LIMIT_S):
            grammar = translate(given_input)
    except ValueError:
        return None
    except BaseException as err:  # RecursionError, TypeError, Hang, ...: a 500 or a stuck worker
        raise AssertionError(f"{type(err).__name__}: {err} for {given_input!r}"[:2000]) from err
    assert isinstance(grammar, str) and grammar.startswith("root ::= "), (grammar, given_input)
    return grammar


# Regular expressions: syntactically valid ones built piece by piece, and arbitrary text over the metacharacters.
REGEX_ALPHABET = "ab0.|*+?{},-^$()[]\\dDwWsSbBAZxu:=!<>P#n\"'é\u0000\n"
regex_chars = st.sampled_from(list("ab0 -_/\"'é\\{}")).map(lambda c: "\\" + c if c in "\\{}" else c)
regex_atoms = (regex_chars | st.sampled_from([".", r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", r"\x41", r"\u00e9",
                                              r"\n", r"\t", r"\0", r"\x00", r"\.", r"\-", r"\"", r"\\"])
               | st.builds(lambda neg, body: f"[{neg}{body}]", st.sampled_from(["", "^"]),
                           st.text(alphabet="az09-_.\"\\]^", min_size=1, max_size=5).map(
                               lambda s: s.replace("\\", "\\\\").replace("]", "\\]").replace("^", "\\^")))
               | st.sampled_from(["[a-z]", "[^a-z]", "[\\d\\s]", "[^\\x00-\\x1f]", "[\\x00-\\U0010ffff]", "[]a]"]))
quantifiers = st.sampled_from(["", "", "*", "+", "?", "*?", "{2}", "{0,3}", "{1,}", "{,2}", "{0}", "{0,0}", "{3,1000}",
                               "{1000}", "{,}"])


def _regex_extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    group = st.builds(lambda kind, body, q: f"({kind}{body}){q}", st.sampled_from(["", "?:", "?P<g>", "?<n>"]),
                      inner, quantifiers)
    return (group | st.lists(inner, min_size=1, max_size=4).map("".join)
            | st.lists(inner, min_size=2, max_size=3).map("|".join)
            | st.builds(lambda a, q: a + q, regex_atoms, quantifiers))


valid_regexes = st.builds(lambda head, body, tail: head + body + tail, st.sampled_from(["", "^", r"\A"]),
                          st.recursive(regex_atoms, _regex_extend, max_leaves=12), st.sampled_from(["", "$", r"\Z"]))
regexes = valid_regexes | st.text(alphabet=REGEX_ALPHABET, max_size=24) | st.text(max_size=12)

# JSON-schema-like documents: the keywords the translator reads, with sensible values and junk of every kind.
keys = st.sampled_from(["a", "b", "x", "$defs", "é", "", "a/b", 'q"', "\u0000"]) | st.text(max_size=4)
REFS = ["#", "#/$defs/a", "#/$defs/b", "#/$defs/a/properties/x", "#/$defs/a/items", "#/$defs/missing",
        "#/definitions/a", "#/properties/a", "#/$defs/a~1b", "#/$defs/a/anyOf/0", "#/$defs/a/prefixItems/1",
        "other.json#/x", "#/$defs", "#/items", "#/0", "#x", ""]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null"]
types = st.sampled_from(TYPES) | st.lists(st.sampled_from(TYPES), min_size=1, max_size=3, unique=True)
lengths = st.integers(0, 4) | st.integers(0, 2000) | st.sampled_from([2.0, 10**40])
numbers = st.integers(-20, 20) | st.floats(-1e20, 1e20) | st.sampled_from([10**17, -(10**40), 1e308, 0.5, 10**400])
values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=4),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
                      max_leaves=6)
FORMATS = ["date", "time", "date-time", "uuid", "email"]


def _schemas(bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Schemas whose keywords hold values of their kind, or, one keyword in a few, `bad` (st.nothing(): none)."""

    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        schema_list = st.lists(inner, min_size=1, max_size=3)
        keywords = {
            "type": types, "properties": st.dictionaries(keys, inner, max_size=3),
            "required": st.lists(keys, max_size=3, unique=True), "additionalProperties": inner,
            "patternProperties": st.dictionaries(st.sampled_from(["^a", "x"]), inner, max_size=1),
            "items": inner, "prefixItems": schema_list, "minItems": lengths, "maxItems": lengths,
            "minLength": lengths, "maxLength": lengths, "pattern": valid_regexes, "format": st.sampled_from(FORMATS),
            "enum": st.lists(values, max_size=3), "const": values, "anyOf": schema_list, "oneOf": schema_list,
            "allOf": schema_list, "$ref": st.sampled_from(REFS), "minimum": numbers, "maximum": numbers,
            "exclusiveMinimum": numbers, "exclusiveMaximum": numbers, "title": st.text(max_size=3),
            "multipleOf": st.sampled_from([1, 2, 0.5, 1e-300, 3.0, 10**30]),
        }
        good = st.fixed_dictionaries({}, optional={key: value for key, value in keywords.items()})
        return good | good | st.fixed_dictionaries({}, optional={key: value | bad for key, value in keywords.items()})

    leaves = (st.booleans() | st.just({}) | st.fixed_dictionaries({"type": st.sampled_from(TYPES)})
              | st.fixed_dictionaries({"$ref": st.sampled_from(REFS)}) | bad)
    inner = st.recursive(leaves, extend, max_leaves=10)
    with_defs = st.builds(lambda body, defs: {**body, "$defs": defs} if isinstance(body, dict)
                          else {"$defs": defs, "allOf": [body]},
                          inner, st.dictionaries(st.sampled_from(["a", "b", "a/b"]), inner, max_size=2) | bad)
    return inner | with_defs | with_defs


# Junk where a keyword wants something else: wrong types, negative and float lengths, huge numbers, unicode.
junk = (st.none() | st.booleans() | st.integers(-3, 3) | st.integers(-(10**30), 10**30)
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6)
        | st.lists(st.integers(0, 3), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
        | st.sampled_from([[], -1, 1.5, "any", ["string", "string"]]) | regexes)
documents = _schemas(st.nothing()) | _schemas(junk)


@FUZZ
@given(schema=documents)
def test_a_fuzzed_schema_gets_a_grammar_or_a_value_error(schema: Any) -> None:
    # As every route reads a schema: checked against the metaschema (check_json_schema), then translated.
    grammar_or_refusal(lambda s: schema_grammar(s, "json_schema"), schema)
    grammar_or_refusal(lambda s: (check_json_schema(s), tool_call_grammar([("f", s)], parallel=True))[1], schema)


@FUZZ
@given(pattern=regexes)
def test_a_fuzzed_regex_gets_a_grammar_or_a_value_error(pattern: str) -> None:
    grammar_or_refusal(regex_grammar, pattern)
    grammar_or_refusal(lambda p: pattern_grammar(p, "guided_regex"), pattern)
    grammar_or_refusal(lambda p: "root ::= " + json_string_expression(p, "char"), pattern)
    grammar_or_refusal(json_schema_grammar, {"type": "string", "pattern": pattern})


def test_the_timeout_catches_a_hang() -> None:
    def hang(_: Any) -> str:
        while True:
            pass

    try:
        with time_limit(0.1):
            hang(None)
    except Hang:
        return
    raise AssertionError("the time limit did not fire")

