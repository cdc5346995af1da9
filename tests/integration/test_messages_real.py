"""Anthropic's Messages API on `cobali serve` with the embedded model, through the official `anthropic` SDK: a
plain message, a streamed one, a forced tool call valid for its schema and a tool_result turn, a few tokens each."""

from __future__ import annotations

from collections.abc import Iterator

import jsonschema
import pytest
from anthropic import Anthropic

from tests.integration.test_openai_api_real import TOOLS_TEMPLATE
from tests.integration.test_server_openai import running_server

KEY = "sekret"
GREEDY = {"temperature": 0}  # sent as a body field: this SDK's methods no longer take it
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                              "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city", "days"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[Anthropic]:
    with running_server("--max-slots", "2", "--served-model-name", "smol", "--api-key", KEY,
                        "--chat-template", str(TOOLS_TEMPLATE)) as (base, _proc):
        # The key as `x-api-key`, as Claude Code and Anthropic's earlier SDKs send it (this one sends a Bearer).
        yield Anthropic(base_url=base, api_key=None, default_headers={"x-api-key": KEY}, max_retries=0, timeout=120)


def test_a_plain_message_counts_its_prompt_as_count_tokens_does(client: Anthropic) -> None:
    reply = client.messages.create(model="smol", max_tokens=8, system="Be brief.", messages=ASK, extra_body=GREEDY)
    [block] = reply.content
    assert block.type == "text" and block.text
    assert reply.stop_reason in ("end_turn", "max_tokens") and 0 < reply.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model="smol", system="Be brief.", messages=ASK)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens


def test_a_streamed_message(client: Anthropic) -> None:
    with client.messages.stream(model="smol", max_tokens=8, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and [(b.type, b.text) for b in final.content] == [("text", text)]
    assert final.stop_reason in ("end_turn", "max_tokens") and 0 < final.usage.output_tokens <= 8


def test_a_forced_tool_call_is_valid_for_its_schema_and_its_result_goes_back(client: Anthropic) -> None:
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    reply = client.messages.create(model="smol", max_tokens=60, messages=ASK, tools=[WEATHER], tool_choice=forced,
                                   extra_body=GREEDY)
    assert reply.stop_reason == "tool_use", reply
    [call] = [b for b in reply.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    turn = [*ASK, {"role": "assistant", "content": reply.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}]}]
    answer = client.messages.create(model="smol", max_tokens=8, messages=turn, tools=[WEATHER], extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.usage.output_tokens > 0
