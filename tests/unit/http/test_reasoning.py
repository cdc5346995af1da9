"""A reply's reasoning apart from its content on /v1/chat/completions and /v1/responses, through the official
`openai` SDK over the scripted fake backend of test_chat_tools: vLLM's reasoning_content, whole and streamed;
the parsers the template calls for or the flags name; chat_template_kwargs reaching the template."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import openai
import pytest
from openai import OpenAI

from cobali.config.serve_flags import add_serve_args
from cobali.faces import cli
from tests.unit.http.test_chat_tools import CALL, END_OF_PROMPT, TEMPLATE, WEATHER, ask, scripted_client

# The reply thinks first; with enable_thinking false the template writes an empty think block itself (Qwen3's way).
THINKING = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
            "{% if enable_thinking is false %}<think></think>{% endif %}" + END_OF_PROMPT + "{% endif %}")
# The prompt opens the think block (DeepSeek-R1's and Qwen3-2507's way): the reply starts inside it.
OPENED = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]<think>"
THOUGHT = "<think>Rome is in Italy.</think>It is sunny."
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def thinking() -> Iterator[OpenAI]:
    yield from scripted_client(THOUGHT, THINKING)


def streamed(client: OpenAI, **kwargs) -> tuple[str, str, list, str | None]:
    """(the reasoning, the content, the calls, the finish reason) of a streamed chat reply."""
    reasoning, content, calls, reason = "", "", [], None
    for chunk in ask(client, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        reason = chunk.choices[0].finish_reason or reason
    return reasoning, content, calls, reason


def test_the_reasoning_comes_apart_from_the_content(thinking: OpenAI) -> None:
    message = ask(thinking).choices[0].message
    assert (message.reasoning_content, message.content) == ("Rome is in Italy.", "It is sunny.")
    assert streamed(thinking) == ("Rome is in Italy.", "It is sunny.", [], "stop")


def test_a_reply_without_reasoning_has_null_reasoning_content() -> None:
    for client in scripted_client("It is sunny."):
        body = client.chat.completions.with_raw_response.create(
            model="fake-model", messages=[{"role": "user", "content": "Weather?"}]).http_response.json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny.",
                                             "reasoning_content": None}


def test_a_think_block_the_prompt_opened_is_read_from_the_rendered_prompt() -> None:
    for client in scripted_client("Rome is in Italy.</think>It is sunny.", OPENED, end_of_prompt="<think>"):
        message = ask(client).choices[0].message
        assert (message.reasoning_content, message.content) == ("Rome is in Italy.", "It is sunny.")
        assert streamed(client)[:2] == ("Rome is in Italy.", "It is sunny.")


def test_reasoning_then_a_tool_call() -> None:
    for client in scripted_client("<think>I need the weather.</think>" + CALL, THINKING):
        choice = ask(client, tools=[WEATHER]).choices[0]
        reasoning, content, calls, reason = streamed(client, tools=[WEATHER])
    assert choice.finish_reason == reason == "tool_calls"
    assert choice.message.reasoning_content == reasoning == "I need the weather."
    assert choice.message.content is None and content == ""
    [call] = choice.message.tool_calls
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})] and call.function.name == "get_weather"


def test_chat_template_kwargs_reach_the_template(thinking: OpenAI) -> None:
    usual = ask(thinking).usage.prompt_tokens
    without = ask(thinking, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage.prompt_tokens
    assert without == usual + len("<think></think>")


def test_responses_give_reasoning_as_an_item_before_the_message(thinking: OpenAI) -> None:
    response = thinking.responses.create(model="fake-model", input="Weather?")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Rome is in Italy.")]
    assert response.output_text == "It is sunny."
    events = list(thinking.responses.create(model="fake-model", input="Weather?", stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Rome is in Italy."
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == "Rome is in Italy." and done.output_index == 0
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "It is sunny."
    with thinking.responses.stream(model="fake-model", input="Weather?") as stream:  # the SDK's own accumulator
        assert stream.get_final_response().output_text == "It is sunny."


def test_responses_read_reasoning_and_a_call() -> None:
    for client in scripted_client("<think>I need the weather.</think>" + CALL, THINKING):
        whole = client.responses.create(model="fake-model", input="Weather?", tools=[RESPONSES_TOOL])
        events = list(client.responses.create(model="fake-model", input="Weather?", tools=[RESPONSES_TOOL],
                                              stream=True))
    for output in (whole.output, events[-1].response.output):
        assert [item.type for item in output] == ["reasoning", "function_call"]
        assert json.loads(output[1].arguments) == {"city": "Paris"}
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]


def parsed_flags(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(flags))


def test_reasoning_parser_none_leaves_the_think_block_in_the_content() -> None:
    for client in scripted_client(THOUGHT, THINKING, reasoning_parser=parsed_flags(
            "--reasoning-parser", "none").reasoning_parser):
        message = ask(client).choices[0].message
    assert (message.reasoning_content, message.content) == (None, THOUGHT)


def test_named_parsers_override_what_the_template_calls_for() -> None:
    """The plain test template names no family: by default no reasoning is read and calls the Hermes or Llama-3
    way; named, DeepSeek-R1's reasoning (it always thinks, so no opening tag) and Mistral's calls are read."""
    script = 'Rome.</think>Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    flags = parsed_flags("--reasoning-parser", "deepseek_r1", "--tool-call-parser", "mistral")
    for client in scripted_client(script, TEMPLATE, reasoning_parser=flags.reasoning_parser,
                                  tool_call_parser=flags.tool_call_parser):
        choice = ask(client, tools=[WEATHER]).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == ("Rome.", "Sure.")
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    for client in scripted_client(script, TEMPLATE):
        assert ask(client, tools=[WEATHER]).choices[0].message.content == script


@pytest.mark.parametrize("flag", ["--reasoning-parser", "--tool-call-parser"])
def test_an_unknown_parser_is_a_cli_error_naming_it(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", flag, "nonesuch", "--port", "0"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert flag in error and "'nonesuch' is not one of" in error


def test_chat_template_kwargs_cannot_override_the_servers_variables(thinking: OpenAI) -> None:
    for name in ("messages", "add_generation_prompt", "tools"):
        with pytest.raises(openai.BadRequestError, match=f"chat_template_kwargs cannot set {name}"):
            ask(thinking, extra_body={"chat_template_kwargs": {name: []}})


def test_the_largest_chat_template_kwargs_the_body_limit_allows_cost_only_their_parse(thinking: OpenAI) -> None:
    """Worst case within --max-body-bytes (1 MiB): thousands of variables the template never reads, nested
    values among them. The reply is the usual one and the server stays healthy for the next request."""
    variables = {f"v{i}": ["x" * 64, {"deep": [[[i]]]}] for i in range(9000)}
    assert 800_000 < len(json.dumps(variables)) < 1_000_000
    usual = ask(thinking)
    loaded = ask(thinking, extra_body={"chat_template_kwargs": variables})
    assert loaded.usage.prompt_tokens == usual.usage.prompt_tokens
    assert loaded.choices[0].message.content == usual.choices[0].message.content
    assert ask(thinking).choices[0].message.content == usual.choices[0].message.content
