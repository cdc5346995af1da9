"""The small parts of the API's contract (issue 36 §4): text UTF-8 cannot carry is a 400 before any work, the docs
follow the API key, a failed engine is reported without its internals, a LoRA load does not tell which files
exist, `priority` has a range, and `cache_salt` keeps tenants' prefix caches apart (in the slots and in host memory).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import SALT_KEYS, Request
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.client import ENGINE_FAILED
from cobali.frontend.offline import LLM
from cobali.http.protocol.bodies import unencodable_text
from cobali.http.run_batch import BatchLine, read_batch
from tests.unit.engine.test_host_kv import make_engine, prompt
from tests.unit.http.test_run_batch import run as run_lines
from tests.unit.http.test_run_batch import write as write_lines
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

LONE = "\ud800"  # a lone high surrogate: JSON's "\ud800" parses to it, UTF-8 cannot encode it
CHAT = [{"role": "user", "content": "hi"}]
KEY = "sesame"


def lora_engine() -> Engine:
    return Engine(FakeBackend(n_seq_max=4, n_ctx_seq=256, n_batch=64),
                  EngineConfig(max_slots=4, n_batch=64, lora_updates=True))


@pytest.fixture
def api() -> Iterator[TestClient]:
    with TestClient(fake_app(lora_engine, "base", runtime_lora=True)) as client:
        wait_healthy(client)
        yield client


def post_json(client: TestClient, path: str, body: dict) -> dict:
    """Sends `body` as JSON text with \\u escapes (how a client sends a lone surrogate); the reply, parsed."""
    response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    return {"status": response.status_code, **response.json()}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": LONE, "prompt": "hi"}, "model"),
    ("/v1/completions", {"prompt": "hi" + LONE, "echo": True, "max_tokens": 64, "ignore_eos": True}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", LONE]}, "prompt.1"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\udfff"]}, "stop.0"),
    ("/v1/completions", {"prompt": "hi", "user": "a" + LONE + "b"}, "user"),
    ("/v1/completions", {"prompt": "hi", LONE: 1}, None),  # an unknown field's name
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {LONE: {}}}}}},
     "response_format.json_schema.schema.properties"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": LONE}}, "structured_outputs.regex"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "description": LONE}}]}, "tools.0.function.description"),
    ("/v1/responses", {"input": LONE}, "input"),
    ("/v1/embeddings", {"input": ["ok", LONE]}, "input.1"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": LONE}, "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_name": LONE}, "lora_name"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_its_field_before_any_work(
        api: TestClient, monkeypatch: pytest.MonkeyPatch, path: str, body: dict, param: str | None) -> None:
    thread = api.app.state.server.client
    work: list[str] = []
    monkeypatch.setattr(thread, "submit", lambda *a, **k: work.append("submit"))
    monkeypatch.setattr(thread, "_call", lambda *a, **k: work.append("call"))
    reply = post_json(api, path, body)
    assert reply["status"] == 400 and reply["error"]["param"] == param, reply
    assert "lone surrogate" in reply["error"]["message"] and not work


def test_a_surrogate_pair_is_text_like_any_other(api: TestClient) -> None:
    reply = post_json(api, "/v1/chat/completions", {"messages": [{"role": "user", "content": "\U0001f600"}],
                                                    "max_tokens": 2})
    assert reply["status"] == 200
    assert unencodable_text({"a": [1, {"b": ["ok", "\U0001f600"]}]}) is None
    assert unencodable_text({"a": [1, {"b": ["ok", LONE]}]}) == ("a.1.b.1", False)


def test_a_batch_line_with_a_lone_surrogate_is_its_400_or_refused_before_the_batch_runs(tmp_path: Path) -> None:
    records = run_lines([BatchLine("bad", "/v1/completions", {"prompt": LONE}),
                         BatchLine("good", "/v1/completions", {"prompt": "x", "max_tokens": 2})])
    assert records["bad"]["response"]["status_code"] == 400 and records["good"]["response"]["status_code"] == 200
    assert records["bad"]["response"]["body"]["error"]["param"] == "prompt"
    line = {"custom_id": LONE, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    with pytest.raises(ValueError, match="line 1: custom_id must be valid Unicode"):
        read_batch(write_lines(tmp_path / "in.jsonl", [line]))


@pytest.mark.parametrize("api_key", [None, KEY])
def test_the_docs_need_the_api_key_when_there_is_one(api_key: str | None) -> None:
    with TestClient(fake_app(fake_engine(), "m", api_keys=(api_key,) if api_key else ())) as client:
        wait_healthy(client)  # /health stays open
        for path in ("/docs", "/redoc", "/openapi.json"):
            bare, wrong = client.get(path), client.get(path, headers={"Authorization": "Bearer nope"})
            keyed = client.get(path, headers={"Authorization": f"Bearer {KEY}"})
            assert keyed.status_code == 200, path
            assert (bare.status_code, wrong.status_code) == ((200, 200) if api_key is None else (401, 401)), path
        schema = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert "/v1/completions" in schema["paths"] and "/docs" not in schema["paths"]


def test_a_failed_engine_is_reported_without_its_internals(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Engine:
        raise RuntimeError("cannot open /srv/secret/model.gguf: bad magic")

    with caplog.at_level(logging.ERROR, "cobali.http"), TestClient(fake_app(broken, "m")) as client:
        deadline = time.monotonic() + 10
        while "loading" in client.get("/health").text:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        replies = [client.get("/health"), client.get("/slots"), client.post("/v1/completions", json={"prompt": "x"}),
                   client.post("/v1/chat/completions", json={"messages": CHAT}),
                   client.post("/tokenize", json={"prompt": "x"}), client.post("/v1/embeddings", json={"input": "x"})]
        for reply in replies:
            assert reply.status_code == 503 and reply.json()["error"]["message"] == ENGINE_FAILED, reply.text
    assert "/srv/secret/model.gguf: bad magic" in caplog.text, "the log keeps the detail"


def test_a_lora_load_says_the_same_whether_the_path_exists_or_not(api: TestClient,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    for path in ("/no/such/adapter.gguf", "README.md", "tests"):  # missing, not an adapter, a directory
        reply = post_json(api, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert reply == {"status": 400, "error": {
            "message": f"Loading lora x failed: {path} is not a LoRA adapter this server can load",
            "type": "invalid_request_error", "param": "lora_path", "code": None}}
    assert "No adapter found for /no/such/adapter.gguf" in caplog.text, "the log says which"
    assert api.app.state.server.loras.names() == ()


@pytest.mark.parametrize("priority, status", [(1000, 200), (-1000, 200), (1001, 400), (-1001, 400), (2**31, 400)])
def test_priority_is_bounded(api: TestClient, priority: int, status: int) -> None:
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        reply = post_json(api, path, {**body, "max_tokens": 1, "priority": priority})
        assert reply["status"] == status, reply
        assert status == 200 or reply["error"]["param"] == "priority"


@pytest.mark.parametrize("salt", ["", "x" * 257, 5])
def test_a_cache_salt_is_a_short_nonempty_string(api: TestClient, salt: object) -> None:
    reply = post_json(api, "/v1/completions", {"prompt": "x", "cache_salt": salt})
    assert reply["status"] == 400 and reply["error"]["param"] == "cache_salt", reply


def test_cached_tokens_come_only_from_requests_with_the_same_salt(api: TestClient) -> None:
    def cached(salt: str | None, path: str = "/v1/completions") -> int:
        body = {"prompt": "a prompt long enough to be worth keeping"} if path == "/v1/completions" else {
            "messages": [{"role": "user", "content": "a message long enough to be worth keeping"}]}
        reply = post_json(api, path, {**body, "max_tokens": 2, "ignore_eos": True,
                                      **({} if salt is None else {"cache_salt": salt})})
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached("tenant-a"), cached("tenant-b"), cached(None), cached("x" * 256)] == [0, 0, 0, 0]
    assert cached("tenant-a") == cached("tenant-b") == cached(None) == 39 and cached("x" * 256) == 39
    assert [cached("tenant-a", "/v1/chat/completions"), cached("tenant-b", "/v1/chat/completions")] == [0, 0]
    assert cached("tenant-a", "/v1/chat/completions") > 0


def salted(salt: str | None, max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)


def test_salted_keys_never_equal_unsalted_or_other_salts_keys() -> None:
    tokens = list(range(40))
    keys = {salt: Request(0, tokens, salted(salt)).kv_key(40) for salt in (None, "a", "b")}
    assert keys[None] == tokens
    for salt in ("a", "b"):
        assert keys[salt][SALT_KEYS:] == tokens[SALT_KEYS:] and all(k >= 2**32 for k in keys[salt][:SALT_KEYS])
    assert all(a != b for a, b in zip(keys["a"][:SALT_KEYS], keys["b"][:SALT_KEYS], strict=True))
    lora = Request(0, tokens, salted("a"), lora=3).kv_key(40)
    assert lora[:SALT_KEYS] != keys["a"][:SALT_KEYS] and all(k < 2**63 for k in lora)


def test_a_salt_shares_cached_slots_only_with_itself() -> None:
    engine = make_engine(slots=4, host_mib=0)
    p = prompt(30, 1)
    sent = [LLM(engine).generate([p], salted(s))[0].cached_tokens for s in ("a", "b", None, "a", "b", None)]
    assert sent == [0, 0, 0, 29, 29, 29]


def test_a_salt_shares_no_running_request_s_kv() -> None:
    for second, expected in (("b", 0), ("a", 29)):
        engine = make_engine(slots=2, host_mib=0)
        p = prompt(30, 2)
        first = engine.add_request(p, salted("a", max_tokens=20))
        engine.step()
        engine.step()  # prefilled and decoding: its KV is a source for a request admitted now
        assert first.computed_tokens >= 30 and not first.is_finished
        later = engine.add_request(p, salted(second))
        list(LLM(engine).run())
        assert later.cached_tokens == expected, second


def test_a_salt_restores_no_other_salt_s_prefix_from_host_memory() -> None:
    engine = make_engine(slots=2)
    prompts = [prompt(30, s) for s in range(3)]
    for p in prompts:
        LLM(engine).generate([p], salted("a"))
    assert len(engine._slots.host) >= 1, "the first prompt's KV went to host memory"
    assert LLM(engine).generate([prompts[0]], salted("b"))[0].cached_tokens == 0
    assert LLM(engine).generate([prompts[0]], salted(None))[0].cached_tokens == 0
    assert LLM(engine).generate([prompts[0]], salted("a"))[0].cached_tokens == 29
    assert engine._slots.host.hit_tokens == 29
