"""vLLM's request extras against vLLM's own behaviour, through the `openai` client over the fake backend (one
token a character, no BOS): truncate_prompt_tokens past the context, continuous usage and cached tokens with
several prompts, prompt_logprobs beside echo's logprobs, and stop strings that only count from min_tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from cobali.engine.detok import TextStream
from tests.unit.http.test_server_api import N_CTX_SEQ, fake_app, fake_engine, wait_healthy

MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def client(request: pytest.FixtureRequest) -> Iterator[OpenAI]:
    with TestClient(fake_app(fake_engine(async_scheduling=request.param), "fake-model")) as http:
        wait_healthy(http)
        yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_truncate_prompt_tokens_past_the_context_is_vllms_400_even_for_a_short_prompt(client: OpenAI) -> None:
    extra = {"truncate_prompt_tokens": N_CTX_SEQ + 1}
    calls = [lambda: client.completions.create(model="fake-model", prompt="abc", max_tokens=1, extra_body=extra),
             lambda: client.completions.create(model="fake-model", prompt="x" * 400, max_tokens=1, extra_body=extra),
             lambda: client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=1,
                                                    extra_body=extra)]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.param == "truncate_prompt_tokens"
        assert (f"truncate_prompt_tokens value ({N_CTX_SEQ + 1}) is greater than max_model_len ({N_CTX_SEQ}). "
                "Please, select a smaller truncation size.") in caught.value.message
    kept = client.completions.create(model="fake-model", prompt="abc", max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": N_CTX_SEQ})
    assert kept.usage.prompt_tokens == 3  # the whole context is a truncation size; the prompt is shorter


def test_continuous_usage_counts_each_choices_own_prompt(client: OpenAI) -> None:
    """vLLM: a chunk's usage has its own prompt's tokens; the last chunk sums every prompt once."""
    prompts = ["ab", "cdefgh"]
    chunks = list(client.completions.create(
        model="fake-model", prompt=prompts, n=2, max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    texts = [c for c in chunks if c.choices]
    assert {c.choices[0].index for c in texts} == {0, 1, 2, 3}
    for chunk in texts:
        own = len(prompts[chunk.choices[0].index // 2])
        assert chunk.usage.prompt_tokens == own
        assert chunk.usage.total_tokens == own + chunk.usage.completion_tokens
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (8, 12)


def test_cached_tokens_count_every_prompt_once(client: OpenAI) -> None:
    prompts = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs!!"]
    client.completions.create(model="fake-model", prompt=prompts, max_tokens=2, extra_body={"ignore_eos": True})
    again = client.completions.create(model="fake-model", prompt=prompts, n=2, max_tokens=2,
                                      extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens == sum(map(len, prompts))
    # All but each prompt's last token came from the cache; a prompt's n copies count it once.
    assert again.usage.prompt_tokens_details.cached_tokens == sum(len(p) - 1 for p in prompts)


def test_prompt_logprobs_keep_their_own_count_beside_echos_larger_logprobs(client: OpenAI) -> None:
    """echo + logprobs records the prompt's top `logprobs`; prompt_logprobs shows only its own k of them."""
    for k in (0, 1):
        reply = client.completions.create(model="fake-model", prompt="abcd", max_tokens=1, echo=True, logprobs=5,
                                          extra_body={"prompt_logprobs": k})
        entries = reply.choices[0].prompt_logprobs[1:]
        assert all(len(entry) <= k + 1 for entry in entries), entries  # the top k, and the prompt's own token
        assert all(sorted(v["rank"] for v in entry.values())[: k] == list(range(1, k + 1)) for entry in entries)
        assert all(len(top) == 6 for top in reply.choices[0].logprobs.top_logprobs[1:-1])  # echo keeps its 5


def test_a_short_stop_string_wholly_before_min_tokens_does_not_count(client: OpenAI) -> None:
    """vLLM looks for each stop string where it ends in the text of min_tokens' token or later: a longer stop string
    listed beside it must not widen that window back over text that came before."""
    ask = {"model": "fake-model", "prompt": "abc", "max_tokens": 40, "temperature": 0}
    text = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text
    m = next(m for m in range(3, 30) if text[m - 2] in text[m - 1:] and text[m - 2] not in text[: m - 2])
    short, long = text[m - 2], next(c * 3 for c in "~}|{" if c * 3 not in text)
    reply = client.completions.create(**ask, stop=[long, short], extra_body={"ignore_eos": True, "min_tokens": m})
    assert reply.choices[0].text == text[: text.index(short, m - 1)]
    assert reply.choices[0].model_extra["stop_reason"] == short


def test_text_stream_stops_where_vllms_stop_checker_does() -> None:
    """Seeded random texts, stop strings, min_tokens and reading patterns, against vLLM's rule: from the min_tokens-th
    token on, a stop string counts where it ends in that token's text (the earliest such one, here)."""
    rng = random.Random(0)
    for _ in range(3000):
        stops = tuple(dict.fromkeys("".join(rng.choices("ab", k=rng.randint(1, 3))) for _ in range(rng.randint(1, 3))))
        pieces = ["".join(rng.choices("abx", k=rng.randint(1, 3))) for _ in range(6)]
        include, min_tokens, streamed = rng.random() < 0.5, rng.randint(0, 4), rng.random() < 0.7
        stream = TextStream(stops, rng.randint(1, 3), min_tokens, include)
        emitted, stopped = "", False
        for n, piece in enumerate(pieces, 1):
            if stopped := stream.push(piece.encode(), decoded=n):
                break
            if streamed and stream.is_due(n):
                emitted += stream.take(n)
        emitted += stream.close(stopped)
        assert emitted == stream.text == vllm_stop(pieces, stops, min_tokens, include), (stops, pieces, min_tokens)


def vllm_stop(pieces: list[str], stops: tuple[str, ...], min_tokens: int, include: bool) -> str:
    text = ""
    for n, piece in enumerate(pieces, 1):
        before, text = len(text), text + piece
        hits = [(i, s) for s in stops if n >= min_tokens and (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            i, stop = min(hits, key=lambda hit: hit[0])
            return text[: i + (len(stop) if include else 0)]
    return text
