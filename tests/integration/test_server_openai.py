"""`cobali serve` on the embedded model, driven by the official openai client.

The server runs with --threads 1: on a small shared machine, llama.cpp's spinning thread pool collapses
when it competes for cores (measured: 55 tok/s with one thread, ~1 tok/s with two under load).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from openai import OpenAI

from tests.unit.http.test_reliability import soak_module

COBALI = str(Path(sys.executable).with_name("cobali"))
PROMPT = "The capital of France is"
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@contextmanager
def running_server(*flags: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    port = soak_module().free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([COBALI, "serve", "--port", str(port), "--threads", "1", *flags],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base, proc)
            yield base, proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(30)
            log.seek(0)
            print(log.read().decode(errors="replace")[-4000:])  # shown by pytest on failure


def wait_healthy(base: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become healthy")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server("--max-slots", "16", "--served-model-name", "smol") as (base, _proc):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_whole_and_streamed(client: OpenAI) -> None:
    whole = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.model == "smol"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    stream = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_whole_and_streamed(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens <= 12
    deltas = client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == text


def test_logprobs_through_the_openai_client(client: OpenAI) -> None:
    completion = client.completions.create(model="smol", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True}).choices[0]
    assert "".join(completion.logprobs.tokens) == completion.text
    assert all(len(top) <= 2 and max(top.values()) == lp
               for top, lp in zip(completion.logprobs.top_logprobs, completion.logprobs.token_logprobs, strict=True))
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=3).choices[0]
    content = chat.logprobs.content
    assert content and all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)
    assert all(c.logprob <= 0 for c in content)


def test_stop_strings_are_honoured(client: OpenAI) -> None:
    # The reference is the second of two identical requests: it finds the prompt's KV cached exactly as the
    # stopped request will, so both compute the same batches and the comparison holds on any CPU.
    for _ in range(2):
        full = client.completions.create(model="smol", prompt=PROMPT, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:][:3]
    cut = client.completions.create(model="smol", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


def test_json_schema_output_parses(client: OpenAI) -> None:
    schema = {"type": "object",
              "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
              "required": ["ok", "color"]}
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=32, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    value = json.loads(reply.choices[0].message.content)
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green")


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": ["integer", "null"]}},
    {"anyOf": [{"type": "string"}, {"const": {"a": [1]}}]},
    {"type": "object", "properties": {'k"\\': {"type": "number"}}, "additionalProperties": False},
])
def test_llama_cpp_accepts_the_generated_grammars(server: str, schema: dict) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    response = httpx.post(f"{server}/v1/completions", json={"prompt": "[", "max_tokens": 2,
                                                           "response_format": response_format}, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("extra", [
    {"guided_choice": ["positive", "negative", "neutral"]},
    {"structured_outputs": {"choice": ["positive", "negative", "neutral"]}},
    {"grammar": 'root ::= "positive" | "negative" | "neutral"'},
], ids=["vllm-guided", "vllm-structured", "llama-server"])
def test_a_choice_constrains_the_answer(client: OpenAI, extra: dict) -> None:
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Is 'I love this film' positive or negative?"}],
        max_tokens=8, temperature=0.7, seed=3, extra_body=extra)
    assert reply.choices[0].message.content in ("positive", "negative", "neutral")


@pytest.mark.parametrize("extra", [{"guided_regex": PHONE}, {"structured_outputs": {"regex": PHONE}}],
                         ids=["vllm-guided", "vllm-structured"])
def test_a_regex_shapes_the_answer(client: OpenAI, extra: dict) -> None:
    reply = client.completions.create(model="smol", prompt="Call me at", max_tokens=32, temperature=1.0, seed=5,
                                      extra_body=extra).choices[0]
    assert reply.finish_reason == "stop" and re.fullmatch(PHONE, reply.text), reply.text


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    kind: Literal["cat", "dog"]


class Owner(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    pets: list[Pet] = pydantic.Field(max_length=2)


def test_the_openai_clients_parse_gets_its_pydantic_model(client: OpenAI) -> None:
    """`parse` sends a strict schema with $defs and $refs; the grammar holds it, so the reply always parses."""
    for seed in (1, 2):
        reply = client.chat.completions.parse(
            model="smol", messages=[{"role": "user", "content": "Describe a pet owner."}], max_tokens=200,
            temperature=1.0, seed=seed, response_format=Owner).choices[0]
        assert reply.finish_reason == "stop" and isinstance(reply.message.parsed, Owner), reply.message.content


def test_llama_server_json_schema_field(client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = client.completions.create(model="smol", prompt="JSON:", max_tokens=16, temperature=0,
                                      extra_body={"json_schema": schema})
    assert isinstance(json.loads(reply.choices[0].text)["ok"], bool)


def test_a_grammar_llama_cpp_cannot_parse_is_a_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt="x", max_tokens=2, extra_body={"guided_grammar": "root ::= ("})


def max_batch_seen(server: str) -> bool:
    """True when some tick batched more than one request: the le="1.0" bucket misses some ticks."""
    samples = {}
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith("cobali:iteration_requests_"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples['cobali:iteration_requests_bucket{le="1.0"}'] < samples["cobali:iteration_requests_count"]


def test_sixteen_concurrent_streams(server: str, client: OpenAI) -> None:
    running_seen: list[float] = []
    done = threading.Event()

    def poll_running() -> None:
        while not done.is_set():
            for line in httpx.get(f"{server}/metrics").text.splitlines():
                if line.startswith("cobali:num_requests_running "):
                    running_seen.append(float(line.split()[-1]))
            time.sleep(0.02)

    def one(i: int) -> tuple[str, str | None]:
        stream = client.completions.create(model="smol", prompt=f"{i} + {i} =", max_tokens=16, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = list(stream)
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    poller = threading.Thread(target=poll_running)
    poller.start()
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(16)))
    finally:
        done.set()
        poller.join()
    assert all(reason == "length" and text for text, reason in results)
    assert max_batch_seen(server)
    assert max(running_seen) > 1, running_seen


def test_sigterm_finishes_in_flight_requests_then_exits_0() -> None:
    with running_server("--max-slots", "2") as (base, proc):
        body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
