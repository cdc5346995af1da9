"""Issue 46: a generating route's short body (at most parse.INLINE_BODY_BYTES) that asks for no grammar and few
choices is parsed and prepared on the event loop, with no hop to the worker pool: at hundreds of short streamed
requests a second the hop cost the loop more than the work. Anything heavier still goes to the pool. Checked by
counting the pool's jobs and by where the work runs, not by timing it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cobali.http import generation, parse
from tests.unit.http.test_parse_off_loop import on_loop
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

COMPLETION = {"prompt": "hi", "max_tokens": 2, "stream": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, list[str]]]:
    """A client, and what ran for each request: "job" per pool job, "check on loop" / "check off loop" for the
    body's limit checks (part of its preparation)."""
    seen: list[str] = []
    check = generation.check_request

    def checked(*args: Any) -> None:
        seen.append("check on loop" if on_loop() else "check off loop")
        check(*args)

    monkeypatch.setattr(generation, "check_request", checked)
    with TestClient(fake_app(fake_engine(), "fake-model")) as client:
        wait_healthy(client)
        pool = client.app.state.server.pool
        run = pool.run

        async def counted(who: str, work: Callable[[], Any]) -> Any:
            seen.append("job")
            return await run(who, work)

        monkeypatch.setattr(pool, "run", counted)
        yield client, seen


def _preparing(seen: list[str]) -> list[str]:
    """What ran up to the body's limit checks: its preparation (a chat stream's last read is a job after it)."""
    ends = [i for i, what in enumerate(seen) if what.startswith("check")]
    return seen[:ends[0] + 1] if ends else seen


def _post(client: TestClient, path: str, body: dict) -> str:
    reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.text


def test_a_short_completion_is_prepared_on_the_loop_without_a_job(served) -> None:
    client, seen = served
    assert _post(client, "/v1/completions", COMPLETION).endswith("data: [DONE]\n\n")
    assert _preparing(seen) == ["check on loop"]


def test_a_short_chat_goes_to_the_pool_until_its_template_is_built(served) -> None:
    client, seen = served
    _post(client, "/v1/chat/completions", CHAT)
    assert _preparing(seen) == ["job", "check off loop"]  # the first builds the template, on a worker
    seen.clear()
    assert _post(client, "/v1/chat/completions", CHAT).endswith("data: [DONE]\n\n")
    assert _preparing(seen) == ["check on loop"]


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/completions", {"guided_regex": "(a|b)*a(a|b){12}"}),  # short, and a large automaton
    ("/v1/completions", {"n": generation.INLINE_CHOICES + 1}),
    ("/v1/completions", {"user": "x" * parse.INLINE_BODY_BYTES}),
    ("/v1/chat/completions", {"tools": [TOOL]}),
])
def test_a_heavier_body_is_prepared_on_the_pool(served, path: str, extra: dict) -> None:
    client, seen = served
    base = COMPLETION if path == "/v1/completions" else CHAT
    _post(client, path, base)  # the chat template built; a light body now stays on the loop
    seen.clear()
    client.post(path, json={**base, **extra})  # the fake model's template refuses tools: a 400, from the job
    assert _preparing(seen) == ["job", "check off loop"], extra


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"prompt": "hi", "max_tokens": 0}', b'{"prompt": "hi", "model": "x"}',
                                  b'{"prompt": "hi", "max_tokens": 1000000}'])
def test_a_short_body_is_answered_as_on_the_pool(served, monkeypatch: pytest.MonkeyPatch, body: bytes) -> None:
    """The same answers: the body's 400, the model's 404, a limit's 400."""
    client, seen = served

    def answer() -> tuple[int, str]:
        reply = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        return reply.status_code, reply.text

    on_loop = answer()
    assert on_loop[0] in (400, 404) and "job" not in seen
    monkeypatch.setattr(parse, "INLINE_BODY_BYTES", -1)
    assert answer() == on_loop and "job" in seen


def _largest(body: dict, key: str, one: Any) -> dict:
    """body with `key` grown one item at a time until it is the largest that stays inline (INLINE_BODY_BYTES)."""
    items: list[Any] | dict[str, Any] = {} if isinstance(one, tuple) else []
    while True:
        if isinstance(items, dict):
            grown: list[Any] | dict[str, Any] = {**items, str(len(items)): one[1]}
        else:
            grown = [*items, one]
        if len(json.dumps({**body, key: grown})) > parse.INLINE_BODY_BYTES:
            return {**body, key: items}
        items = grown


def test_the_largest_inline_bodies_are_answered_while_a_stream_runs_beside(served) -> None:
    """The worst that runs on the loop: 2 KiB of empty messages (each rendered and tokenized), of logit_bias
    entries, of stop strings. Each is answered on the loop while a stream opened before them goes on to its end,
    and the server is still up after."""
    client, seen = served
    _post(client, "/v1/chat/completions", CHAT)  # the template, built on a worker
    chat = {"max_tokens": 1}
    worst = [_largest({**chat, "messages": []}, "messages", {"role": "user", "content": ""}),
             _largest({**chat, "messages": CHAT["messages"]}, "logit_bias", ("id", 1)),
             _largest({**chat, "messages": CHAT["messages"]}, "stop", "st")]
    assert len(worst[0]["messages"]) > 40 and len(worst[1]["logit_bias"]) > 100 and len(worst[2]["stop"]) > 1
    with client.stream("POST", "/v1/completions", json={**COMPLETION, "max_tokens": 32}) as stream:
        lines = stream.iter_lines()
        next(lines)
        for body in worst:
            seen.clear()
            reply = client.post("/v1/chat/completions", json=body)
            # On this small fake model each is over a limit (its context, its vocabulary, --max-stop-strings): a
            # 400 that names it, found on the loop, with no job; never a 5xx.
            assert reply.status_code == 400 and "job" not in seen, (reply.text, seen)
            assert any(name in reply.json()["error"]["message"] for name in ("context", "vocabulary", "--max-stop"))
        assert "data: [DONE]" in list(lines)
    assert client.get("/health").status_code == 200
