"""Jinja chat templates and tool calls on /v1/chat/completions, through the official `openai` SDK over a fake
backend that replies with a script (the fake tokenizes one character per token)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from cobali.backends.base import TemplateSource
from cobali.backends.fake import EOG_TOKEN, FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.frontend.chat_template import ChatPrompter, JinjaChatTemplate
from cobali.frontend.parsers.tools import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from cobali.http.protocol.chat import ChatCompletionRequest
from tests.unit.http.test_server_api import fake_app, wait_healthy

END_OF_PROMPT = "~"  # the template's last character: the script starts after it
TEMPLATE = ("{% for m in messages %}{% if m.role == 'bogus' %}{{ raise_exception('no bogus here') }}{% endif %}"
            "[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
            "<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}{% endfor %}"
            "{% if tools %}tools={{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
            "{% if add_generation_prompt %}" + END_OF_PROMPT + "{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@dataclass
class ScriptedBackend(FakeBackend):
    """Greedy output is `script`, then end of generation; the script starts after the last `end_of_prompt`."""

    script: str = ""
    end_of_prompt: str = END_OF_PROMPT

    def _logits_after(self, history: list[int]) -> np.ndarray:
        text = "".join(self.token_bytes(t).decode() for t in history)
        written = len(text) - text.rindex(self.end_of_prompt) - len(self.end_of_prompt)
        target = self.tokenize(self.script[written])[0] if written < len(self.script) else EOG_TOKEN
        logits = np.zeros(self.n_vocab, dtype=np.float32)
        logits[target] = 100.0  # whatever the temperature
        return logits


def scripted_client(script: str, template: str = TEMPLATE, end_of_prompt: str = END_OF_PROMPT,
                    **server: Any) -> Iterator[OpenAI]:
    """An SDK client of an app over the scripted backend; server: more of the server's config."""
    def engine() -> Engine:
        return Engine(ScriptedBackend(n_seq_max=2, n_ctx_seq=512, n_batch=512, script=script,
                                      end_of_prompt=end_of_prompt), EngineConfig(max_slots=2, n_batch=512))

    with TestClient(fake_app(engine, "fake-model", chat_template=template, **server)) as http:
        wait_healthy(http)
        yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def calling() -> Iterator[OpenAI]:
    yield from scripted_client("Let me check. " + CALL)


@pytest.fixture(scope="module")
def chatting() -> Iterator[OpenAI]:
    yield from scripted_client("It is sunny.")


def ask(client: OpenAI, **kwargs):
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Weather?"}],
                                          temperature=0, **kwargs)


def test_the_jinja_template_renders_the_prompt(chatting: OpenAI) -> None:
    reply = ask(chatting, tools=[WEATHER])
    assert reply.usage.prompt_tokens == len("[user]Weather?tools=get_weather~")
    assert reply.choices[0].message.content == "It is sunny."
    without_tools = ask(chatting, tools=[WEATHER], tool_choice="none")
    assert without_tools.usage.prompt_tokens == len("[user]Weather?~")


def test_raise_exception_in_the_template_is_a_400() -> None:
    template = JinjaChatTemplate(TEMPLATE)
    with pytest.raises(ValueError, match="no bogus here"):
        template.render([{"role": "bogus", "content": "x"}])
    assert JinjaChatTemplate("{{ strftime_now('%Y') }}").render([])[:2] == "20"
    with pytest.raises(ValueError, match="does not compile"):
        JinjaChatTemplate("{% for %}")


def test_special_tokens_and_the_sandbox() -> None:
    template = JinjaChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", "<s>", "</s>")
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>hi</s>"
    # A tokenizer that adds the BOS itself must not get it twice.
    assert JinjaChatTemplate("{{ bos_token }}x", "<s>", adds_bos=True).render([]) == "x"
    for unsafe in ("{{ messages.append(1) }}", "{{ ''.__class__.__mro__ }}"):  # a template is data, not code
        with pytest.raises(ValueError, match="refused"):
            JinjaChatTemplate(unsafe).render([{"role": "user", "content": "x"}])


def test_history_with_tool_calls_and_results_reaches_the_template(chatting: OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = chatting.chat.completions.create(model="fake-model", messages=messages, tools=[WEATHER])
    rendered = '[user]Weather?[assistant]<call get_weather {"city": "Paris"}>[tool]sunnytools=get_weather~'
    assert reply.usage.prompt_tokens == len(rendered)


def test_a_tool_call_in_the_reply_is_parsed(calling: OpenAI) -> None:
    choice = ask(calling, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and call.type == "function"
    # Without tools, the same text is just text.
    plain = ask(calling).choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None and "<tool_call>" in plain.message.content


def test_tool_choice_none_leaves_the_reply_as_text(calling: OpenAI) -> None:
    choice = ask(calling, tools=[WEATHER], tool_choice="none").choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert "<tool_call>" in choice.message.content


BOOK = {"type": "function", "function": {"name": "book_table", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("tool_choice", "names"), [
    ("auto", None), ("none", None), ("required", {"get_weather", "book_table"}),
    ({"type": "function", "function": {"name": "book_table"}}, {"book_table"})])
@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_a_forced_tool_choice_is_held_to_the_models_own_call_format(tool_choice, names: set[str] | None,
                                                                    parser: str) -> None:
    """The real model's test checks the calls a grammar produces; here, which grammar a request gets."""
    functions = [("get_weather", WEATHER["function"]["parameters"]), ("book_table", BOOK["function"]["parameters"])]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[WEATHER, BOOK],
                                    tool_choice=tool_choice)
    grammar = request.for_model_writing(TOOL_PARSERS[parser]).sampling_grammar()
    if names is None:
        assert grammar is None
    else:
        chosen = [(name, schema) for name, schema in functions if name in names]
        assert grammar == TOOL_PARSERS[parser].forced_call_grammar(chosen, parallel=True)


def test_streamed_tool_calls(calling: OpenAI) -> None:
    chunks = list(ask(calling, tools=[WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert content.strip() == "Let me check."
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(("body", "fragment"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": None, "tool_choice": "required"}, "needs tools"),
    ({"tool_choice": "sometimes"}, "'none', 'auto', 'required'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus-type"}}}]},
     "invalid JSON schema"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_tool_requests_are_400(chatting: OpenAI, body: dict, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(chatting, **{"tools": [WEATHER], **body})
    assert fragment in caught.value.message


@pytest.mark.parametrize(("text", "content", "calls"), [
    (CALL, None, [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "get_weather", "arguments": {}}', None, [("get_weather", {})]),  # no closing tag
    (CALL + '\n<tool_call>\n{"name": "get_weather", "argu', None, [("get_weather", {"city": "Paris"})]),  # cut
    ('<tool_call>{"name": "nope"}</tool_call> ' + CALL, '<tool_call>{"name": "nope"}</tool_call>',
     [("get_weather", {"city": "Paris"})]),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {}}; {"name": "get_weather", "parameters": {"a": 1}}',
     None, [("get_weather", {}), ("get_weather", {"a": 1})]),
    ('[{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]', None, [("get_weather", {"city": "Oslo"})]),
    ('{"name": "unknown_tool", "parameters": {}}', '{"name": "unknown_tool", "parameters": {}}', []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("Just text {with braces}", "Just text {with braces}", []),
])
def test_tool_call_formats(text: str, content: str | None, calls: list) -> None:
    parsed_content, parsed = DEFAULT_TOOL_PARSER.parse(text, {"get_weather"})
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls


def test_a_stream_sends_plain_text_at_once_and_holds_what_may_be_a_call() -> None:
    stream = DEFAULT_TOOL_PARSER.stream({"get_weather"})
    pieces = ["It is ", "warm", " <tool", "_call>{}"]
    assert [stream.feed(piece).content for piece in pieces] == ["It is ", "warm", " ", ""]
    assert stream.finish().content == "<tool_call>{}"  # not a call after all: the held text is sent


def test_without_a_jinja_template_the_backend_matcher_serves_and_tools_are_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    fallback = ChatPrompter(TemplateSource("{% for %}"), lambda messages: f"matched {len(messages)}")
    assert "does not compile" in caplog.text  # the broken GGUF template is named in the log, then skipped
    assert fallback.prompt([{"role": "user", "content": "x"}]) == "matched 1"
    with pytest.raises(ValueError, match="tools need a Jinja chat template"):
        fallback.prompt([{"role": "user", "content": "x"}], tools=[WEATHER])


CODE_AND_JSON = ('Use `x = {"a": [1, 2]}` or <b>{"name": "get_weather"}</b> and [3]; '
                 "that is all there is to it, really.")


def test_with_tools_on_text_with_code_and_json_streams_as_it_comes() -> None:
    for client in scripted_client(CODE_AND_JSON):
        chunks = list(ask(client, tools=[WEATHER], stream=True))
    content = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(content) == CODE_AND_JSON and chunks[-1].choices[0].finish_reason == "stop"
    # Every character but a possible call's opening is sent in the chunk of its own token: "that is all" comes
    # long before the reply ends, though the text opened a brace, a bracket and a tag before it.
    arrived = next(i for i in range(len(content)) if "that is all" in "".join(content[:i + 1]))
    assert arrived < len(chunks) - 20


MISTRAL_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}"
                    "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}"
                    "{% endfor %}{% if add_generation_prompt %}" + END_OF_PROMPT + "{% endif %}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_written_and_read_in_the_templates_own_format(stream: bool) -> None:
    """The fake samples its script and the grammar checks each token: a Mistral call passes only the Mistral
    grammar, which a Mistral template's request gets."""
    for client in scripted_client('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', MISTRAL_TEMPLATE):
        reply = ask(client, tools=[WEATHER], tool_choice="required", stream=stream)
        if stream:
            calls = [call for chunk in reply for call in chunk.choices[0].delta.tool_calls or []]
        else:
            assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
            calls = reply.choices[0].message.tool_calls
    [call] = calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert len(call.id) == 9  # Mistral's own ids
