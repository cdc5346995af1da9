"""Issue 36: a request body (up to --max-body-bytes of JSON) is parsed and validated on the worker pool, never on
the event loop, for every POST route the server documents; so are the route's O(body) limit checks. Checked by
where the work runs (a thread with no running event loop), not by timing it. Short light bodies are the exception
(issue 46, test_inline_prepare.py): here every body counts as one over the bound."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from cobali.frontend import request_limits
from cobali.http import generation, parse
from cobali.http.routes import as_chat
from cobali.http.routes import tokenize as tokenizer_routes
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"input": "hi"},
    "/tokenize": {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/no/such/adapter.gguf"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}


def on_loop() -> bool:
    """Whether the caller runs on an event loop's thread (a route's handler), not a worker's."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _recording(calls: list[tuple[str, bool]], name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append((name, on_loop()))
        return real(*args, **kwargs)

    return record


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, list[tuple[str, bool]]]]:
    """A client, and (what ran, whether on an event loop's thread) for the body's parse and the limit checks."""
    calls: list[tuple[str, bool]] = []
    # Every body here as one over parse.INLINE_BODY_BYTES (short light ones stay on the loop)
    monkeypatch.setattr(parse, "INLINE_BODY_BYTES", -1)
    monkeypatch.setattr(parse, "validated", _recording(calls, "parse", parse.validated))
    monkeypatch.setattr(generation, "check_request", _recording(calls, "check_request", generation.check_request))
    monkeypatch.setattr(tokenizer_routes, "check_tools", _recording(calls, "check_tools", request_limits.check_tools))
    with TestClient(fake_app(fake_engine(), "fake-model", runtime_lora=True)) as client:
        wait_healthy(client)
        yield client, calls


def _post_routes(client: TestClient) -> dict[str, dict]:
    spec = client.get("/openapi.json").json()
    return {path: item["post"] for path, item in spec["paths"].items() if "post" in item}


def test_every_post_route_parses_its_body_off_the_event_loop(recorded) -> None:
    client, calls = recorded
    routes = _post_routes(client)
    assert set(routes) == set(BODIES), "a POST route without a body here: add one"
    for path in routes:
        calls.clear()
        reply = client.post(path, json=BODIES[path])
        assert reply.status_code < 500, (path, reply.text)
        assert ("parse", False) in calls, (path, calls)
        assert ("parse", True) not in calls, f"{path} parsed its body on the event loop"
        schema = routes[path]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["$ref"].removeprefix("#/components/schemas/") in client.get("/openapi.json").json()[
            "components"]["schemas"], f"{path}'s body is not described in /openapi.json"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                                  "/tokenize"])
def test_the_limit_checks_that_measure_the_body_run_off_the_event_loop(recorded, path: str) -> None:
    client, calls = recorded
    assert client.post(path, json=BODIES[path]).status_code < 500  # the fake's template may refuse the tools
    checks = [on_loop for name, on_loop in calls if name != "parse"]
    assert checks and not any(checks), (path, calls)


def test_a_body_parsed_on_the_loop_is_caught(recorded, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: parse_then without the pool. The check above must see it."""
    client, calls = recorded

    async def inline(http, model, then, _light=None):  # type: ignore[no-untyped-def]
        return parse._parsed(model, await http.body(), http.headers.get("content-type"), then)

    monkeypatch.setattr(parse, "parse_then", inline)
    monkeypatch.setattr(generation, "parse_then", inline)  # the generating routes' one job: parse, then prepare
    assert client.post("/v1/completions", json=BODIES["/v1/completions"]).status_code == 200
    assert ("parse", True) in calls
    assert threading.current_thread() is threading.main_thread()  # the client's, not the app's loop: no false pass


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                                  "/v1/messages/count_tokens"])
def test_a_generating_route_parses_and_prepares_in_one_job(recorded, monkeypatch: pytest.MonkeyPatch,
                                                           path: str) -> None:
    """Issue 46: a hop to the worker pool costs the loop more than parsing a short body; the body's parse, its
    limits and its prompt's preparation share one job before the request is submitted (a reply read by parsers
    finishes on the pool after)."""
    client, _ = recorded
    pool = client.app.state.server.pool  # type: ignore[attr-defined]
    jobs: list[object] = []
    before_submit: list[int] = []
    run, submit = pool.run, generation.submit

    async def counted(who: str, work: Callable[[], Any]) -> Any:
        jobs.append(work)
        return await run(who, work)

    def submitted(*args: Any) -> Any:
        before_submit.append(len(jobs))
        return submit(*args)

    monkeypatch.setattr(pool, "run", counted)
    for module in (generation, as_chat):
        monkeypatch.setattr(module, "submit", submitted)
    counting = path == "/v1/messages/count_tokens"
    assert client.post(path, json=BODIES[path] if counting else {**BODIES[path], "stream": True}).status_code == 200
    assert (len(jobs) if counting else before_submit) == (1 if counting else [1]), (path, jobs, before_submit)
