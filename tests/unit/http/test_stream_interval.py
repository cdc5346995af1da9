"""--stream-interval N: a stream carries the same text, finish_reason and usage as with N = 1, in fewer chunks
(its first text and its end never wait). Through the official `openai` client over the fake backend."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai import OpenAI

from cobali.config.flags import engine_setup
from cobali.config.serve_flags import add_serve_args, server_config
from cobali.http.config import ServerConfig
from cobali.http.render.replies import CHAT, COMPLETION
from cobali.http.serve import build_app
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

INTERVAL = 3


@pytest.fixture(scope="module")
def clients() -> Iterator[dict[int, OpenAI]]:
    with (TestClient(create_app_with(1)) as one, TestClient(create_app_with(INTERVAL)) as several):
        for http in (one, several):
            wait_healthy(http)
        yield {n: OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
               for n, http in ((1, one), (INTERVAL, several))}


def create_app_with(stream_interval: int) -> FastAPI:
    return fake_app(fake_engine(), "fake-model", stream_interval=stream_interval)


def completion_stream(client: OpenAI, **request) -> tuple[dict[int, str], dict[int, str], dict, list[list[int]]]:
    """Per choice: the text and finish_reason; the usage; and per chunk the tokens of each choice in it."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage: dict = {}
    tokens_per_chunk: list[list[int]] = []
    for chunk in client.completions.create(model="fake-model", stream=True, temperature=0, logprobs=0,
                                           stream_options={"include_usage": True}, **request):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
        tokens_per_chunk.append([len(c.logprobs.tokens) if c.logprobs else 0 for c in chunk.choices])
    return texts, reasons, usage, tokens_per_chunk


def test_a_stream_interval_keeps_text_reason_and_usage(clients: dict[int, OpenAI]) -> None:
    reference = completion_stream(clients[1], prompt="abcdef", max_tokens=30, extra_body={"ignore_eos": True})
    stop = reference[0][0][11:13]  # a stop string the output is known to reach
    cases = [{"prompt": "abcdef", "max_tokens": 10, "extra_body": {"ignore_eos": True}},
             {"prompt": "abcdef", "max_tokens": 30, "stop": [stop], "extra_body": {"ignore_eos": True}},
             {"prompt": "xyz", "max_tokens": 7, "n": 2, "extra_body": {"ignore_eos": True}},
             {"prompt": "qrs", "max_tokens": 40}]  # ends on an end-of-generation token, or on length
    for request in cases:
        texts, reasons, usage, _ = completion_stream(clients[INTERVAL], **request)
        assert (texts, reasons, usage) == completion_stream(clients[1], **request)[:3], request
    assert completion_stream(clients[INTERVAL], **cases[1])[1] == {0: "stop"}


def test_a_stream_sends_every_n_tokens_and_never_delays_the_first(clients: dict[int, OpenAI]) -> None:
    """Tokens per chunk, read from its logprobs (which end where the chunk's text does). This prompt's output
    has no end-of-generation token (no text: it would ride in the next chunk)."""
    request = {"prompt": "hello", "max_tokens": 11, "extra_body": {"ignore_eos": True}}
    *_, chunks = completion_stream(clients[INTERVAL], **request)
    per_chunk = [c[0] for c in chunks if c]  # the usage chunk has no choices
    assert per_chunk == [1, INTERVAL, INTERVAL, INTERVAL, 1]  # the last token ends the stream at once
    *_, chunks = completion_stream(clients[1], **request)
    assert [c[0] for c in chunks if c] == [1] * 11


def test_chat_streams_the_same_content(clients: dict[int, OpenAI]) -> None:
    def content(client: OpenAI) -> tuple[str, str | None, int]:
        text, reason, n_chunks = "", None, 0
        for chunk in client.chat.completions.create(model="fake-model", stream=True, max_tokens=13, temperature=0,
                                                    messages=[{"role": "user", "content": "hello"}],
                                                    extra_body={"ignore_eos": True}):
            n_chunks += 1
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason, n_chunks

    text, reason, n_chunks = content(clients[INTERVAL])
    reference = content(clients[1])
    assert (text, reason) == reference[:2] and len(text) == 13
    assert n_chunks < reference[2]


@pytest.mark.parametrize("kind", [COMPLETION, CHAT])
@pytest.mark.parametrize("text", ["a", 'say "hi"\n\\', "é€😀", "\x00\x1f</script>"])
def test_the_plain_chunk_template_renders_what_the_general_path_does(kind, text: str) -> None:
    assert json.loads(kind.text_chunk_choices(2, text)) == [kind.chunk_choice(2, text, None, None)]


def test_a_stream_interval_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="--stream-interval must be at least 1, got 0"):
        ServerConfig(stream_interval=0)


def test_the_flag_reaches_the_streams() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--stream-interval", "5"])
    app = build_app(engine_setup(args), server_config(args))  # the engine loads only when the app starts
    assert app.state.server.client.stream_interval == 5


@pytest.mark.parametrize("interval", [1, INTERVAL])
def test_with_async_scheduling_a_chunks_logprobs_are_those_of_its_text(interval: int) -> None:
    """The host thread streams a decode's tokens after counting in the stand-ins of the next decode: a chunk
    stamped with the request's output count then carried the logprob of a token whose text had not come yet."""
    with TestClient(fake_app(fake_engine(async_scheduling=True), "fake-model", stream_interval=interval)) as http:
        wait_healthy(http)
        client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        for _ in range(3):
            for chunk in client.completions.create(model="fake-model", prompt="hello", max_tokens=24, stream=True,
                                                   logprobs=0, temperature=0, extra_body={"ignore_eos": True}):
                for choice in chunk.choices:  # every token of the fake model is one character
                    assert len(choice.logprobs.tokens if choice.logprobs else []) == len(choice.text), choice
