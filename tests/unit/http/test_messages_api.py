"""/v1/messages and /v1/messages/count_tokens through the official `anthropic` SDK (its typed objects, its stream
helper, its errors), over a fake backend that replies with a script (one character a token)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import jsonschema
import pytest
from anthropic import Anthropic
from fastapi.testclient import TestClient

from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from tests.unit.http.test_chat_tools import CALL, END_OF_PROMPT, ScriptedBackend
from tests.unit.http.test_server_api import fake_app, wait_healthy
from tests.unit.http.test_server_live import busy_slots, live_server, metric, wait_for

# Hermes-style calls in the history (so replies are read as Hermes calls) and reasoning in <think> tags (so they
# are read by the qwen3 reasoning parser); `enable_thinking` (from Anthropic's `thinking`) shows in the prompt.
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]"
            "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
            "</tool_call>{% endfor %}{% endfor %}"
            "{% if tools %}tools={{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
            "{% if add_generation_prompt %}" + END_OF_PROMPT + "{% endif %}")
MODEL = "fake-model"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "Weather?"}]
NEWLINE = 96  # the token the fake's vocabulary has no room for: a forced call's grammar writes newlines


@dataclass
class NewlineBackend(ScriptedBackend):
    """The scripted fake, with one more token: a newline."""

    n_vocab: int = NEWLINE + 1

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [NEWLINE if c == "\n" else t for c, t in zip(text, super().tokenize(text, add_special), strict=True)]

    def token_bytes(self, token: int) -> bytes:
        return b"\n" if token == NEWLINE else super().token_bytes(token)


def served(script: str, template: str = TEMPLATE, end_of_prompt: str = END_OF_PROMPT,
           **server: object) -> Iterator[TestClient]:
    def engine() -> Engine:
        return Engine(NewlineBackend(n_seq_max=2, n_ctx_seq=512, n_batch=512, script=script,
                                     end_of_prompt=end_of_prompt), EngineConfig(max_slots=2, n_batch=512))

    with TestClient(fake_app(engine, MODEL, chat_template=template, **server)) as http:
        wait_healthy(http)
        yield http


def sdk(http: TestClient, **options: object) -> Anthropic:
    return Anthropic(base_url="http://testserver", http_client=http, max_retries=0,
                     **({"api_key": "unused"} | options))


def sdk_sending_x_api_key(http: TestClient, key: str) -> Anthropic:
    """Anthropic's SDKs (before this one) and Claude Code send the key as `x-api-key`; this SDK sends a Bearer."""
    return sdk(http, api_key=None, default_headers={"x-api-key": key})


@pytest.fixture(scope="module")
def chatting() -> Iterator[Anthropic]:
    for http in served("It is sunny."):
        yield sdk(http)


@pytest.fixture(scope="module")
def calling() -> Iterator[Anthropic]:
    for http in served(CALL):
        yield sdk(http)


@pytest.fixture(scope="module")
def thinking() -> Iterator[Anthropic]:
    """A template whose generation prompt opens the think block, as DeepSeek-R1's and Qwen3-2507's do."""
    opened = END_OF_PROMPT + "<think>"
    for http in served("Paris is in France.</think>It is sunny.", TEMPLATE.replace(END_OF_PROMPT, opened), opened):
        yield sdk(http)


def prompt_tokens(usage: anthropic.types.Usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_a_plain_message(chatting: Anthropic) -> None:
    reply = chatting.messages.create(model=MODEL, max_tokens=64, system="Be brief.", messages=ASK,
                                     extra_body={"temperature": 0, "top_k": 1})  # the SDK no longer has them
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert [(b.type, b.text) for b in reply.content] == [("text", "It is sunny.")]
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    assert prompt_tokens(reply.usage) == len("[system]Be brief.[user]Weather?~")
    assert reply.usage.output_tokens == len("It is sunny.") + 1  # and the end-of-generation token
    again = chatting.messages.create(model=MODEL, max_tokens=64, system="Be brief.", messages=ASK)
    assert again.usage.cache_read_input_tokens == prompt_tokens(again.usage) - 1, "the same prompt's KV, apart"


def test_stop_sequences_and_max_tokens(chatting: Anthropic) -> None:
    stopped = chatting.messages.create(model=MODEL, max_tokens=64, messages=ASK, stop_sequences=["sun"])
    assert stopped.content[0].text == "It is " and (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence",
                                                                                                      "sun")
    cut = chatting.messages.create(model=MODEL, max_tokens=5, messages=ASK)
    assert cut.content[0].text == "It is" and cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 5


def test_a_streamed_message(chatting: Anthropic) -> None:
    with chatting.messages.stream(model=MODEL, max_tokens=64, messages=ASK) as stream:
        assert "".join(stream.text_stream) == "It is sunny."
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", "It is sunny.")]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len("It is sunny.") + 1
    assert prompt_tokens(final.usage) == len("[user]Weather?~")
    kinds = [event.type for event in chatting.messages.create(model=MODEL, max_tokens=64, messages=ASK, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"] and set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_follows_its_schema(calling: Anthropic, stream: bool) -> None:
    request = {"model": MODEL, "max_tokens": 128, "messages": ASK, "tools": [WEATHER],
               "tool_choice": {"type": "tool", "name": "get_weather"}}
    if stream:
        with calling.messages.stream(**request) as events:
            reply = events.get_final_message()
    else:
        reply = calling.messages.create(**request)
    [call] = reply.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert call.input == {"city": "Paris"} and reply.stop_reason == "tool_use"


def test_a_tool_result_turn(chatting: Anthropic) -> None:
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    reply = chatting.messages.create(model=MODEL, max_tokens=64, messages=history, tools=[WEATHER])
    assert reply.content[0].text == "It is sunny." and reply.stop_reason == "end_turn"
    rendered = ('[user]Weather?[assistant]Let me check.<tool_call>get_weather {"city": "Paris"}</tool_call>'
                "[tool]sunny[user]And tomorrow?tools=get_weather~")
    assert prompt_tokens(reply.usage) == len(rendered)
    failed = [*history[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "no"}],
         "is_error": True}]}]
    counted = chatting.messages.count_tokens(model=MODEL, messages=failed, tools=[WEATHER])
    assert counted.input_tokens == len(rendered.replace("sunny[user]And tomorrow?", "Error: no"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_thinking_blocks_come_from_the_reasoning_parser(thinking: Anthropic, stream: bool) -> None:
    request = {"model": MODEL, "max_tokens": 64, "messages": ASK}
    if stream:
        with thinking.messages.stream(**request) as events:
            assert "".join(events.text_stream) == "It is sunny."
            reply = events.get_final_message()
    else:
        reply = thinking.messages.create(**request)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == "Paris is in France." and reply.content[1].text == "It is sunny."


def test_count_tokens_is_the_prompt_messages_renders(chatting: Anthropic) -> None:
    history = [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": ""},
                                                       {"type": "text", "text": "Sunny."}]},
               {"role": "user", "content": "Sure?"}]
    counted = chatting.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be brief."}],
                                             messages=history, tools=[WEATHER])
    rendered = "[system]Be brief.[user]Weather?[assistant]<think>Hm.</think>Sunny.[user]Sure?tools=get_weather~"
    assert counted.input_tokens == len(rendered)
    reply = chatting.messages.create(model=MODEL, max_tokens=64, system="Be brief.", messages=history,
                                     tools=[WEATHER])
    assert prompt_tokens(reply.usage) == counted.input_tokens
    off = chatting.messages.count_tokens(model=MODEL, messages=ASK, thinking={"type": "disabled"})
    assert off.input_tokens == len("[user]Weather?/no_think~"), "thinking reaches the template"
    unforced = chatting.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice={"type": "none"})
    assert unforced.input_tokens == len("[user]Weather?~")


@pytest.mark.parametrize(("request_fields", "fragment"), [
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"max_tokens": 4096}, "context length"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "http://x/y.png"}}]}]}, "images and documents are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]},
     "a user turn cannot hold a thinking block"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools (get_weather)"),
    ({"tool_choice": {"type": "any"}}, "tool_choice 'any' needs tools"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "bogus-type"}}]}, "invalid JSON schema"),
    ({"messages": []}, "messages"),
])
def test_bad_requests_are_400_in_anthropics_shape(chatting: Anthropic, request_fields: dict,
                                                  fragment: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        chatting.messages.create(**{"model": MODEL, "max_tokens": 16, "messages": ASK, **request_fields})
    assert caught.value.body["type"] == "error" and caught.value.type == "invalid_request_error"
    assert fragment in caught.value.message


def test_errors_keep_their_status_in_anthropics_shape(chatting: Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        chatting.messages.create(model="claude-nope", max_tokens=16, messages=ASK)
    assert caught.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": f"the model 'claude-nope' does not exist; this server serves '{MODEL}'"}}
    with pytest.raises(anthropic.NotFoundError):
        chatting.messages.count_tokens(model="claude-nope", messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="Field required"):  # the body's own validation
        chatting.post("/v1/messages/count_tokens", body={"model": MODEL}, cast_to=object)


def test_a_body_too_large_is_413_in_anthropics_shape() -> None:
    for http in served("x", max_body_bytes=1024):
        response = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": "x" * 2048}]})
        assert response.status_code == 413
        assert response.json()["error"]["type"] == "request_too_large" and "--max-body-bytes" in response.text
        elsewhere = http.post("/v1/completions", content=b"x" * 2048).json()["error"]
        assert elsewhere["code"] == "request_too_large", "OpenAI's shape on OpenAI's routes"


def test_a_loading_server_is_503_in_anthropics_shape() -> None:
    loaded = threading.Event()

    def slow_load() -> Engine:
        loaded.wait(10)
        return Engine(NewlineBackend(n_seq_max=2, n_ctx_seq=512, n_batch=512), EngineConfig(max_slots=2))

    with TestClient(fake_app(slow_load, MODEL)) as http:
        with pytest.raises(anthropic.InternalServerError) as caught:
            sdk(http).messages.create(model=MODEL, max_tokens=16, messages=ASK)
        assert caught.value.status_code == 503 and caught.value.body["error"]["type"] == "overloaded_error"
        loaded.set()
        wait_healthy(http)


def test_the_key_is_taken_as_x_api_key_or_bearer_on_every_route() -> None:
    for http in served("It is sunny.", api_keys=("sekret",)):
        for client in (sdk_sending_x_api_key(http, "sekret"), sdk(http, api_key="sekret")):
            assert client.messages.create(model=MODEL, max_tokens=16, messages=ASK).content[0].text == "It is sunny."
        with pytest.raises(anthropic.AuthenticationError) as caught:
            sdk_sending_x_api_key(http, "wrong").messages.create(model=MODEL, max_tokens=16, messages=ASK)
        assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"
        completion = {"prompt": END_OF_PROMPT, "max_tokens": 1}  # the script starts after it
        assert http.post("/v1/completions", json=completion, headers={"x-api-key": "sekret"}).status_code == 200
        wrong = http.post("/v1/completions", json=completion, headers={"x-api-key": "wrong"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape
        assert http.get("/v1/models", headers={"x-api-key": "sekret"}).status_code == 200


def test_unknown_fields_are_named_in_a_header(chatting: Anthropic) -> None:
    raw = chatting.messages.with_raw_response.create(model=MODEL, max_tokens=16, messages=ASK,
                                                     extra_body={"frobnicate": 1})
    assert raw.headers["x-cobali-ignored-fields"] == "frobnicate"
    assert raw.parse().content[0].text == "It is sunny."


# Held by its output format to a string longer than the fake's replies, which end early otherwise.
LONG = {"model": "slow", "max_tokens": 2000, "messages": ASK, "stream": True,
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "string", "minLength": 1990}}}}


def test_a_client_gone_frees_the_slot_and_a_full_queue_is_429() -> None:
    with live_server(max_slots=1, max_queue=0) as (client, _):
        with client.stream("POST", "/v1/messages", json=LONG) as hog:
            events = hog.iter_lines()  # kept: dropping it closes the connection
            assert next(events) == "event: message_start"
            assert next(line for line in events if line == "event: content_block_delta")  # a token: it has a slot
            assert busy_slots(client) == 1
            full = client.post("/v1/messages", json={**LONG, "stream": False})
            assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
        wait_for(lambda: busy_slots(client) == 0, timeout_s=5)
        wait_for(lambda: metric(client, 'cobali:request_success_total{finished_reason="abort"}') == 1)
