"""The OpenAI surface that clients and eval harnesses rely on, through the official `openai` SDK over the fake
backend (its logits are known, so logprobs can be checked exactly)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from cobali.backends.fake import FakeBackend
from cobali.http.protocol.unknown_fields import IGNORED_FIELDS_HEADER
from tests.unit.http.test_server_api import N_CTX_SEQ, fake_app, fake_engine, wait_healthy
from tests.unit.http.test_server_live import live_server

PROMPT = "the quick brown fox jumps over"  # 30 fake tokens: long enough for the prefix cache to reuse it


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    with TestClient(fake_app(fake_engine(), "fake-model")) as http:
        wait_healthy(http)
        yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def fake_logprob(history: list[int], token: int) -> float:
    """What the fake backend's distribution gives `token` after `history`."""
    logits = FakeBackend()._logits_after(history).astype(np.float64)
    return float(logits[token] - logits.max() - np.log(np.exp(logits - logits.max()).sum()))


def bad_request(call) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.message


def test_stream_options_without_stream_is_refused(client: OpenAI) -> None:
    options = {"include_usage": True}
    for call in (lambda: client.completions.create(model="fake-model", prompt="x", max_tokens=1,
                                                   stream_options=options, stream=False),
                 lambda: client.chat.completions.create(model="fake-model", max_tokens=1, stream_options=options,
                                                        messages=[{"role": "user", "content": "x"}])):
        assert "stream_options" in bad_request(call)


def test_logit_bias_steers_sampling(client: OpenAI) -> None:
    token = FakeBackend().tokenize("Z")[0]
    text = client.completions.create(model="fake-model", prompt="abc", max_tokens=5, temperature=0,
                                     logit_bias={str(token): 100}, extra_body={"ignore_eos": True}).choices[0].text
    assert text == "ZZZZZ"


@pytest.mark.parametrize(("bias", "fragment"), [({"a": 1}, "token ids"), ({"-3": 1}, "token ids"),
                                                ({"5": 101}, "less than or equal to 100"),
                                                ({str(10**6): 1}, "not in the vocabulary")])
def test_invalid_logit_bias_is_a_400(client: OpenAI, bias: dict, fragment: str) -> None:
    message = bad_request(lambda: client.completions.create(model="fake-model", prompt="x", max_tokens=1,
                                                             logit_bias=bias))
    assert fragment in message


def test_logprobs_zero_still_gives_the_sampled_token(client: OpenAI) -> None:
    choice = client.completions.create(model="fake-model", prompt="abc", max_tokens=3, temperature=0.7, seed=1,
                                       logprobs=0, extra_body={"ignore_eos": True}).choices[0]
    tops = choice.logprobs.top_logprobs
    assert [list(top) for top in tops] == [[token] for token in choice.logprobs.tokens]
    assert [top[t] for top, t in zip(tops, choice.logprobs.tokens, strict=True)] == choice.logprobs.token_logprobs


def test_echo_with_logprobs_scores_the_prompt(client: OpenAI) -> None:
    prompt_ids = FakeBackend().tokenize(PROMPT)
    for _ in range(2):  # the second time the prompt is in the prefix cache, which must not skip positions
        response = client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=2, temperature=0,
                                             echo=True, logprobs=1, extra_body={"ignore_eos": True})
        choice = response.choices[0]
        assert choice.text.startswith(PROMPT) and len(choice.text) == len(PROMPT) + 2
        lp = choice.logprobs
        assert len(lp.tokens) == response.usage.prompt_tokens + 2 and "".join(lp.tokens) == choice.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [fake_logprob(prompt_ids[:i], prompt_ids[i]) for i in range(1, len(prompt_ids))]
        assert lp.token_logprobs[1:len(prompt_ids)] == pytest.approx(expected, abs=1e-5)
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]


def test_echo_without_logprobs_and_streamed(client: OpenAI) -> None:
    whole = client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True}).choices[0]
    assert whole.text.startswith(PROMPT) and whole.logprobs is None
    chunks = list(client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=4, temperature=0,
                                            echo=True, logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert "".join(tokens) == whole.text and chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_model_by_id(client: OpenAI) -> None:
    card = client.models.retrieve("fake-model")
    assert card.id == "fake-model" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-17")
    assert "does not exist" in caught.value.message


def test_max_tokens_beyond_the_context_states_its_length(client: OpenAI) -> None:
    message = bad_request(lambda: client.completions.create(model="fake-model", prompt="abcd", max_tokens=10**6))
    assert f"context length is {N_CTX_SEQ} tokens" in message
    message = bad_request(lambda: client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=N_CTX_SEQ))
    assert f"context length is {N_CTX_SEQ} tokens" in message


def test_invalid_json_schema_is_a_400(client: OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus-type"}}}
    message = bad_request(lambda: client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], response_format=response_format))
    assert "invalid JSON schema" in message and "bogus-type" in message


def test_unknown_role_lists_the_allowed_ones(client: OpenAI) -> None:
    message = bad_request(lambda: client.chat.completions.create(
        model="fake-model", messages=[{"role": "wizard", "content": "hi"}]))
    assert all(role in message for role in ("system", "user", "assistant", "tool"))


def test_unknown_fields_are_named_in_a_header(client: OpenAI) -> None:
    raw = client.completions.with_raw_response.create(model="fake-model", prompt="x", max_tokens=1,
                                                      extra_body={"temprature": 0.5, "bogus\n": 1})
    assert raw.headers[IGNORED_FIELDS_HEADER] == "bogus\\n,temprature"
    assert raw.parse().choices[0].text is not None
    clean = client.completions.with_raw_response.create(model="fake-model", prompt="x", max_tokens=1)
    assert IGNORED_FIELDS_HEADER not in clean.headers


def test_a_12_mb_body_gets_a_413_that_urllib_can_read() -> None:
    """urllib writes the whole body before reading: the server must not close on it mid-upload."""
    with live_server() as (http, _server):
        body = json.dumps({"prompt": "a" * (12 * 1024 * 1024)}).encode()
        request = urllib.request.Request(f"{str(http.base_url).rstrip('/')}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 413
        assert json.loads(caught.value.read())["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(("route", "extra", "fragment"), [
    ("completions", {"best_of": 3}, "best_of is not supported"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio is not supported"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"web_search_options": {}}, "web_search_options is not supported"),
])
def test_openai_fields_this_server_cannot_honour_are_400(client: OpenAI, route: str, extra: dict,
                                                         fragment: str) -> None:
    if route == "completions":
        call = lambda: client.completions.create(model="fake-model", prompt="x", max_tokens=1,  # noqa: E731
                                                 extra_body=extra)
    else:
        call = lambda: client.chat.completions.create(model="fake-model", max_tokens=1,  # noqa: E731
                                                      messages=[{"role": "user", "content": "x"}], extra_body=extra)
    assert fragment in bad_request(call)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: OpenAI, chat: bool) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts its choice's tokens so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    ask = {"model": "fake-model", "max_tokens": 6, "temperature": 0, "stream": True, "stream_options": options,
           "extra_body": {"ignore_eos": True}}
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **ask))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **ask))
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert all(c.usage is not None and c.usage.prompt_tokens == prompt_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[-2] == 6  # the last text chunk, the usage chunk
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in chunks)
    plain = list(client.completions.create(prompt=PROMPT, **{**ask, "stream_options": {"include_usage": True}}))
    assert all(c.usage is None for c in plain[:-1])  # without it only the last chunk has usage


def test_prompt_logprobs_as_vllm_reports_them(client: OpenAI) -> None:
    prompt = FakeBackend().tokenize("abcd")
    reply = client.completions.create(model="fake-model", prompt="abcd", max_tokens=1, n=2, temperature=0,
                                      extra_body={"prompt_logprobs": 2})
    for choice in reply.choices:
        entries = choice.prompt_logprobs
        assert len(entries) == 4 and entries[0] is None
        for position, entry in enumerate(entries[1:], 1):
            token = prompt[position]
            own = entry[str(token)]
            assert own["logprob"] == pytest.approx(fake_logprob(prompt[:position], token))
            assert own["decoded_token"] == "abcd"[position]
            ranked = sorted((v["rank"], v["logprob"]) for v in entry.values())
            assert ranked[0][0] == 1 and [lp for _, lp in ranked] == sorted((lp for _, lp in ranked), reverse=True)
            assert len(entry) in (2, 3)  # the top 2, and the prompt's token when it is not among them
    chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and all(len(e) == 1 for e in chat.prompt_logprobs[1:])
    assert "prompt_logprobs" not in client.completions.create(
        model="fake-model", prompt="abcd", max_tokens=1, echo=True, logprobs=1).choices[0].model_extra


def test_prompt_logprobs_leave_echo_with_its_own_count(client: OpenAI) -> None:
    reply = client.completions.create(model="fake-model", prompt="abcd", max_tokens=1, echo=True, logprobs=1,
                                      extra_body={"prompt_logprobs": 5})
    assert all(len(top) <= 2 for top in reply.choices[0].logprobs.top_logprobs[1:])  # 1 + the token itself
    assert all(len(entry) >= 5 for entry in reply.choices[0].prompt_logprobs[1:])
    assert "prompt_logprobs" in bad_request(lambda: client.completions.create(
        model="fake-model", prompt="x", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}))
    for value in (-1, 21, "2"):
        assert "prompt_logprobs" in bad_request(lambda value=value: client.completions.create(
            model="fake-model", prompt="x", max_tokens=1, extra_body={"prompt_logprobs": value}))
