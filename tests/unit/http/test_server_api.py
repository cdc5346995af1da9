"""The HTTP API over the fake backend, through FastAPI's TestClient (no model, no sockets)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.client import EngineClient
from cobali.frontend.offline import LLM
from cobali.frontend.transports import ThreadCore
from cobali.http.app import create_app
from cobali.http.config import ServerConfig

N_CTX_SEQ = 256


def fake_engine(backend: FakeBackend | None = None, **config) -> Callable[[], Engine]:
    return lambda: Engine(backend or FakeBackend(n_seq_max=4, n_ctx_seq=N_CTX_SEQ, n_batch=64),
                          EngineConfig(max_slots=4, n_batch=64, **config))


def fake_app(engine: Callable[[], Engine], name: str = "fake-model", **server: Any) -> FastAPI:
    """The app over an engine client of its own, as serve.build_app builds them; the test makes the engine."""
    config = ServerConfig(served_model_name=name, **server)
    return create_app(config, EngineClient(ThreadCore(engine), max_queue=config.max_queue,
                                           stream_interval=config.stream_interval))


def wait_healthy(client: TestClient) -> None:
    deadline = time.monotonic() + 10
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "server never became healthy"
        time.sleep(0.01)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def api(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    """Every API test runs on both tick loops: with async scheduling the engine thread drives a second one."""
    with TestClient(fake_app(fake_engine(async_scheduling=request.param), "fake-model")) as client:
        wait_healthy(client)
        yield client


def sse_payloads(text: str) -> list:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def expected_text(prompt: str, max_tokens: int) -> str:
    """What a fresh engine produces for the prompt, greedily: the server must not change it."""
    engine = fake_engine()()
    [request] = LLM(engine).generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return request.text


def test_completion_matches_the_engine_and_counts_usage(api: TestClient) -> None:
    body = api.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True}).json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    [choice] = body["choices"]
    assert choice["text"] == expected_text("hello", 8)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_prompt_sent_again_reports_its_cached_tokens_in_usage_and_metrics(api: TestClient) -> None:
    request = {"prompt": "a prompt long enough to be worth keeping", "max_tokens": 4, "ignore_eos": True}
    first = api.post("/v1/completions", json=request).json()["usage"]
    again = api.post("/v1/completions", json=request).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] == 40
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["prompt_tokens_details"] == {"cached_tokens": 39}, "all but the last prompt token"
    text = api.get("/metrics").text
    assert "cobali:prefix_cache_queries_total 80.0" in text and "cobali:prefix_cache_hits_total 39.0" in text


def test_an_idle_server_saves_its_cached_prefixes_to_host_memory(api: TestClient) -> None:
    request = {"prompt": "a prompt long enough to be worth keeping", "max_tokens": 4, "ignore_eos": True}
    api.post("/v1/completions", json=request)
    deadline = time.monotonic() + 10
    while "cobali:host_cache_bytes 172.0" not in api.get("/metrics").text:  # 43 tokens in KV, 4 bytes each
        assert time.monotonic() < deadline, "the idle engine thread never saved the prompt's KV"
        time.sleep(0.01)


def test_a_token_without_text_still_makes_a_chunk(api: TestClient) -> None:
    """Under ignore_eos an end token has no text; the client still gets a chunk as it comes (as vLLM streams), so
    benchmarks time every token, whichever server bans or samples end tokens."""
    prompt = [1 + (i * 7 + 23) % 90 for i in range(8)]  # its second output token is the fake's end token
    request = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "stream": True, "temperature": 0}
    chunks = sse_payloads(api.post("/v1/completions", json=request).text)
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == ["Q", "", ">", "E", "^"]


def test_streamed_completion_equals_the_whole_one(api: TestClient) -> None:
    request = {"prompt": "stream me", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = api.post("/v1/completions", json=request).json()["choices"][0]["text"]
    response = api.post("/v1/completions", json={**request, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(response.text)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == whole
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_chat_whole_and_streamed(api: TestClient) -> None:
    request = {"messages": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
               "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body = api.post("/v1/chat/completions", json=request).json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == expected_text("<system>be brief\n<user>hi\n<assistant>", 6)
    chunks = sse_payloads(api.post("/v1/chat/completions", json={**request, "stream": True}).text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_the_text(api: TestClient) -> None:
    request = {"prompt": "abc", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = api.post("/v1/completions", json=request).json()["choices"][0]["text"]
    stop = full[5:7]
    choice = api.post("/v1/completions", json={**request, "stop": [stop, "never"]}).json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop"


def test_priority_is_accepted(api: TestClient) -> None:
    reply = api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "priority": -5,
                                               "ignore_eos": True})  # temperature 1 may draw the end token
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def test_n_choices_and_prompt_batches(api: TestClient) -> None:
    body = api.post("/v1/completions", json={"prompt": ["ab", "cde"], "n": 2, "max_tokens": 3,
                                             "ignore_eos": True, "seed": 7}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_logprobs_whole_and_streamed(api: TestClient) -> None:
    request = {"prompt": "probe", "max_tokens": 7, "ignore_eos": True, "logprobs": 3, "temperature": 0}
    body = api.post("/v1/completions", json=request).json()
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == body["usage"]["completion_tokens"] == 7
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(7)]
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                   strict=True):
        assert 1 <= len(top) <= 3 and all(lp <= 0 for lp in top.values())
        assert top[token] == logprob == max(top.values()), "greedy picks the likeliest token"
    chunks = sse_payloads(api.post("/v1/completions", json={**request, "stream": True}).text)
    streamed = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == logprobs["tokens"]


def test_chat_logprobs_have_top_alternatives(api: TestClient) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
               "logprobs": True, "top_logprobs": 2}
    body = api.post("/v1/chat/completions", json=request).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for item in content:
        assert [t["logprob"] for t in item["top_logprobs"]] == sorted((t["logprob"] for t in item["top_logprobs"]),
                                                                     reverse=True)
        assert len(item["top_logprobs"]) == 2 and item["top_logprobs"][0]["logprob"] == item["logprob"]
        assert bytes(item["bytes"]).decode() == item["token"]
    plain = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert plain.json()["choices"][0]["logprobs"] is None


def test_response_format_is_accepted(api: TestClient) -> None:
    schema = {"name": "x", "schema": {"type": "object"}}
    for response_format in ({"type": "json_object"}, {"type": "json_schema", "json_schema": schema}):
        response = api.post("/v1/completions", json={"prompt": "{", "max_tokens": 2,
                                                     "response_format": response_format})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ("{not json", None, "invalid JSON"),
    ("[1, 2]", None, "valid dictionary"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "x", "n": 17}, "n", "less than or equal to 16"),
    ({"prompt": ["a", "b", "c"], "n": 6}, None, "at most 16"),
    ({"prompt": "x" * N_CTX_SEQ}, "prompt", "context holds"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, None, "empty"),
    ({"prompt": [1, "a"]}, "prompt", ""),
    ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "x", "stop": ""}, None, "non-empty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "x", "suffix": "y"}, None, "suffix is not supported"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format", "json_schema is requ"),
    ({"max_tokens": 3}, "prompt", "Field required"),
    ({"prompt": "x", "priority": "high"}, "priority", "valid integer"),
])
def test_bad_completion_bodies_are_400(api: TestClient, body: object, param: str | None,
                                       fragment: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    response = api.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "user"}], "max_completion_tokens": 0},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
    {"messages": "hi"},
])
def test_bad_chat_bodies_are_400(api: TestClient, body: dict) -> None:
    response = api.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


def test_unknown_route_has_an_openai_error(api: TestClient) -> None:
    response = api.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_models_slots_and_metrics(api: TestClient) -> None:
    assert api.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    api.post("/v1/completions", json={"prompt": "four", "max_tokens": 3, "ignore_eos": True})
    slots = api.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s["state"] == "idle" and s["request_id"] is None for s in slots)
    text = api.get("/metrics").text
    assert 'cobali:request_success_total{finished_reason="length"} 1.0' in text
    assert "cobali:prompt_tokens_total 4.0" in text
    assert "cobali:generation_tokens_total 3.0" in text
    assert "cobali:time_to_first_token_seconds_count 1.0" in text
    assert "cobali:inter_token_latency_seconds_count 2.0" in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_preemptions_total", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_sum", "iteration_tokens_bucket", "iteration_requests_count",
                 "tick_duration_seconds_count", "tick_duration_max_seconds"):
        assert f"cobali:{name}" in text
    assert "tick_cost" not in text  # no ITL target: nothing learned


def test_metrics_show_the_learned_tick_costs_under_an_itl_target() -> None:
    with TestClient(fake_app(fake_engine(itl_target_ms=250), "m")) as client:
        wait_healthy(client)
        assert "cobali:tick_cost_confident 0.0" in client.get("/metrics").text
        assert "cobali:tick_cost_error 0.0" in client.get("/metrics").text
        assert "cobali:whole_prompt_stall_share 0.0" in client.get("/metrics").text


def test_api_key_is_required_on_the_api_but_not_on_probes() -> None:
    with TestClient(fake_app(fake_engine(), "m", api_keys=("sekret",))) as client:
        wait_healthy(client)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            response = client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/slots").status_code == 401
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401
        ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                         headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert client.get("/metrics").status_code == 200


def test_health_is_503_while_loading() -> None:
    loaded = threading.Event()
    build = fake_engine()

    def slow_load() -> Engine:
        loaded.wait(10)
        return build()

    with TestClient(fake_app(slow_load, "m")) as client:
        response = client.get("/health")
        assert response.status_code == 503 and "loading" in response.json()["error"]["message"]
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        loaded.set()
        wait_healthy(client)


class CrashingBackend(FakeBackend):
    """A backend failure the engine does not handle: it kills the engine thread."""

    def decode(self, tokens, positions, seq_ids, want_logits):
        raise RuntimeError("the GPU fell off")


def test_an_engine_crash_fails_pending_requests_and_health() -> None:
    with TestClient(fake_app(fake_engine(CrashingBackend(n_seq_max=4, n_batch=64)), "m")) as client:
        wait_healthy(client)
        response = client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "the engine failed; see the server log"  # not its text
        assert client.get("/health").status_code == 503
        streamed = client.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert streamed.status_code == 503
