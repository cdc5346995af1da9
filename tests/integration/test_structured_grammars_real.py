"""The grammars built from regular expressions and JSON schemas, read by llama.cpp itself: which texts they
let the embedded model's vocabulary write (GrammarCheck: no model numerics, so the same on every machine),
and what the model writes under them when it samples."""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from datetime import datetime

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cobali.backends.base import SamplingParams
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.grammar_check import GrammarCheck
from cobali.backends.llama_cpp_config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import FinishReason
from cobali.server.json_schema_grammar import json_schema_grammar
from cobali.server.regex_grammar import regex_grammar

PATTERNS = [
    r"\d{3}-\d{4}", r"[A-Z][a-z]+( [A-Z][a-z]+)*", r"(cat|dog)s?", r"[^,\n]{1,8}(,[^,\n]{1,8}){0,3}",
    r"^\w+@\w+\.(com|org)$", r"a.c", r"\s*\(\d+\)\s*", r"[\]\-^]+", r"x{2,}y{,2}z?", r"(?:ab)+|c",
    r"(?P<year>\d\d)\.\d", r"[\x41-\x43\u00e9]+", r"\\[n\"]", r'"quoted"', r"", r"a|", r"()a",
    r"[^a-z]{0,5}", r"\W\D\S", r"\x01?a", r"é+ü", r"[\d\s]+?x", r"\t\n", r"a{", r"a{{2}", r"x{,}y{}",
]
TEXTS = st.text(alphabet=st.sampled_from(list("abcdxyz019-,. \n\t()@ABC\"\\]^éü{")), max_size=10)
EXAMPLES = settings(max_examples=40, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def checker(model_path: str):
    check = GrammarCheck(model_path)
    yield check
    check.close()


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_regex_grammar_allows_exactly_the_full_matches(checker: GrammarCheck, pattern: str) -> None:
    grammar = regex_grammar(pattern)

    @EXAMPLES
    @given(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True))
    def matches_are_allowed(text: str) -> None:
        # This vocabulary has no token for some bytes, and llama.cpp's grammars never match a NUL.
        if "\0" not in text and checker.can_write(text):
            assert checker.allows(grammar, text)

    @EXAMPLES
    @given(TEXTS)
    def others_are_not(text: str) -> None:
        assert checker.allows(grammar, text) == bool(re.fullmatch(pattern, text, re.ASCII))

    matches_are_allowed()
    others_are_not()


PET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                        "kind": {"enum": ["cat", "dog"]}}, "required": ["name", "kind"]}
PERSON = {  # as pydantic writes a model with a nested model, an optional field and a list
    "$defs": {"Pet": PET},
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1}, "age": {"type": "integer"},
                   "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}, "maxItems": 2},
                   "email": {"anyOf": [{"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}, {"type": "null"}]}},
    "required": ["name", "pets"],
}
TREE = {"type": "object", "properties": {"value": {"type": "integer"}, "children": {"type": "array",
                                                                                      "items": {"$ref": "#"}}},
        "required": ["value", "children"]}
OPTIONAL = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}}}
FORMATS = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                            "t": {"type": "string", "format": "date-time"},
                                            "u": {"type": "string", "format": "uuid"}}, "required": ["d", "t", "u"]}
MERGED = {"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"y": {"type": "integer"}}, "required": ["y"]}],
          "$defs": {"A": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}
MAP = {"type": "object", "additionalProperties": {"type": "integer"}}
TUPLE = {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False}
TUPLE_MORE = {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}}
BOUNDED = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}
UNDECLARED = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "z"]}
EITHER = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
TIGHTER = {"allOf": [{"type": "integer", "minimum": 3, "maximum": 50}, {"minimum": 5, "maximum": 60}]}
NARROWER = {"allOf": [{"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                      {"minItems": 2, "items": {"minimum": 0}}]}
CLOSED = {"allOf": [{"properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                    {"properties": {"b": {"type": "string"}}}]}
REF_BESIDE = {"$defs": {"S": {"type": "string"}}, "$ref": "#/$defs/S", "maxLength": 2}
TUPLE_BOUNDED = {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "minItems": 1,
                 "maxItems": 3, "items": {"type": "boolean"}}
ENUM_TYPED = {"enum": ["a", 1, "bb", None], "type": "string", "maxLength": 1}
CONTROL = {"type": "string", "pattern": "^[\\x01-\\x03a]+\\x02$"}
SEARCH = {"type": "string", "pattern": "ab+c"}
ESCAPED = {"type": "string", "pattern": '^a"b\\\\c[\\n"]$'}
# A branch referring back before anything is written: left out (llama.cpp refuses the left recursion); last, so
# that jsonschema meets it only for a value the other branches refuse, and then loops (see `valid`).
BACK = {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}, {"$ref": "#"}]}

CASES = [  # (schema, texts it must allow, texts it must refuse): each refused one breaks the schema
    (PERSON, ['{"name": "Ann", "pets": []}', '{"name": "A", "pets": [], "email": null}',
              '{"name": "Ann", "age": -3, "pets": [{"name": "Rex", "kind": "dog"}], "email": "a@b.com"}'],
     ['{"pets": []}', '{"name": "", "pets": []}', '{"name": "A", "pets": [{"name": "Rexxxxxxx", "kind": "dog"}]}',
      '{"name": "A", "pets": [{"name": "R", "kind": "cow"}]}', '{"name": "A", "pets": [], "email": "A@b.com"}',
      '{"name": "A", "pets": [{"name": "a", "kind": "cat"}, {"name": "b", "kind": "cat"}, '
      '{"name": "c", "kind": "cat"}]}']),
    (TREE, ['{"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": []}]}'],
     ['{"value": 1, "children": [{"value": 2}]}', '{"value": 1, "children": [3]}']),
    (OPTIONAL, ["{}", '{"b": true}', '{"a": 1, "c": null}', '{"a": 1, "b": false, "c": null}'],
     ['{"a": 1,}', '{, "b": true}', '{"b": true "c": null}', '{"a": true}']),
    (FORMATS, ['{"d": "2024-02-28", "t": "1999-12-31T23:59:59.5Z", "u": "123e4567-e89b-12d3-a456-426614174000"}'],
     ['{"d": "2024-02-30", "t": "1999-12-31T23:59:59Z", "u": "123e4567-e89b-12d3-a456-426614174000"}',
      '{"d": "2024-04-31", "t": "1999-12-31T23:59:59Z", "u": "123e4567-e89b-12d3-a456-426614174000"}',
      '{"d": "2024-01-01", "t": "1999-12-31 23:59:59Z", "u": "123e4567-e89b-12d3-a456-426614174000"}',
      '{"d": "2024-01-01", "t": "1999-12-31T23:59:59Z", "u": "123e4567e89b12d3a456426614174000"}']),
    (MERGED, ['{"x": "a", "y": 1}'], ['{"x": "a"}', '{"y": 1}']),
    (MAP, ["{}", '{"k": 1, "j": 2}'], ['{"k": "1"}', '{"k": 1, }']),
    (TUPLE, ['["a", 1]'], ['["a", 1, 2]', '[1, "a"]', '["a", "b"]']),
    (TUPLE_MORE, ['["a"]', '["a", 1, 2]'], ['["a", "b"]', "[1]"]),
    (BOUNDED, ["[1, 2]", "[1, 2, 3]"], ["[1]", "[1, 2, 3, 4]", "[]"]),
    (SEARCH, ['"xxabbcyy"', '"abc"'], ['"ac"', '"abd"']),
    (ESCAPED, ['"a\\"b\\\\c\\n"', '"a\\"b\\\\c\\""'], ['"a\\"b\\\\cx"', '"a\\"b\\c\\n"']),
    (UNDECLARED, ['{"a": 1, "z": 3}', '{"a": 1, "z": [1, "x"]}'], ['{"a": 1}', '{"z": 1}', "{}"]),
    (EITHER, ['{"a": 1}', '{"b": "x"}', '{"a": 1, "b": "x"}'], ["3", "{}", '{"a": "x"}']),
    (TIGHTER, ["5", "50"], ["3", "4", "51", "60"]),
    (NARROWER, ["[1, 2]", "[1, 2, 3]"], ["[1]", "[1, -2]", "[1, 2, 3, 4]", '["a", 1]']),
    (CLOSED, ["{}", '{"a": 1}'], ['{"b": "x"}', '{"a": 1, "b": "x"}']),
    (REF_BESIDE, ['"a"', '"ab"'], ['"abc"', "1"]),
    (TUPLE_BOUNDED, ['["a"]', '["a", 1]', '["a", 1, true]'], ["[]", '["a", 1, true, false]', "[1]"]),
    (ENUM_TYPED, ['"a"'], ["1", '"bb"', "null"]),
    (CONTROL, ['"a\\u0002"', '"\\u0001\\u0003\\u0002"'], ['"\\u0004\\u0002"', '"a\\u0001"']),
    (BACK, ["null", "[]", "[null, [[], null]]"], ["1", "[1]", "{}", "[null, null, null]"]),
]


# jsonschema checks date-time only with a package of its own installed: RFC 3339's production, checked here.
FORMAT_CHECKER = jsonschema.FormatChecker()


@FORMAT_CHECKER.checks("date-time")
def is_date_time(text: str) -> bool:
    shape = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)"
    return bool(re.fullmatch(shape, text)) and bool(datetime.fromisoformat(text.replace("Z", "+00:00")))


def valid(validator: jsonschema.Draft202012Validator, value: object) -> bool:
    """jsonschema's answer; a left-recursive $ref it loops on holds no value (its least fixed point: BACK)."""
    try:
        return validator.is_valid(value)
    except RecursionError:
        return False


@pytest.mark.parametrize("schema, allowed, refused", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_a_schema_grammar_holds_the_schema(checker: GrammarCheck, schema: dict, allowed: list[str],
                                           refused: list[str]) -> None:
    grammar = json_schema_grammar(schema)
    validator = jsonschema.Draft202012Validator(schema, format_checker=FORMAT_CHECKER)
    for text in allowed:
        assert valid(validator, json.loads(text)), text  # the cases themselves are right
        assert checker.allows(grammar, text), text
    for text in refused:
        with contextlib.suppress(json.JSONDecodeError):  # not JSON at all: refused for sure
            assert not valid(validator, json.loads(text)), text
        assert not checker.allows(grammar, text), text


def test_maps_and_bounds_llama_cpp_would_refuse_are_not_built(checker: GrammarCheck) -> None:
    """Bounds near llama.cpp's repetition limits still give grammars it parses (past MAX_BOUND, loosened)."""
    for schema in ({"type": "array", "items": PET, "maxItems": 500},
                   {"type": "string", "minLength": 400, "maxLength": 100000}):
        assert checker.compiles(json_schema_grammar(schema))


SAMPLED = [  # bounded, so a sampling model always reaches the end
    ("Give a person as JSON.", json_schema_grammar(PERSON), lambda text: jsonschema.validate(json.loads(text), PERSON)),
    ("A date as JSON.", json_schema_grammar(FORMATS),
     lambda text: jsonschema.validate(json.loads(text), FORMATS, format_checker=FORMAT_CHECKER)),
    ("Phone number:", regex_grammar(r"\(\d{3}\) \d{3}-\d{4}"),
     lambda text: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text) or pytest.fail(text)),
    ("Name a pet:", regex_grammar(r"(cat|dog|bird)s?( and (cat|dog|bird)s?)?"),
     lambda text: re.fullmatch(r"(cat|dog|bird)s?( and (cat|dog|bird)s?)?", text) or pytest.fail(text)),
]


def test_the_model_samples_only_what_the_grammar_holds(model_path: str) -> None:
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=8, n_batch=256))
    try:
        engine = Engine(backend, EngineConfig(mode="cont", max_slots=8, n_batch=256))
        jobs = [(prompt, grammar, check, seed) for prompt, grammar, check in SAMPLED for seed in (1, 2)]
        results = [engine.submit(prompt, SamplingParams(max_tokens=400, temperature=1.0, seed=seed, grammar=grammar))
                   for prompt, grammar, _, seed in jobs]
        engine.run_until_done()
    finally:
        backend.close()
    for (_, _, check, _), result in zip(jobs, results, strict=True):
        assert result.finish_reason is FinishReason.STOP, result.text
        check(result.text)


def test_a_property_is_written_once(checker: GrammarCheck) -> None:
    """Duplicate keys parse (the last wins), so the schema check above cannot see them; the grammar refuses."""
    grammar = json_schema_grammar(OPTIONAL)
    assert checker.allows(grammar, '{"a": 1, "b": false}')
    assert not checker.allows(grammar, '{"a": 1, "b": true, "b": false}')


def test_sampling_under_a_grammar_draws_the_allowed_tokens_renormalised(model_path: str,
                                                                        checker: GrammarCheck) -> None:
    """A refused draw is masked and drawn again: with temperature alone the first token must follow the model's
    distribution over the tokens the grammar allows, renormalised (2000 seeded draws from one logits row)."""
    grammar = 'root ::= " cat" | " dog" | " bird" | " fish" | " horse" | " snake" | " mouse"'
    allowed = sorted(checker.first_tokens(grammar))
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=1, n_batch=64))
    try:
        tokens = np.array(backend.tokenize("My favourite animal is the"), dtype=np.int32)
        n = len(tokens)
        row = backend.decode(tokens, np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32),
                             np.arange(n) == n - 1)[0].astype(np.float64)
        draws = []
        for seed in range(2000):
            sampler = backend.new_sampler(SamplingParams(temperature=1.0, seed=seed, grammar=grammar))
            draws.append(sampler.sample(n - 1))
            sampler.close()
    finally:
        backend.close()
    weights = np.exp(row[allowed] - row[allowed].max())
    expected = dict(zip(allowed, weights / weights.sum(), strict=True))
    counts = Counter(draws)
    assert set(counts) <= set(allowed)
    distance = sum(abs(counts[t] / len(draws) - p) for t, p in expected.items()) / 2
    assert distance < 0.05, (distance, counts.most_common(5))
    assert max(expected.values()) < 0.9  # several tokens matter, so a skewed draw would show


INTEGERS = [*range(-1100, 1101), 123455, 123456, 10**15, 10**16 - 1, -(10**15)]


@pytest.mark.parametrize("bounds", [
    {"minimum": 0}, {"minimum": 1, "maximum": 120}, {"minimum": -50, "maximum": -3}, {"maximum": 7},
    {"exclusiveMinimum": -1.5, "exclusiveMaximum": 1000}, {"minimum": 17, "maximum": 17},
    {"minimum": 95, "maximum": 1005}, {"minimum": 2.5}, {"maximum": -10}, {"minimum": 123456},
    {"minimum": -1, "maximum": 0},
], ids=str)
def test_integer_bounds_are_held_exactly(checker: GrammarCheck, bounds: dict) -> None:
    schema = {"type": "integer", **bounds}
    grammar = json_schema_grammar(schema)
    validator = jsonschema.Draft202012Validator(schema)
    wrong = [n for n in INTEGERS if checker.allows(grammar, str(n)) != validator.is_valid(n)]
    assert not wrong, wrong[:10]
    assert not any(checker.allows(grammar, text) for text in ("007", "-0", "00", "+5", "1.0"))
