"""Property-based fuzzing of the constraint builders and llguidance's compiler with hypothesis: whatever JSON
schema, regular expression, GBNF grammar or choice list a client sends, building its grammar
(cobali.http.protocol.structured, cobali.structured.grammars) and compiling it (GrammarCompiler.check) either succeeds
or raises a ValueError (a 400), within a few seconds: never another exception (a 500) and never a hang. A grammar
that compiles then gives masks for a few tokens without error (the first mask allows some token; a later one may
fail only as llguidance's error state, which the guide turns into the request's own failure).

A vocabulary of one token a byte here (every text can be written, as with a real model's byte-level vocabulary;
the fake backend's printable-ASCII one cannot write the bytes some grammars force, see
tests/unit/structured/test_structured_guide.py); tests/integration/test_grammar_fuzz_real.py compiles the same
inputs for the embedded model's. Derandomized and bounded, so every run tries the same inputs in a few seconds;
COBALI_GRAMMAR_FUZZ_EXAMPLES raises the count for a longer hunt by hand."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cobali.frontend.parsers.tools.tagged import Hermes
from cobali.http.protocol.structured import check_json_schema, schema_grammar
from cobali.structured.grammars import choice_grammar, gbnf_grammar, regex_grammar
from tests.structured_oracle import Hang, Oracle, bytes_oracle, bytes_tokenizer, time_limit

EXAMPLES = int(os.environ.get("COBALI_GRAMMAR_FUZZ_EXAMPLES", "150"))
TIME_LIMIT_S = 5
MASK_STEPS = 4
# llguidance's errors for a step that passes its limits (max_items_in_row, step_max_items, the lexer's fuel and
# states).
LIMIT_ERRORS = ("max is", "limit", "too many")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
BYTES = bytes_tokenizer()


def fresh() -> Oracle:
    """A compiler with nothing compiled: a template one example's matchers wore out (llguidance's lexer states are
    shared by every copy of a compiled grammar) must not fail the next example, or hypothesis's replay of it."""
    return bytes_oracle(BYTES)


def grammar_or_refusal(oracle: Oracle, build: Callable[[Any], str], given_input: Any,
                       seconds: float = TIME_LIMIT_S) -> str | None:
    """The grammar `build` writes for the input, compiled and run for a few masks; None when building or compiling
    refuses it with a ValueError. Anything else (another exception, a hang, a failed step) fails the test, naming
    the input."""
    try:
        with time_limit(seconds):
            grammar = build(given_input)
            oracle.compiler.check(grammar)
    except ValueError:
        return None
    except BaseException as err:  # RecursionError, TypeError, Hang, a Rust panic...: a 500 or a stuck worker
        raise AssertionError(f"{type(err).__name__}: {err} for {given_input!r}"[:2000]) from err
    assert isinstance(grammar, str), (grammar, given_input)
    try:
        with time_limit(seconds):
            run_masks(oracle, grammar)
    except (AssertionError, Hang) as err:
        raise AssertionError(f"{type(err).__name__}: {err} for {given_input!r}"[:2000]) from err
    return grammar


def run_masks(oracle: Oracle, grammar: str, steps: int = MASK_STEPS) -> None:
    """As the guide runs a request: a mask, a token it allows (drawn), fed back; the first mask allows a token (the
    compile checked it), and every token a mask allows is consumed, unless that passes one of llguidance's limits
    on a step's work (the guide fails the request then, as its own fault)."""
    matcher = oracle.compiler.matcher(grammar)
    eos = set(oracle.compiler.tokenizer.eos_tokens)
    rng = np.random.default_rng(len(grammar))
    for step in range(steps):
        allowed = oracle.allowed_tokens(matcher).tolist()
        if not allowed:  # a dead end or llguidance's runtime limits: the request's own failure
            assert step > 0, f"the compile passed, but the first mask allows nothing: {matcher.get_error()}"
            return
        others = [t for t in allowed if t not in eos]
        if not others:
            return
        token = int(rng.choice(others))
        if not matcher.consume_token(token):
            assert any(limit in matcher.get_error() for limit in LIMIT_ERRORS), \
                f"a token the mask allowed was refused: {matcher.get_error()}"
            return


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

# Hostile schemas: deep, cyclic, huge.
NESTINGS = {"items": lambda s: s, "allOf": lambda s: [s], "anyOf": lambda s: [s], "properties": lambda s: {"x": s},
            "$defs": lambda s: {"a": s}, "prefixItems": lambda s: [s]}


def _nested(key: str, depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {key: NESTINGS[key](schema)}
    return schema


deep = st.builds(_nested, st.sampled_from(sorted(NESTINGS)), st.integers(1, 400))
cycles = st.builds(lambda names, ref, extra: {"$defs": {n: {"$ref": f"#/$defs/{names[(i + 1) % len(names)]}", **extra}
                                                       for i, n in enumerate(names)}, "$ref": ref},
                   st.lists(st.sampled_from("ABCD"), min_size=1, max_size=4, unique=True),
                   st.sampled_from(["#", "#/$defs/A", "#/$defs/B"]),
                   st.sampled_from([{}, {"type": "object"}, {"anyOf": [{"type": "null"}]}, {"items": {"$ref": "#"}}]))
huge_enums = st.builds(lambda n, kind: {"enum": [kind(i) for i in range(n)]}, st.integers(100, 3000),
                       st.sampled_from([int, str, lambda i: {"k": i}, lambda i: "x" * (i % 50) + str(i)]))
long_strings = st.builds(lambda n, m: {"type": "string", "minLength": n, "maxLength": m},
                         st.integers(0, 5000), st.integers(0, 10**6))
hostile = deep | cycles | huge_enums | long_strings | st.builds(lambda p: {"type": "string", "pattern": p}, regexes)

# GBNF (and Lark) grammars: rules of alternatives of sequences, with llama.cpp's literals, classes, groups and
# repetitions, some referring to rules not defined; and text over GBNF's metacharacters.
RULES = ["root", "r1", "r2", "r3"]
gbnf_literals = st.text(alphabet="ab\"\\\n é{}", max_size=4).map(lambda t: '"' + t.replace("\\", "\\\\")
                                                                        .replace('"', '\\"').replace("\n", "\\n")
                                                                        + '"')
gbnf_classes = st.sampled_from(["[a-z]", "[^\\n]", "[0-9]", '[^"\\\\]', "[\\x00-\\x1f]", "[é-ü]", "[]",
                                "[\\u00e9]", "[a-]", "."])
gbnf_refs = st.sampled_from([*RULES[1:], *RULES, "undefined"])
gbnf_quantifiers = st.sampled_from(["", "", "*", "+", "?", "{2}", "{0,3}", "{1,}", "{5,2}", "{100000}"])


def _gbnf_extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return (st.lists(inner, min_size=1, max_size=4).map(" ".join)
            | st.lists(inner, min_size=2, max_size=3).map(" | ".join)
            | st.builds(lambda body, q: f"( {body} ){q}", inner, gbnf_quantifiers))


gbnf_bodies = st.recursive(st.builds(lambda atom, q: atom + q, gbnf_literals | gbnf_classes | gbnf_refs,
                                     gbnf_quantifiers), _gbnf_extend, max_leaves=10)
gbnf_grammars = st.builds(lambda bodies, comment: "\n".join(  # rules not drawn are a literal
    f"{name} ::= {body}" for name, body in zip(RULES, bodies + ['"x"'] * 4, strict=False)) + comment,
    st.lists(gbnf_bodies, min_size=1, max_size=4), st.sampled_from(["", "\n# comment", "\n\n"]))
lark_grammars = st.builds(lambda body, extra: f"start: {body}\n{extra}", gbnf_bodies.map(
    lambda b: b.replace("::=", ":")), st.sampled_from(["", "r1: \"a\"", "R2: /[a-z]+/", "%ignore \" \"",
                                                       "x: %json {\"type\": \"integer\"}", "%import common.NUMBER"]))
GBNF_ALPHABET = "root:=|()[]^-*+?{},.\"\\ abé\n#/%<>"
grammar_texts = gbnf_grammars | lark_grammars | st.text(alphabet=GBNF_ALPHABET, max_size=40)

choices = st.lists(st.text(max_size=8) | st.text(alphabet="\"\\/%[]()|:\n", max_size=6), max_size=300)


@FUZZ
@given(schema=documents | hostile)
def test_a_fuzzed_schema_gets_a_grammar_or_a_value_error(schema: Any) -> None:
    # As every route reads a schema: checked against the metaschema (check_json_schema), then built.
    grammar_or_refusal(fresh(), lambda s: schema_grammar(s, "json_schema"), schema)
    if isinstance(schema, dict):  # a tool's parameters are an object (chat_schemas.Function)
        grammar_or_refusal(fresh(), lambda s: (check_json_schema(s), Hermes().forced_call_grammar([("f", s)], True))[1],
                           schema)


@FUZZ
@given(pattern=regexes)
def test_a_fuzzed_regex_gets_a_grammar_or_a_value_error(pattern: str) -> None:
    grammar_or_refusal(fresh(), regex_grammar, pattern)
    grammar_or_refusal(fresh(), lambda p: schema_grammar({"type": "string", "pattern": p}, "json_schema"), pattern)


@FUZZ
@given(text=grammar_texts)
def test_a_fuzzed_gbnf_grammar_gets_a_grammar_or_a_value_error(text: str) -> None:
    grammar_or_refusal(fresh(), lambda t: gbnf_grammar(t, "grammar"), text)


@FUZZ
@given(listed=choices)
def test_a_fuzzed_choice_list_gets_a_grammar_or_a_value_error(listed: list[str]) -> None:
    grammar_or_refusal(fresh(), lambda c: choice_grammar(c, "guided_choice"), listed)


def test_the_timeout_catches_a_hang() -> None:
    def hang(_: Any) -> str:
        while True:
            pass

    try:
        grammar_or_refusal(fresh(), hang, None, seconds=0.2)
    except AssertionError as err:
        assert "Hang" in str(err)
        return
    raise AssertionError("the time limit did not fire")

