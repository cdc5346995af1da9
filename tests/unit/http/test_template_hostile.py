"""Hostile chat template inputs over HTTP (issue 44), on the fake backend with the bundled Llama 3 template: a
template variable, tools or a call's arguments that the template would write out far past the context stop its
render at the context's bound (a 400, as a prompt too long for the context), values nested past the server's
depth are a 400 naming its flag, and no depth is a 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cobali.backends.fake import FakeBackend
from cobali.frontend.inputs import InputProcessor
from cobali.frontend.request_limits import RequestLimits
from tests.unit.frontend.test_template_bounds import CountingTemplate, counted, nested
from tests.unit.http.test_server_api import N_CTX_SEQ, fake_app, fake_engine, wait_healthy

LLAMA3 = (Path(__file__).resolve().parents[3] / "cobali" / "templates" / "llama3.jinja").read_text()
USER = [{"role": "user", "content": "hi"}]
SMALL = RequestLimits(max_template_depth=4, max_template_kwargs_bytes=100)


def served(limits: RequestLimits | None) -> Iterator[TestClient]:
    """The usual fake server; with limits, one whose context holds the template's tool instructions (the fake
    tokenizes a character a token)."""
    engine = fake_engine() if limits is None else fake_engine(FakeBackend(n_seq_max=4, n_ctx_seq=2048, n_batch=64))
    app = fake_app(engine, "m", chat_template=LLAMA3, **({"limits": limits} if limits else {}))
    with TestClient(app) as client:
        wait_healthy(client)
        yield client


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    yield from served(None)


@pytest.fixture(scope="module")
def small() -> Iterator[TestClient]:
    yield from served(SMALL)


def inputs(client: TestClient) -> InputProcessor:
    return client.app.state.server.inputs()  # type: ignore[attr-defined]


@pytest.fixture
def stream(http: TestClient) -> Iterator[CountingTemplate]:
    """The served template, counting what each render draws from it."""
    template = inputs(http).prompter.jinja
    assert template is not None
    original = template.template
    yield counted(template)
    template.template = original


def chat(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, **body})


def call(arguments: str) -> list[dict]:
    return [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]


def refused_as_too_long(client: TestClient, response: Any) -> None:
    """The context's refusal, said as soon as the prompt passed what it holds (the render stopped there)."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and f"prompt has over {N_CTX_SEQ} tokens (over " in error["message"], error
    assert f"(over {inputs(client).max_prompt_chars} characters)" in error["message"]


def test_custom_tools_that_would_write_megabytes_stop_at_the_context(http: TestClient,
                                                                     stream: CountingTemplate) -> None:
    """The issue's case: 39 KB of chat_template_kwargs.custom_tools, each value indented by Llama's tojson."""
    tools = [nested(60)] * 320
    body = {"messages": USER, "max_tokens": 1, "chat_template_kwargs": {"custom_tools": tools}}
    assert 38_000 < len(json.dumps(body)) < 40_000
    whole = len(json.dumps(nested(60), indent=4)) * len(tools)
    bound = inputs(http).max_prompt_chars
    assert whole > 50 * bound
    refused_as_too_long(http, http.post("/v1/chat/completions", json=body))
    assert bound < stream.chars <= bound + len(json.dumps(nested(60), indent=4))
    assert chat(http).status_code == 200  # the next request is served as usual


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_tools_that_would_write_megabytes_stop_at_the_context_too(http: TestClient, stream: CountingTemplate,
                                                                   route: str) -> None:
    """Plain tools, within --max-tools and --max-tools-bytes; /tokenize refuses them as generation does."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"a": nested(60)}}}
             for i in range(100)]
    refused_as_too_long(http, http.post(route, json={"messages": USER, "tools": tools}))
    assert stream.chars <= 2 * inputs(http).max_prompt_chars


@pytest.mark.parametrize(("name", "at", "past", "param"), [
    ("tool parameters",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": nested(3)}}}]},
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": nested(4)}}}]}, "tools"),
    ("template variable", {"chat_template_kwargs": {"custom_tools": [nested(3)]}},
     {"chat_template_kwargs": {"custom_tools": [nested(4)]}}, "chat_template_kwargs"),
    ("call arguments", {"messages": call(json.dumps({"a": nested(3)}))},
     {"messages": call(json.dumps({"a": nested(4)}))}, "messages"),
])
def test_values_nested_past_the_depth_limit_are_a_400_naming_it(small: TestClient, name: str, at: dict,
                                                                 past: dict, param: str) -> None:
    assert chat(small, **at).status_code == 200, name
    response = chat(small, **past)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "--max-chat-template-depth" in error["message"] and error["param"] == param, error


def test_the_template_variables_it_reads_are_bounded_in_bytes_the_others_dropped(small: TestClient) -> None:
    """{"custom_tools":[""]} is 21 bytes of compact JSON: 79 more are at --max-chat-template-kwargs-bytes."""
    assert chat(small, chat_template_kwargs={"custom_tools": ["a" * 79]}).status_code == 200
    response = chat(small, chat_template_kwargs={"custom_tools": ["a" * 80]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "--max-chat-template-kwargs-bytes" in error["message"] and error["param"] == "chat_template_kwargs"
    unread = {"unread": "a" * 10_000, "deep": nested(100)}  # the template never reads them
    assert chat(small, chat_template_kwargs=unread).status_code == 200


@pytest.mark.parametrize("depth", [100, 500])
def test_deep_tools_are_a_400_not_a_500(http: TestClient, depth: int) -> None:
    """Past 255 levels pydantic cannot write a tool's JSON to measure it."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": nested(depth)}}}]
    for route in ("/v1/chat/completions", "/tokenize"):
        response = http.post(route, json={"messages": USER, "tools": tools})
        assert response.status_code == 400 and "--max-chat-template-depth" in response.text, response.text


def test_arguments_nested_past_what_json_reads_are_kept_as_text(http: TestClient) -> None:
    """Deeper than Python's json reads (~1000 levels): the template gets the text sent, as for any arguments
    that do not parse."""
    arguments = "[" * 5000 + "]" * 5000
    response = http.post("/tokenize", json={"messages": call(arguments)})
    assert response.status_code == 200, response.text
    text = http.post("/detokenize", json={"tokens": response.json()["tokens"]}).json()["prompt"]
    assert arguments in text
    deeper = "[" * 200_000 + "]" * 200_000  # the issue's: its text alone is more than the context holds
    for route in ("/v1/chat/completions", "/tokenize"):
        refused_as_too_long(http, http.post(route, json={"messages": call(deeper), "max_tokens": 1}))
