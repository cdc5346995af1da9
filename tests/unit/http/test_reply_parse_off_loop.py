"""Issue 44: a finished reply is read by its parsers on the worker pool, never on the event loop: the whole
reply (once per choice: n of them) for /v1/chat/completions, /v1/responses and /v1/messages, and a stream's last
read with the parsers' finish(). The stream's other feeds stay on the loop (each O(its text)). Checked by where
the work runs (a thread with no running event loop), not by timing it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from cobali.frontend.parsers.reply import ReplyParsers, ReplyStream
from cobali.http import generation
from tests.unit.http.test_parse_off_loop import _recording
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

MESSAGES = [{"role": "user", "content": "hi"}]
CHOICES = 2  # chat's n: each choice's reply is parsed
REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 4, "n": CHOICES},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"messages": MESSAGES, "max_tokens": 4},
}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, list[tuple[str, bool]]]]:
    """A client, and (what ran, whether on an event loop's thread) for each whole reply's parse and each finish."""
    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(ReplyParsers, "parse", _recording(calls, "parse", ReplyParsers.parse))
    monkeypatch.setattr(ReplyStream, "finish", _recording(calls, "finish", ReplyStream.finish))
    with TestClient(fake_app(fake_engine(), "fake-model")) as client:
        wait_healthy(client)
        yield client, calls


@pytest.mark.parametrize("path", list(REQUESTS))
def test_a_whole_reply_is_parsed_off_the_event_loop(recorded, path: str) -> None:
    client, calls = recorded
    reply = client.post(path, json=REQUESTS[path])
    assert reply.status_code == 200, reply.text
    assert [name for name, _ in calls].count("parse") == int(REQUESTS[path].get("n", 1)), calls  # each choice's reply
    assert not any(on_loop for _, on_loop in calls), calls


@pytest.mark.parametrize("path", list(REQUESTS))
def test_a_streams_finish_runs_off_the_event_loop(recorded, path: str) -> None:
    client, calls = recorded
    with client.stream("POST", path, json={**REQUESTS[path], "stream": True}) as reply:
        assert reply.status_code == 200
        reply.read()
    assert calls == [("finish", False)] * int(REQUESTS[path].get("n", 1)), calls


def test_a_parse_on_the_loop_is_caught(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the reply read without the pool. The checks above must see it."""
    client, calls = recorded

    async def inline(_http: Request, work: Callable[[], Any]) -> Any:
        return work()

    monkeypatch.setattr(generation, "read_off_loop", inline)
    assert client.post("/v1/chat/completions", json=REQUESTS["/v1/chat/completions"]).status_code == 200
    assert ("parse", True) in calls
    assert threading.current_thread() is threading.main_thread()  # the client's, not the app's loop: no false pass
