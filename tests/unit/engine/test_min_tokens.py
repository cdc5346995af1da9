"""vLLM's min_tokens, stop_token_ids, include_stop_str_in_output and stop_reason, on the fake backend, with both tick
loops."""

from __future__ import annotations

import math
import re

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from cobali.backends.fake import EOG_TOKEN, FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.outputs import RequestOutput
from cobali.engine.request import FinishReason
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from tests.unit.engine.test_engine import run_to_end
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

PROMPTS = [[1 + (i * 11) % 90 for i in range(n)] for n in range(1, 60)]


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def engine(request: pytest.FixtureRequest) -> Engine:
    return Engine(FakeBackend(n_seq_max=4, n_ctx_seq=4096),
                  EngineConfig(max_slots=4, prefill_chunk_tokens=64, n_batch=128, async_scheduling=request.param))


def early_stopper(engine: Engine, **params) -> tuple[list[int], RequestOutput]:
    """A prompt whose output ends on the end token after a few tokens, and that output."""
    runs = LLM(engine).generate(PROMPTS, SamplingParams(max_tokens=40, **params))
    return next((p, r) for p, r in zip(PROMPTS, runs, strict=True)
                if r.finish_reason is FinishReason.STOP and 2 <= len(r.token_ids) <= 20)


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "seed": 3}, {"logprobs": 2}],
                         ids=["greedy", "chain", "logprobs"])
def test_no_end_token_before_min_tokens(engine: Engine, params: dict) -> None:
    prompt, stopped = early_stopper(engine, **params)
    k = len(stopped.token_ids)  # the end token is output k: just what min_tokens=k bans (async: one stand-in)
    (longer,) = LLM(engine).generate([prompt], SamplingParams(max_tokens=40, min_tokens=k, **params))
    assert len(longer.token_ids) > k
    assert EOG_TOKEN not in longer.token_ids[:k]
    if "temperature" not in params:  # greedy: the same tokens up to the banned one (a draw's odds all move)
        assert longer.token_ids[: k - 1] == stopped.token_ids[: k - 1]
    if "logprobs" in params:  # reported from the model's own logits: the banned end token keeps its logprob
        top = dict(longer.logprobs[k - 1].top)
        assert longer.logprobs[k - 1].token != EOG_TOKEN
        assert math.isfinite(top[EOG_TOKEN]) and top[EOG_TOKEN] == stopped.logprobs[k - 1].logprob


def test_stop_token_ids_end_the_output_without_their_text(engine: Engine) -> None:
    (free,) = LLM(engine).generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True))
    token = free.token_ids[6]
    first = free.token_ids.index(token)
    (cut,) = LLM(engine).generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(token,)))
    assert cut.finish_reason is FinishReason.STOP
    assert cut.token_ids == free.token_ids[: first + 1]
    assert free.text.startswith(cut.text) and len(cut.text) == first
    # ...but not before min_tokens.
    (late,) = LLM(engine).generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(token,),
                                                      min_tokens=first + 2))
    assert token not in late.token_ids[: first + 2]


def test_stop_strings_count_only_from_min_tokens(engine: Engine) -> None:
    (free,) = LLM(engine).generate(["abc"], SamplingParams(max_tokens=40, ignore_eos=True))
    text = free.text
    stop = next(c for c in text if text.count(c) >= 2)  # one token a character: the fake's
    first = text.index(stop)
    second = text.index(stop, first + 1)
    assert EOG_TOKEN not in free.token_ids[: second + 1]  # so the ban changes nothing before it
    request = engine.add_request("abc", SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,),
                                                       min_tokens=first + 2), stream_interval=1)
    deltas = [o.text for o in run_to_end(engine)]
    assert request.finish_reason is FinishReason.STOP
    assert request.text == text[:second] == "".join(deltas)
    # Unstreamed, the first one is not emitted yet when min_tokens are out: it still does not count.
    (whole,) = LLM(engine).generate(["abc"], SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,),
                                                       min_tokens=first + 2))
    assert whole.text == text[:second]


def test_stop_reason_names_what_ended_it_and_the_stop_string_may_stay(engine: Engine) -> None:
    (free,) = LLM(engine).generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True))
    stop, token = free.text[8:10], free.token_ids[5]
    assert free.stop_reason is None
    kept = engine.add_request("abc", SamplingParams(max_tokens=30, ignore_eos=True, stop=("zzzz", stop),
                                                    include_stop_str=True), stream_interval=1)
    outputs = run_to_end(engine)
    cut = free.text.index(stop)
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (FinishReason.STOP, stop)
    assert kept.text == free.text[: cut + 2] == "".join(o.text for o in outputs)
    (by_id,) = LLM(engine).generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(token,)))
    assert by_id.stop_reason == token
    _, stopped = early_stopper(engine)
    assert (stopped.finish_reason, stopped.stop_reason) == (FinishReason.STOP, None)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in [0, max_tokens = 4]"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"min_tokens": 1, "grammar": "root ::= \"a\""}, "min_tokens cannot be combined with a grammar"),
])
def test_bad_values_are_refused(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        SamplingParams(**kwargs)


def test_the_server_takes_them_as_vllm_extras() -> None:
    with TestClient(fake_app(fake_engine(), "fake-model")) as http:
        wait_healthy(http)
        client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        free = client.completions.create(model="fake-model", prompt="abc", max_tokens=12,
                                         extra_body={"ignore_eos": True})
        token = http.post("/tokenize", json={"prompt": free.choices[0].text[5]}).json()["tokens"][0]
        cut = client.completions.create(model="fake-model", prompt="abc", max_tokens=12,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [token], "min_tokens": 2})
        assert cut.choices[0].finish_reason == "stop"
        assert free.choices[0].text.startswith(cut.choices[0].text) and len(cut.choices[0].text) <= 5
        assert cut.choices[0].model_extra["stop_reason"] == token
        text = free.choices[0].text
        stop = text[3]
        kept = client.completions.create(model="fake-model", prompt="abc", max_tokens=12, stop=[stop],
                                         extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
        assert kept.choices[0].text == text[: text.index(stop) + 1]
        assert kept.choices[0].model_extra["stop_reason"] == stop
        chunks = list(client.completions.create(model="fake-model", prompt="abc", max_tokens=12, stream=True,
                                                stop=[stop], extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == text[: text.index(stop)]
        assert [c.choices[0].model_extra["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [stop]
        for extra, fragment in [({"min_tokens": 5}, "min_tokens must be in [0, max_tokens = 4]"),
                                ({"stop_token_ids": [10**6]}, "stop_token_ids must be token ids")]:
            with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
                client.completions.create(model="fake-model", prompt="abc", max_tokens=4, extra_body=extra)
