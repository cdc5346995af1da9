"""/tokenize and /detokenize (vLLM's shapes) over the fake backend: the count is the one generation uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from tests.unit.http.test_server_api import N_CTX_SEQ, fake_app, fake_engine, wait_healthy

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with TestClient(fake_app(fake_engine(), "fake-model")) as client:
        wait_healthy(client)
        yield client


@pytest.fixture(scope="module")
def sdk(http: TestClient) -> OpenAI:
    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_a_prompts_count_is_what_a_completion_bills(http: TestClient, sdk: OpenAI) -> None:
    reply = http.post("/tokenize", json={"model": "fake-model", "prompt": "hello world"}).json()
    used = sdk.completions.create(model="fake-model", prompt="hello world", max_tokens=1)
    assert reply["count"] == len(reply["tokens"]) == used.usage.prompt_tokens
    assert reply["max_model_len"] == N_CTX_SEQ and reply["token_strs"] is None


def test_messages_count_is_what_a_chat_completion_bills(http: TestClient, sdk: OpenAI) -> None:
    reply = http.post("/tokenize", json={"messages": MESSAGES}).json()
    used = sdk.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=1)
    assert reply["count"] == used.usage.prompt_tokens
    assert http.post("/detokenize", json={"tokens": reply["tokens"]}).json()["prompt"].endswith("<assistant>")


def test_tokens_and_their_strings_round_trip(http: TestClient) -> None:
    reply = http.post("/tokenize", json={"prompt": "round trip", "return_token_strs": True}).json()
    assert "".join(reply["token_strs"]) == "round trip"
    assert http.post("/detokenize", json={"tokens": reply["tokens"]}).json() == {"prompt": "round trip"}


def test_a_prompt_the_context_cannot_hold_is_refused_before_it_is_tokenized(http: TestClient) -> None:
    """As generation refuses it (issue 44): longer than the context's tokens x the longest token's characters."""
    bound = http.app.state.server.inputs().max_prompt_chars  # type: ignore[attr-defined]
    assert http.post("/tokenize", json={"prompt": "a" * bound}).status_code == 200  # counted: it may fit
    response = http.post("/tokenize", json={"prompt": "a" * (bound + 1)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert f"prompt has over {N_CTX_SEQ} tokens ({bound + 1} characters)" in error["message"], error


@pytest.mark.parametrize(("path", "body", "fragment"), [
    ("/tokenize", {}, "either prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "either prompt or messages"),
    ("/tokenize", {"prompt": "a", "tools": []}, "tools go with messages"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, "token ids must be in"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_input_is_a_400_that_says_why(http: TestClient, path: str, body: dict, fragment: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert fragment in response.text


def test_an_unknown_model_is_a_404_and_unknown_fields_are_named(http: TestClient) -> None:
    assert http.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404
    response = http.post("/detokenize", json={"tokens": [1], "with_pieces": True})
    assert response.status_code == 200 and response.headers["X-Cobali-Ignored-Fields"] == "with_pieces"
