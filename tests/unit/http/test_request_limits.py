"""Issue 36 §2: every request has a bounded cost, checked before the engine sees it. The operator's limits (each a
400 naming its flag just past it, fine at it), the worker pool that tokenizes and renders off the event loop
(timeouts, one client's share, a full queue refusing first), the flags, and stop strings' per-token cost."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cobali.backends.fake import FakeBackend
from cobali.config.serve_flags import add_run_batch_args, add_serve_args, run_batch_config, server_config
from cobali.engine.detok import TextStream
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.frontend.request_limits import PreprocessLimits, RequestLimits
from cobali.http import parse
from cobali.structured.limits import GrammarLimits
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

LIMITS = RequestLimits(max_choices=3, max_logprobs=4, max_prompt_logprobs=8, max_stop_strings=2,
                       max_stop_string_chars=5, max_tools=2, max_tools_bytes=300, max_logit_bias=3,
                       max_stop_token_ids=2)
GRAMMAR_BYTES = 120
TEMPLATE = "{% for m in messages %}{{ m.content }}\n{% endfor %}"  # takes tools, shows none


def compact(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def sized(prefix: str, suffix: str, size: int) -> str:
    """prefix + padding + suffix, `size` bytes in all."""
    return prefix + "a" * (size - len(prefix) - len(suffix)) + suffix


def schema(size: int) -> dict:
    """A schema whose compact JSON text is `size` bytes."""
    base = {"type": "string", "description": ""}
    return {**base, "description": "d" * (size - compact(base))}


def tool(name: str, size: int | None = None, parameters: dict | None = None) -> dict:
    function: dict = {"name": name, "description": ""}
    if parameters is not None:
        function["parameters"] = parameters
    spec = {"type": "function", "function": function}
    if size is not None:
        function["description"] = "d" * (size - compact(spec))
    return spec


CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
COMPLETION = ("/v1/completions", {"prompt": "hi", "max_tokens": 2})
# (route and base body, the body at the limit, the body just past it, the param named, the flag named)
CASES = {
    "n": (COMPLETION, {"n": 3}, {"n": 4}, "n", "--max-choices"),
    "prompts x n": (COMPLETION, {"prompt": ["a", "b", "c"]}, {"prompt": ["a", "b"], "n": 2}, "n", "--max-choices"),
    "logprobs": (COMPLETION, {"logprobs": 4}, {"logprobs": 5}, "logprobs", "--max-logprobs"),
    "top_logprobs": (CHAT, {"logprobs": True, "top_logprobs": 4}, {"logprobs": True, "top_logprobs": 5},
                     "top_logprobs", "--max-logprobs"),
    "prompt_logprobs k": (COMPLETION, {"prompt_logprobs": 4}, {"prompt_logprobs": 5}, "prompt_logprobs",
                          "--max-logprobs"),
    # 8 prompt tokens x 1 choice = 8 positions; 9 is one past
    "prompt logprob entries": (COMPLETION, {"prompt": "abcdefgh", "prompt_logprobs": 4},
                               {"prompt": "abcdefghi", "prompt_logprobs": 4}, "prompt_logprobs",
                               "--max-prompt-logprobs"),
    "echo's prompt logprobs": (COMPLETION, {"prompt": "abcdefgh", "echo": True, "logprobs": 4},
                               {"prompt": "abcdefghi", "echo": True, "logprobs": 4}, "logprobs",
                               "--max-prompt-logprobs"),
    "stop strings": (COMPLETION, {"stop": ["x", "y"]}, {"stop": ["x", "y", "z"]}, "stop", "--max-stop-strings"),
    "stop length": (COMPLETION, {"stop": "abcde"}, {"stop": ["x", "abcdef"]}, "stop", "--max-stop-string-chars"),
    "logit_bias": (COMPLETION, {"logit_bias": {"1": 1, "2": 1, "3": 1}},
                   {"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}, "logit_bias", "--max-logit-bias"),
    "stop_token_ids": (COMPLETION, {"stop_token_ids": [1, 2]}, {"stop_token_ids": [1, 2, 3]}, "stop_token_ids",
                       "--max-stop-token-ids"),
    "tools": (CHAT, {"tools": [tool("a"), tool("b")]}, {"tools": [tool("a"), tool("b"), tool("c")]}, "tools",
              "--max-tools"),
    "tools' bytes": (CHAT, {"tools": [tool("a", 300)]}, {"tools": [tool("a", 301)]}, "tools", "--max-tools-bytes"),
    "guided_regex": (COMPLETION, {"guided_regex": "a" * GRAMMAR_BYTES}, {"guided_regex": "a" * (GRAMMAR_BYTES + 1)},
                     "guided_regex", "--max-grammar-bytes"),
    "grammar": (COMPLETION, {"grammar": sized('root ::= "', '"', GRAMMAR_BYTES)},
                {"grammar": sized('root ::= "', '"', GRAMMAR_BYTES + 1)}, "grammar", "--max-grammar-bytes"),
    "guided_choice": (COMPLETION, {"guided_choice": ["a" * (GRAMMAR_BYTES - 4)]},
                      {"guided_choice": ["a" * (GRAMMAR_BYTES - 3)]}, "guided_choice", "--max-grammar-bytes"),
    "response_format": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
                            "name": "x", "schema": schema(GRAMMAR_BYTES)}}},
                        {"response_format": {"type": "json_schema", "json_schema": {
                            "name": "x", "schema": schema(GRAMMAR_BYTES + 1)}}},
                        "response_format.json_schema.schema", "--max-grammar-bytes"),
    "structured_outputs.json": (COMPLETION, {"structured_outputs": {"json": json.dumps(schema(GRAMMAR_BYTES),
                                                                                       separators=(",", ":"))}},
                                {"structured_outputs": {"json": schema(GRAMMAR_BYTES + 1)}},
                                "structured_outputs.json", "--max-grammar-bytes"),
    # A forced call's grammar holds every forced tool's parameters: [schema] is 2 bytes more than the schema.
    "forced tools": (CHAT, {"tools": [tool("f", parameters=schema(GRAMMAR_BYTES - 2))], "tool_choice": "required"},
                     {"tools": [tool("f", parameters=schema(GRAMMAR_BYTES - 1))], "tool_choice": "required"},
                     "tools", "--max-grammar-bytes"),
}


@pytest.fixture(scope="module")
def limited() -> Iterator[TestClient]:
    app = fake_app(fake_engine(), "m", chat_template=TEMPLATE, limits=LIMITS,
                     grammar=GrammarLimits(max_bytes=GRAMMAR_BYTES))
    with TestClient(app) as client:
        wait_healthy(client)
        yield client


@pytest.mark.parametrize("case", CASES)
def test_each_limit_is_a_400_naming_its_flag_just_past_it_and_fine_at_it(limited: TestClient, case: str) -> None:
    (route, base), at, past, param, flag = CASES[case]
    fine = limited.post(route, json={**base, **at})
    assert fine.status_code == 200, fine.text
    refused = limited.post(route, json={**base, **past})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert flag in error["message"] and error["param"] == param, error


def test_tokenize_and_responses_hold_the_tools_limits_too(limited: TestClient) -> None:
    tools = [tool("a"), tool("b"), tool("c")]
    messages = [{"role": "user", "content": "hi"}]
    assert limited.post("/tokenize", json={"messages": messages, "tools": tools[:2]}).status_code == 200
    refused = limited.post("/tokenize", json={"messages": messages, "tools": tools}).json()["error"]
    assert "--max-tools" in refused["message"] and refused["param"] == "tools"
    flat = [{"type": "function", "name": t["function"]["name"]} for t in tools]
    refused = limited.post("/v1/responses", json={"input": "hi", "tools": flat}).json()["error"]
    assert "--max-tools" in refused["message"]


# ---- the worker pool -------------------------------------------------------------------------------------------


@dataclass
class SlowBackend(FakeBackend):
    """Tokenizing a text with "slow" in it takes tokenize_s; every decode decode_s. Records what it tokenized."""

    tokenize_s: float = 0.5
    decode_s: float = 0.0
    seen: list[str] = field(default_factory=list)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        self.seen.append(text)
        if "slow" in text:
            time.sleep(self.tokenize_s)
        return super().tokenize(text, add_special)

    def decode(self, tokens, positions, seq_ids, want_logits):  # type: ignore[no-untyped-def]
        time.sleep(self.decode_s)
        return super().decode(tokens, positions, seq_ids, want_logits)


def pooled_app(backend: SlowBackend, slots: int = 4, **create) -> FastAPI:
    return fake_app(lambda: Engine(backend, EngineConfig(max_slots=slots, n_batch=64)), "m", **create)


@contextlib.asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[None]:
    """The app's lifespan in this event loop: its handlers run here, so blocking one blocks the test too."""
    async with app.router.lifespan_context(app):
        async with client_at(app, "10.0.0.99") as probe:
            deadline = time.monotonic() + 10
            while (await probe.get("/health")).status_code != 200:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
        yield


def client_at(app: FastAPI, host: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(host, 1234)), base_url="http://t")


SLOW = {"prompt": "slow", "max_tokens": 1}


def test_tokenizing_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse, "INLINE_BODY_BYTES", -1)  # a short body on the pool too, as a long one is
    app = pooled_app(SlowBackend())

    async def main() -> None:
        async with served(app), client_at(app, "10.0.0.1") as client:
            slow = asyncio.create_task(client.post("/v1/completions", json=SLOW))
            start = time.perf_counter()
            await asyncio.sleep(0.05)  # the slow request is being tokenized meanwhile
            assert (await client.get("/health")).status_code == 200
            assert time.perf_counter() - start < 0.25, "the event loop waited for the tokenizer"
            assert (await slow).status_code == 200

    asyncio.run(main())


def test_work_over_the_timeout_is_a_400_and_work_that_never_starts_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse, "INLINE_BODY_BYTES", -1)  # a short body on the pool too, as a long one is
    app = pooled_app(SlowBackend(), preprocess=PreprocessLimits(workers=1, timeout_s=0.2))

    async def main() -> None:
        async with served(app), client_at(app, "10.0.0.1") as one, client_at(app, "10.0.0.2") as other:
            slow = asyncio.create_task(one.post("/v1/completions", json=SLOW))
            await asyncio.sleep(0.02)  # the slow one holds the only worker past the other's start-by time
            queued = await other.post("/v1/completions", json={"prompt": "quick", "max_tokens": 1})
            late = await slow
            assert late.status_code == 400 and "--preprocess-timeout" in late.json()["error"]["message"], late.text
            assert queued.status_code == 503 and "--preprocess-timeout" in queued.json()["error"]["message"]
            await asyncio.sleep(0.4)  # the slow job ends; the worker is free again
            assert (await other.post("/v1/completions", json={"prompt": "quick", "max_tokens": 1})).status_code == 200

    asyncio.run(main())


def test_one_client_filling_its_share_gets_429_while_another_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse, "INLINE_BODY_BYTES", -1)  # a short body on the pool too, as a long one is
    app = pooled_app(SlowBackend(), preprocess=PreprocessLimits(workers=2, timeout_s=5, client_queue=2))

    async def main() -> None:
        async with served(app), client_at(app, "10.0.0.1") as greedy, client_at(app, "10.0.0.2") as polite:
            floods = [asyncio.create_task(greedy.post("/v1/completions", json=SLOW)) for _ in range(3)]
            await asyncio.sleep(0.05)
            start = time.perf_counter()
            served_too = await polite.post("/v1/completions", json={"prompt": "quick", "max_tokens": 1})
            assert served_too.status_code == 200
            assert time.perf_counter() - start < 0.3, "the other client waited for the first one's work"
            replies = await asyncio.gather(*floods)
            assert sorted(r.status_code for r in replies) == [200, 200, 429]
            refused = next(r for r in replies if r.status_code == 429).json()["error"]
            assert "--preprocess-client-queue" in refused["message"]

    asyncio.run(main())


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_full_queue_refuses_before_any_tokenizing(route: str) -> None:
    backend = SlowBackend(n_seq_max=1, n_ctx_seq=256, n_batch=64, decode_s=0.005)
    app = pooled_app(backend, slots=1, max_queue=0)
    body = {"prompt": "never tokenized"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "never tokenized"}]}

    async def main() -> None:
        async with served(app), client_at(app, "10.0.0.1") as client:
            running = asyncio.create_task(client.post("/v1/completions", json={"prompt": "go", "max_tokens": 60,
                                                                               "ignore_eos": True}))
            deadline = time.monotonic() + 5
            while not any(s["is_processing"] for s in (await client.get("/slots")).json()):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            refused = await client.post(route, json=body)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full", refused.text
            assert not any("never tokenized" in text for text in backend.seen)
            assert (await running).status_code == 200

    asyncio.run(main())


def test_the_flags_set_the_limits() -> None:
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    config = server_config(serve.parse_args(["--max-choices", "4", "--max-logprobs", "50", "--max-grammar-bytes",
                                             "1000", "--grammar-step-fuel", "7", "--preprocess-workers", "3",
                                             "--preprocess-timeout", "2.5"]))
    assert config.limits == RequestLimits(max_choices=4, max_logprobs=50)
    assert config.grammar == GrammarLimits(max_bytes=1000, step_lexer_fuel=7)
    assert config.preprocess == PreprocessLimits(workers=3, timeout_s=2.5)
    batch = argparse.ArgumentParser()
    add_run_batch_args(batch)
    config = run_batch_config(batch.parse_args(["-i", "in", "-o", "out", "--max-stop-strings", "32"]))
    assert config.limits.max_stop_strings == 32 and config.preprocess.client_queue is None  # one client, bounded


def test_a_raised_logprobs_limit_lets_more_through() -> None:
    app = fake_app(fake_engine(), "m", limits=RequestLimits(max_logprobs=30))
    with TestClient(app) as client:
        wait_healthy(client)
        reply = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 30})
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 30
        assert client.post("/v1/completions", json={"prompt": "hi", "logprobs": 31}).status_code == 400


def test_a_tokens_stop_string_check_does_not_grow_with_the_text() -> None:
    """The engine's Python API never takes text before the end: each token's check must still look only at its
    own text and the longest stop string's reach, not at everything written so far (counted, not timed)."""
    stops = ("</answer>", "STOP" * 50)
    stream = TextStream(stops)
    searched: list[int] = []
    first_stop = stream._first_stop

    def counted(window: str, new_from: int):
        searched.append(len(window))
        return first_stop(window, new_from)

    stream._first_stop = counted  # type: ignore[method-assign]
    for n in range(1, 5001):
        assert not stream.push(b"word ", decoded=n)
    assert len(stream.text) == 5 * 5000
    assert max(searched) <= max(map(len, stops)) - 1 + len("word "), max(searched)
