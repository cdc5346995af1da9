"""/v1/responses through the official `openai` SDK (its typed objects and stream events), over the scripted
fake backend of test_chat_tools."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from openai import OpenAI

from cobali.http.protocol.responses import ResponsesRequest
from tests.unit.http.test_chat_tools import CALL, scripted_client

TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def chatting() -> Iterator[OpenAI]:
    yield from scripted_client("It is sunny.")


@pytest.fixture(scope="module")
def calling() -> Iterator[OpenAI]:
    yield from scripted_client(CALL)


def test_text_input_with_instructions(chatting: OpenAI) -> None:
    response = chatting.responses.create(model="fake-model", input="Weather?", instructions="Be brief.")
    assert response.object == "response" and response.status == "completed"
    assert response.output_text == "It is sunny."
    assert response.usage.input_tokens == len("[system]Be brief.[user]Weather?~")
    assert response.usage.output_tokens == len("It is sunny.") + 1  # and the end-of-generation token
    again = chatting.responses.create(model="fake-model", input="Weather?", instructions="Be brief.")
    assert again.usage.input_tokens_details.cached_tokens == again.usage.input_tokens - 1, "the same prompt's KV"


def test_max_output_tokens_makes_it_incomplete(chatting: OpenAI) -> None:
    response = chatting.responses.create(model="fake-model", input="Weather?", max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "It is"


def test_streamed_typed_events(chatting: OpenAI) -> None:
    events = list(chatting.responses.create(model="fake-model", input="Weather?", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is sunny."
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == "It is sunny."
    # The SDK's own stream helper accepts the sequence too.
    with chatting.responses.stream(model="fake-model", input="Weather?") as stream:
        assert stream.get_final_response().output_text == "It is sunny."


def test_a_function_call_and_its_output_round_trip(calling: OpenAI, chatting: OpenAI) -> None:
    response = calling.responses.create(model="fake-model", input="Weather?", tools=[TOOL])
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    streamed = list(calling.responses.create(model="fake-model", input="Weather?", tools=[TOOL], stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [{"city": "Paris"}]
    follow_up = chatting.responses.create(model="fake-model", tools=[TOOL], input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow_up.output_text == "It is sunny."
    rendered = '[user]Weather?[assistant]<call get_weather {"city": "Paris"}>[tool]sunnytools=get_weather~'
    assert follow_up.usage.input_tokens == len(rendered)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"previous_response_id": "resp_123"}, "stores no responses"),
    ({"input": []}, "must not be empty"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "not among the tools"),
    ({"max_output_tokens": 10**6}, "context length"),
])
def test_bad_responses_requests_are_400(chatting: OpenAI, kwargs: dict, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chatting.responses.create(model="fake-model", **{"input": "Weather?", **kwargs})
    assert fragment in caught.value.message


def test_parallel_calls_become_one_assistant_turn() -> None:
    call = {"type": "function_call", "name": "get_weather", "arguments": "{}"}
    request = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Two cities?"}]},
        {**call, "call_id": "a"}, {**call, "call_id": "b"},
        {"type": "function_call_output", "call_id": "a", "output": "sunny"},
        {"type": "function_call_output", "call_id": "b", "output": "rainy"}], "tools": [TOOL]})
    messages = request.as_chat().messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assert [c.id for c in messages[1].tool_calls] == ["a", "b"] and messages[0].content == "Two cities?"
