"""The grammars built from regular expressions, JSON schemas, choices, GBNF and tool calls on the embedded model:
which texts they let its vocabulary write (llguidance over the model's own tokens, several bytes a token: no model
numerics, so the same on every machine), and what the model writes under them when it samples. The same cases as
tests/unit/structured/test_structured_constraints.py, which runs them on a vocabulary of one token a byte."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import FinishReason
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.frontend.parsers.tools.tagged import Hermes
from cobali.structured.grammars import (
    choice_grammar,
    gbnf_grammar,
    json_schema_grammar,
    regex_grammar,
)
from tests.structured_oracle import Oracle, real_oracle
from tests.unit.structured.test_structured_constraints import (
    ALPHABET,
    CASES,
    CHOICES,
    EXAMPLES,
    FORMAT_CHECKER,
    PATTERNS,
    TEXTS,
    WEATHER,
    call,
    valid,
)


@pytest.fixture(scope="module")
def oracle(model_path: str) -> Oracle:
    return real_oracle(model_path)


def assert_holds(oracle: Oracle, grammar: str, allowed: list[str], refused: list[str]) -> None:
    oracle.compiler.check(grammar)
    assert [t for t in allowed if not oracle.allows(grammar, t)] == [], "allowed texts refused"
    assert [t for t in refused if oracle.allows(grammar, t)] == [], "refused texts allowed"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_regex_grammar_allows_exactly_the_full_matches(oracle: Oracle, pattern: str) -> None:
    grammar = regex_grammar(pattern)
    oracle.compiler.check(grammar)

    @EXAMPLES
    @given(st.from_regex(pattern, fullmatch=True, alphabet=ALPHABET))
    def matches_are_allowed(text: str) -> None:
        assert oracle.allows(grammar, text)

    @EXAMPLES
    @given(TEXTS)
    def others_are_not(text: str) -> None:
        assert oracle.allows(grammar, text) == bool(re.fullmatch(pattern, text))

    matches_are_allowed()
    others_are_not()


@pytest.mark.parametrize("schema, allowed, refused", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_a_schema_grammar_holds_the_schema(oracle: Oracle, schema: dict, allowed: list[str],
                                           refused: list[str]) -> None:
    assert_holds(oracle, json_schema_grammar(schema), allowed, refused)


INTEGERS = [*range(-130, 131), *range(990, 1011), -1005, 123455, 123456, 10**15, 10**16 - 1, -(10**15)]


@pytest.mark.parametrize("bounds", [
    {"minimum": 0}, {"minimum": 1, "maximum": 120}, {"minimum": -50, "maximum": -3}, {"maximum": 7},
    {"exclusiveMinimum": -1.5, "exclusiveMaximum": 1000}, {"minimum": 95, "maximum": 1005}, {"minimum": 123456},
], ids=str)
def test_integer_bounds_are_held_exactly_over_multi_digit_tokens(oracle: Oracle, bounds: dict) -> None:
    """This vocabulary writes several digits a token ("123"): the bounds hold over any split of the number."""
    schema = {"type": "integer", **bounds}
    grammar = json_schema_grammar(schema)
    oracle.compiler.check(grammar)
    validator = jsonschema.Draft202012Validator(schema)
    wrong = [n for n in INTEGERS if oracle.allows(grammar, str(n)) != validator.is_valid(n)]
    assert not wrong, wrong[:10]


def test_choices_gbnf_and_tool_calls_hold_on_this_vocabulary(oracle: Oracle) -> None:
    assert_holds(oracle, choice_grammar(CHOICES, "choice"), CHOICES, ["", "no", "yesyes", "yes\nno"])
    assert_holds(oracle, gbnf_grammar('root ::= "a" [0-9]+ ( "," [0-9]{1,2} )*', "grammar"), ["a1", "a12,3,45"],
                 ["a", "a1,", "a1,123"])
    weather = call("get_weather", '{"city": "Oslo"}')
    assert_holds(oracle, Hermes().forced_call_grammar([("get_weather", WEATHER), ("noop", None)], parallel=False),
                 [weather, call("noop", "{}")],
                 [call("other", "{}"), call("get_weather", "{}"), f"{weather}\n{weather}"])


def test_an_end_token_ends_a_complete_output_only(oracle: Oracle) -> None:
    """Every end-of-generation token of the model (<|endoftext|>, <|im_end|>, ...) is allowed once the grammar is
    complete, and none before."""
    grammar = choice_grammar(["yes", "no"], "choice")
    eos = set(oracle.compiler.tokenizer.eos_tokens)
    assert len(eos) > 1
    matcher = oracle.compiler.matcher(grammar)
    assert not eos & set(oracle.allowed_tokens(matcher).tolist())
    assert matcher.consume_tokens(oracle.tokens_of("yes"))
    assert set(oracle.allowed_tokens(matcher).tolist()) == eos


# Bounded (short strings, few items), so that a sampling model reaches the end within a few dozen tokens.
PET = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                                        "kind": {"enum": ["cat", "dog"]}}, "required": ["name", "kind"]}
PERSON = {"$defs": {"Pet": PET}, "type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8}, "age": {"type": "integer"},
                         "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}, "maxItems": 1}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
DATES = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                          "t": {"type": "string", "pattern": "^[01][0-9]:[0-5][0-9]$"}},
         "required": ["d", "t"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PETS = r"(cat|dog|bird)s?( and (cat|dog|bird)s?)?"
FILM_GBNF = ('root ::= "{\\"title\\": \\"" [A-Za-z ]{1,20} "\\", \\"year\\": " [12] [0-9]{3} "}"')
ANSWERS = ["positive", "negative", "neutral"]


def film(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"title", "year"} and 1000 <= value["year"] <= 2999


SAMPLED = [  # (prompt, grammar, whether a text holds it)
    ("Give a person as JSON.", json_schema_grammar(PERSON), lambda text: valid(PERSON, json.loads(text))),
    ("A date as JSON.", json_schema_grammar(DATES),
     lambda text: jsonschema.Draft202012Validator(DATES, format_checker=FORMAT_CHECKER).is_valid(json.loads(text))),
    ("Phone number:", regex_grammar(PHONE), lambda text: re.fullmatch(PHONE, text) is not None),
    ("Name a pet:", regex_grammar(PETS), lambda text: re.fullmatch(PETS, text) is not None),
    ("Is this review positive? 'Great film!'", choice_grammar(ANSWERS, "choice"), lambda text: text in ANSWERS),
    ("A film as JSON.", gbnf_grammar(FILM_GBNF, "grammar"), film),
    ("What's the weather in Oslo?", Hermes().forced_call_grammar([("get_weather", WEATHER)], parallel=False),
     lambda text: re.fullmatch(r'<tool_call>\n\{"name": "get_weather", "arguments": (.*)\}\n</tool_call>', text,
                               re.S) is not None
     and valid(WEATHER, json.loads(text.split('"arguments": ', 1)[1].rsplit("}", 1)[0]))),
]


SAMPLINGS = [{"temperature": 1.0, "seed": 1}, {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 2}]


def test_the_model_samples_only_what_the_grammar_holds(model_path: str) -> None:
    """Each constraint twice, at temperature 1 and truncated, all in one batch (one decode a tick for all)."""
    jobs = [(prompt, grammar, holds, sampling) for prompt, grammar, holds in SAMPLED for sampling in SAMPLINGS]
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=len(jobs), n_batch=256))
    try:
        engine = Engine(backend, EngineConfig(mode="cont", max_slots=len(jobs), n_batch=256))
        results = [engine.add_request(prompt, SamplingParams(max_tokens=120, grammar=grammar, **sampling))
                   for prompt, grammar, _, sampling in jobs]
        list(LLM(engine).run())
        assert not engine._executor.sampler.guide._matchers
    finally:
        backend.close()
    for (prompt, _, holds, _), result in zip(jobs, results, strict=True):
        assert result.finish_reason is FinishReason.STOP, (prompt, result.text, result.error)
        assert holds(result.text), (prompt, result.text)
    assert len({r.text for r in results}) > len(SAMPLED)  # drawn, not forced: the two samplings' outputs differ


def test_what_the_grammar_allows_is_what_the_model_can_end_on(oracle: Oracle) -> None:
    """Random walks through the masks on this vocabulary end on texts that hold the schema."""
    grammar = json_schema_grammar(PERSON)
    rng = np.random.default_rng(0)
    written = [text for _ in range(4) if (text := oracle.walk(grammar, rng, max_steps=300)) is not None]
    assert written
    for text in written:
        assert valid(PERSON, json.loads(text)), text
