"""vLLM's and llama-server's spellings of structured outputs become one llguidance grammar (which texts each
allows: tests/unit/structured/test_structured_constraints.py; what the model writes under them:
tests/integration/test_structured_grammars_real.py); conflicting or unsupported ones are a 400."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from cobali.backends.base import EmbeddingLimits, TemplateSource
from cobali.frontend.interface import ModelInfo
from cobali.http.protocol.completions import CompletionRequest
from cobali.structured.grammars import (
    JSON_OBJECT_GRAMMAR,
    choice_grammar,
    gbnf_grammar,
    json_schema_grammar,
    regex_grammar,
)
from tests.unit.http.test_server_api import N_CTX_SEQ, fake_app, fake_engine, wait_healthy

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
GBNF = 'root ::= "a"'
DEEP: dict = {"type": "integer"}
for _ in range(300):
    DEEP = {"type": "array", "items": DEEP}


MODEL = ModelInfo(n_vocab=96, max_model_len=256, context_hint="", description="fake", max_slots=1,
                  chat_template=TemplateSource(None), embeddings=EmbeddingLimits(256, 4, 96))


def grammar_of(**fields) -> str | None:
    body = CompletionRequest.model_validate({"prompt": "x", **fields})
    return body.sampling_params(1, MODEL, 0).grammar


@pytest.mark.parametrize("fields, expected", [
    ({"guided_choice": ["yes", "no"]}, choice_grammar(["yes", "no"], "guided_choice")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, choice_grammar(["yes", "no"], "choice")),
    ({"guided_json": SCHEMA}, json_schema_grammar(SCHEMA)),
    ({"guided_json": '{"type": "object", "properties": {"ok": {"type": "boolean"}}}'}, json_schema_grammar(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, json_schema_grammar(SCHEMA)),
    ({"structured_outputs": {"json": True}}, json_schema_grammar(True)),
    ({"structured_outputs": {"json_object": True}}, JSON_OBJECT_GRAMMAR),
    ({"json_schema": SCHEMA}, json_schema_grammar(SCHEMA)),
    ({"guided_grammar": GBNF}, gbnf_grammar(GBNF, "guided_grammar")),
    ({"structured_outputs": {"grammar": GBNF}}, gbnf_grammar(GBNF, "grammar")),
    ({"grammar": GBNF}, gbnf_grammar(GBNF, "grammar")),
    ({"guided_regex": "[0-9]+"}, regex_grammar("[0-9]+")),
    ({"structured_outputs": {"regex": "[0-9]+"}}, regex_grammar("[0-9]+")),
    ({"response_format": {"type": "json_object"}}, JSON_OBJECT_GRAMMAR),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     json_schema_grammar(SCHEMA)),
    ({}, None),
])
def test_every_spelling_becomes_its_grammar(fields: dict, expected: str | None) -> None:
    assert grammar_of(**fields) == expected


@pytest.fixture(scope="module")
def api() -> Iterator[TestClient]:
    with TestClient(fake_app(fake_engine(), "m")) as client:
        wait_healthy(client)
        yield client


@pytest.mark.parametrize("fields, message", [
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice and response_format"),
    ({"grammar": GBNF, "guided_json": SCHEMA}, "grammar and guided_json"),
    ({"structured_outputs": {"choice": ["a"], "grammar": GBNF}}, "exactly one of"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "look-around"),
    ({"guided_regex": r"(a)\1"}, "backreferences are not supported"),
    ({"guided_regex": "a{3,2}"}, "invalid repetition"),
    ({"guided_choice": []}, "guided_choice must be 1 to 256 non-empty strings"),
    ({"guided_choice": ["a", ""]}, "guided_choice must be 1 to 256 non-empty strings"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be 1 to 256 non-empty strings"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
    ({"json_schema": {"type": "nope"}}, "invalid JSON schema"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),  # llguidance cannot hold it
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 4}}, "minimum"),
    ({"guided_json": {"$ref": "#"}}, "allows no output"),
    ({"json_schema": DEEP}, "nests deeper than 64 levels"),  # a 400, not a RecursionError's 500
    ({"guided_json": False}, "allows no output"),
    ({"grammar": "  "}, "grammar is empty"),
    ({"grammar": 'root ::= "a" ('}, "grammar is not a valid GBNF or Lark grammar"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar is not a valid GBNF"),
    ({"grammar": 'start: X\nX: /a/ & /b/'}, "allows no output"),  # checked before the request is queued
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos cannot be combined with a grammar"),
    ({"guided_regex": "a", "min_tokens": 1}, "min_tokens cannot be combined with a grammar"),
], ids=lambda value: str(value)[:60])
def test_conflicting_or_unsupported_constraints_are_a_400(api: TestClient, fields: dict, message: str) -> None:
    response = api.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_the_fields_are_read_not_reported_as_ignored(api: TestClient) -> None:
    response = api.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "guided_choice": ["a", "b"],
        "not_a_field": 1})
    assert response.status_code == 200, response.text
    assert response.headers["X-Cobali-Ignored-Fields"] == "not_a_field"


# vLLM's truncate_prompt_tokens lives beside the constraints above: both are vLLM extras of a generation body.

def completion(api: TestClient, **fields) -> dict:
    response = api.post("/v1/completions", json={"max_tokens": 4, "temperature": 0, "ignore_eos": True, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_truncate_prompt_tokens_keeps_the_last_tokens(api: TestClient) -> None:
    cut = completion(api, prompt="abcdefgh", truncate_prompt_tokens=3)
    assert cut["usage"]["prompt_tokens"] == 3  # the fake tokenizer: one token a character, no BOS
    assert cut["choices"][0]["text"] == completion(api, prompt="fgh")["choices"][0]["text"]
    echoed = completion(api, prompt="abcdefgh", truncate_prompt_tokens=3, echo=True)
    assert echoed["choices"][0]["text"].startswith("fgh") and not echoed["choices"][0]["text"].startswith("abc")
    assert completion(api, prompt=[5, 6, 7, 8], truncate_prompt_tokens=2)["usage"]["prompt_tokens"] == 2
    chat = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello there"}],
                                                  "max_tokens": 2, "truncate_prompt_tokens": 5})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 5


def test_truncate_prompt_tokens_minus_one_fits_the_context(api: TestClient) -> None:
    long = "x" * (N_CTX_SEQ + 50)
    assert api.post("/v1/completions", json={"prompt": long, "max_tokens": 1}).status_code == 400
    fitted = completion(api, prompt=long, truncate_prompt_tokens=-1, max_tokens=1)
    assert fitted["usage"]["prompt_tokens"] == N_CTX_SEQ - 1


@pytest.mark.parametrize("value", [0, -2, "3"])
def test_truncate_prompt_tokens_must_be_a_count(api: TestClient, value) -> None:
    response = api.post("/v1/completions", json={"prompt": "abc", "truncate_prompt_tokens": value})
    assert response.status_code == 400 and "truncate_prompt_tokens" in response.text
