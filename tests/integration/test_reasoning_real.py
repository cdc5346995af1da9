"""`cobali serve` on the embedded model with the Qwen3 test template, through the official openai client: a grammar
makes the model write a think block (a 135M model does not think on its own), and the reply comes back with its
reasoning apart from its content, whole and streamed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.integration.test_server_openai import running_server

QWEN3 = Path(__file__).resolve().parents[2] / "cobali" / "templates" / "qwen3.jinja"
THINK_THEN_ANSWER = r"<think>[a-z][a-z ]{0,20}</think>[A-Za-z][A-Za-z ]{0,20}"  # within max_tokens, whatever it writes
REASONING, CONTENT = re.compile(r"[a-z][a-z ]{0,20}"), re.compile(r"[A-Za-z][A-Za-z ]{0,20}")


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    with running_server("--chat-template", str(QWEN3), "--served-model-name", "smol") as (base, _proc):
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client: OpenAI, **kwargs):
    return client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Is Rome in Italy?"}], max_tokens=64, temperature=0,
        extra_body={"structured_outputs": {"regex": THINK_THEN_ANSWER}}, **kwargs)


def test_the_think_block_comes_back_as_reasoning_content(client: OpenAI) -> None:
    choice = ask(client).choices[0]
    message = choice.message
    assert choice.finish_reason == "stop"
    assert REASONING.fullmatch(message.reasoning_content.strip()) and "<think>" not in message.reasoning_content
    assert CONTENT.fullmatch(message.content) and "think>" not in message.content
    reasoning, content = "", ""
    for chunk in ask(client, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)  # greedy: the same reply
