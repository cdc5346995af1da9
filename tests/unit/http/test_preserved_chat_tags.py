"""A chat model whose tool-call tags are control tokens (Mistral's `[TOOL_CALLS]` and `[ARGS]`, as in its real
vocabularies): the server keeps their text in the reply, so its calls are read. The fake vocabulary holds the two
tags as control tokens, shown as no text unless preserved."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from cobali.backends.fake import EOG_TOKEN, FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.frontend.inputs import InputProcessor, ReplyReader
from cobali.frontend.interface import SamplingParams
from cobali.frontend.parsers.reasoning import REASONING_PARSERS
from cobali.frontend.parsers.tools import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from tests.unit.http.test_chat_tools import END_OF_PROMPT, MISTRAL_TEMPLATE, WEATHER, ask
from tests.unit.http.test_server_api import fake_app, wait_healthy

CONTROL_TOKENS = {96: "[TOOL_CALLS]", 97: "[ARGS]"}
CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'


@dataclass
class ControlScriptBackend(FakeBackend):
    """Greedy output is the tokens of `script` (its tags as control tokens), then end of generation; the script
    starts after the prompt's last END_OF_PROMPT."""

    script: str = ""

    def _logits_after(self, history: list[int]) -> np.ndarray:
        [end_of_prompt] = self.tokenize(END_OF_PROMPT)
        written = history[::-1].index(end_of_prompt)
        script = self.tokenize(self.script)
        logits = np.zeros(self.n_vocab, dtype=np.float32)
        logits[script[written] if written < len(script) else EOG_TOKEN] = 100.0
        return logits


def control_client(script: str) -> Iterator[OpenAI]:
    def engine() -> Engine:
        backend = ControlScriptBackend(n_seq_max=2, n_ctx_seq=512, n_batch=512, n_vocab=98,
                                       control_tokens=CONTROL_TOKENS, script=script)
        return Engine(backend, EngineConfig(max_slots=2, n_batch=512))

    with TestClient(fake_app(engine, "fake-model", chat_template=MISTRAL_TEMPLATE)) as http:
        wait_healthy(http)
        yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def calling() -> Iterator[OpenAI]:
    yield from control_client("Let me check." + CALL)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_after_control_tokens_is_read(calling: OpenAI, stream: bool) -> None:
    reply = ask(calling, tools=[WEATHER], stream=stream)
    if stream:
        chunks = list(reply)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    else:
        assert reply.choices[0].finish_reason == "tool_calls"
        content, calls = reply.choices[0].message.content, reply.choices[0].message.tool_calls
    assert content == "Let me check."
    [call] = calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_without_tools_the_tool_tags_stay_unshown(calling: OpenAI) -> None:
    """Only a request with active tools keeps the tool-call parser's tags (as llama-server does)."""
    reply = ask(calling)
    assert reply.choices[0].message.content == 'Let me check.get_weather{"city": "Paris"}'
    assert not reply.choices[0].message.tool_calls


def inputs_of(template: str, control_tokens: dict[int, str] = CONTROL_TOKENS) -> InputProcessor:
    backend = FakeBackend(n_vocab=96 + len(control_tokens), control_tokens=control_tokens)
    engine = Engine(backend, EngineConfig(max_slots=2))
    return InputProcessor(engine.model_info(), engine.tokenizer, engine.grammars, chat_template=template)


def preserved(inputs: InputProcessor, tools: dict) -> frozenset[int]:
    [(_, params)] = inputs.chat_choices([([1, 2], SamplingParams())], ReplyReader(inputs.parsers, "", tools)).choices
    return params.preserved_tokens


def test_the_tags_preserved_are_the_parsers_control_tokens() -> None:
    inputs = inputs_of(MISTRAL_TEMPLATE)
    # `[CALL_ID]` is several tokens in this vocabulary (plain text, shown as it is): not preserved.
    assert preserved(inputs, {"get_weather": {}}) == frozenset(CONTROL_TOKENS)
    assert preserved(inputs, {}) == frozenset()  # no active tools: the tool-call parser reads nothing
    # The reasoning parser's tags are kept with tools or without.
    thinking = inputs_of("[THINK]" + MISTRAL_TEMPLATE, {**CONTROL_TOKENS, 98: "[THINK]", 99: "[/THINK]"})
    assert preserved(thinking, {}) == {98, 99} and preserved(thinking, {"f": {}}) == {96, 97, 98, 99}
    # A template whose parsers read tags that are plain text here (Hermes's `<tool_call>`) preserves none.
    assert preserved(inputs_of("{{ '<tool_call>' }}"), {"f": {}}) == frozenset()


def test_every_parser_lists_the_tags_it_reads() -> None:
    for parser in [*TOOL_PARSERS.values(), DEFAULT_TOOL_PARSER, *REASONING_PARSERS.values()]:
        assert parser.special_tags and all(parser.special_tags), parser.name
