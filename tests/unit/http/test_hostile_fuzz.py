"""Property-based fuzzing of the request bodies with hypothesis, beyond what the spec allows (the spec-driven
schemathesis fuzz is test_openapi_fuzz.py): whatever the body, the answer is a 200 or a 4xx in the OpenAI
error shape, never a 500, and the server stays healthy. Slow (marked): .ci/run runs it after `make test`, with a
bounded, derandomized set of examples so every CI run tries the same bodies."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
# Known fields with plausible and implausible values, so bodies get past the first check often enough.
FIELDS = {
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 200), max_size=8) | json_value,
    "max_tokens": st.integers(-3, 10**20) | json_value,
    "temperature": st.floats(allow_nan=True) | json_value,
    "top_p": st.floats(-1, 2), "top_k": st.integers(-2, 2**40), "min_p": st.floats(-1, 2),
    "n": st.integers(-1, 40), "seed": st.integers(-1, 2**33), "stop": json_value,
    "stream": st.booleans() | json_value, "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-5, 5), "repetition_penalty": st.floats(-1, 200),
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])},
                                             optional={"json_schema": json_value}) | json_value,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | json_value},
                                               optional={"content": st.text(max_size=20) | json_value}),
                         max_size=3) | json_value,
    "model": st.sampled_from(["fake-model", "other"]) | json_value,
    "logit_bias": st.dictionaries(st.text(max_size=6), st.floats(-200, 200)) | json_value,
    "echo": st.booleans(), "logprobs": st.integers(-1, 30) | st.booleans() | json_value,
    "input": st.text(max_size=40) | st.lists(st.text(max_size=10), max_size=4) | st.lists(st.integers(-5, 200),
                                                                                           max_size=8) | json_value,
    "encoding_format": st.sampled_from(["float", "base64"]) | json_value,
    "instructions": st.text(max_size=20) | json_value, "max_output_tokens": st.integers(-3, 10**9) | json_value,
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.text(max_size=8)}, optional={"parameters": json_value})}), max_size=2) | json_value,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_value,
    "chat_template_kwargs": st.dictionaries(st.text(max_size=8), json_value, max_size=3) | json_value,
    # Anthropic's Messages API
    "system": st.text(max_size=20) | json_value, "stop_sequences": json_value, "thinking": json_value,
}
bodies = st.fixed_dictionaries({}, optional=FIELDS) | json_value


@pytest.fixture(scope="module")
def fuzz_api() -> Iterator[TestClient]:
    with TestClient(fake_app(fake_engine(), "fake-model")) as client:
        wait_healthy(client)
        yield client


@pytest.mark.slow
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                                   "/v1/messages", "/v1/messages/count_tokens"])
@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_fuzzed_bodies_never_break_the_server(fuzz_api: TestClient, route: str, body: object) -> None:
    # json.dumps writes NaN / Infinity literals, which Python's parser (and so the server) accepts.
    response = fuzz_api.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code in (200, 400, 404), response.text[:300]
    if response.status_code != 200:
        payload = response.json()
        error = payload["error"]
        assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
        if route.startswith("/v1/messages"):  # Anthropic's error shape on its routes
            assert payload["type"] == "error"
        else:
            assert error["type"] == "invalid_request_error"
    assert fuzz_api.get("/health").status_code == 200
