"""The Ray Serve face without Ray: the gateway app over in-process replicas (the single server's app on the
fake backend, called through the same ASGI bridge a Ray replica uses), the bridge, the merge of /metrics,
the router, and the --replicas flags."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Receive, Scope, Send

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.faces import cli
from cobali.frontend.client import EngineState
from cobali.http.config import ServerConfig
from cobali.http.prometheus import ServerMetrics, merge_expositions
from cobali.ray.asgi import HTTPRequest, call_app
from cobali.ray.gateway import LeastBusy, gateway_app
from tests.unit.http.test_server_api import fake_app
from tests.unit.http.test_server_live import LONG, SlowBackend

STREAMED = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}


class InProcess:
    """An engine client calling the replica's app directly, as EngineReplica.handle does inside Ray."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def messages(self, request: HTTPRequest) -> AsyncIterator[Message]:
        return call_app(self.app, request)


def replica_app(api_key: str | None = None) -> FastAPI:
    def engine() -> Engine:
        return Engine(FakeBackend(n_seq_max=4, n_ctx_seq=256, n_batch=64), EngineConfig(max_slots=4, n_batch=64))

    return fake_app(engine, "fake-model", api_keys=(api_key,) if api_key else ())


async def with_gateway(test: Callable[[httpx.AsyncClient], Awaitable[None]], n: int = 2,
                       api_key: str | None = None) -> None:
    """Run `test(client)` against a gateway over n loaded replicas."""
    apps = [replica_app(api_key) for _ in range(n)]
    async with AsyncExitStack() as stack:
        for app in apps:
            await stack.enter_async_context(app.router.lifespan_context(app))
        gateway = gateway_app([InProcess(app) for app in apps],
                              ServerConfig(max_body_bytes=1 << 16, api_keys=(api_key,) if api_key else ()))
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gateway"))
        while (await client.get("/health")).status_code != 200:  # the fake models load in milliseconds
            await asyncio.sleep(0.01)
        await test(client)


def served_per_replica(metrics_text: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "cobali:request_success_total":
                counts[sample.labels["replica"]] = counts.get(sample.labels["replica"], 0) + sample.value
    return counts


def test_streams_spread_over_both_replicas_and_metrics_say_so() -> None:
    async def test(client: httpx.AsyncClient) -> None:
        replies = await asyncio.gather(*(client.post("/v1/completions", json=STREAMED) for _ in range(8)))
        for reply in replies:
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
            events = [e.removeprefix("data: ") for e in reply.text.split("\n\n") if e]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        counts = served_per_replica((await client.get("/metrics")).text)
        assert sum(counts.values()) == 8 and set(counts) == {"0", "1"}

    asyncio.run(with_gateway(test))


def test_health_slots_models_and_bad_input_come_from_the_replicas() -> None:
    async def test(client: httpx.AsyncClient) -> None:
        health = (await client.get("/health")).json()
        assert health == {"status": "ok", "replicas": {"0": "ok", "1": "ok"}}
        assert (await client.get("/slots")).status_code == 401  # the replicas' own auth
        slots = (await client.get("/slots", headers={"Authorization": "Bearer k"})).json()
        assert sorted({row["replica"] for row in slots}) == ["0", "1"] and len(slots) == 8
        auth = {"Authorization": "Bearer k"}
        assert (await client.get("/v1/models", headers=auth)).json()["data"][0]["id"] == "fake-model"
        unknown = await client.post("/v1/completions", headers=auth, json={**STREAMED, "model": "other"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        bad = await client.post("/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400
        huge = await client.post("/v1/completions", headers=auth, content=b"x" * (1 << 17))
        assert huge.status_code == 413  # refused by the gateway before it travels

    asyncio.run(with_gateway(test, api_key="k"))


def test_closing_the_bridge_early_ends_the_app_and_runs_its_clean_up() -> None:
    seen: list[str] = []

    async def endless(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()  # the body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        try:
            await asyncio.Event().wait()  # a handler waiting for its next token
        finally:
            seen.append("cleaned up")  # where the server aborts the generation and frees the slot

    async def run() -> None:
        messages = call_app(endless, HTTPRequest("POST", "/", b"", [], b"{}"))
        assert (await anext(messages))["status"] == 200
        assert (await anext(messages))["body"] == b"first"
        await messages.aclose()

    asyncio.run(run())
    assert seen == ["cleaned up"]


def test_a_client_leaving_mid_stream_frees_the_replica_slot() -> None:
    app = fake_app(lambda: Engine(SlowBackend(n_seq_max=2, n_ctx_seq=4096, n_batch=64),
                                    EngineConfig(max_slots=2, n_batch=64)), "slow")
    thread = app.state.server.client
    request = HTTPRequest("POST", "/v1/completions", b"", [(b"content-type", b"application/json")],
                          json.dumps(LONG).encode())

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(1000):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def run() -> None:
        async with app.router.lifespan_context(app):
            await until(lambda: thread.state is EngineState.READY)
            messages = call_app(app, request)
            assert (await anext(messages))["status"] == 200
            assert (await anext(messages))["body"].startswith(b"data: ")  # a token: the request holds a slot
            assert len(thread.transport.engine._scheduler.running) == 1
            await messages.aclose()  # what a cancelled Ray stream does
            await until(lambda: not thread.transport.engine._scheduler.running)

    asyncio.run(run())


def test_merged_metrics_label_each_replica_and_keep_one_family_header() -> None:
    first, second = ServerMetrics(), ServerMetrics()
    first.request_success.labels("length").inc(3)
    second.request_success.labels("stop").inc(2)
    merged = merge_expositions({"a": first.render().decode(), "b": second.render().decode()}).decode()
    assert merged.count("# TYPE cobali:request_success_total counter") == 1
    assert served_per_replica(merged) == {"a": 3, "b": 2}


def test_least_busy_picks_the_replica_with_fewer_requests_in_flight() -> None:
    router = LeastBusy(2, random.Random(0))
    router.in_flight[:] = [3, 1]
    assert {router.pick() for _ in range(20)} == {1}
    assert LeastBusy(1).pick() == 0


@pytest.mark.parametrize(("argv", "fragment"), [
    (["serve", "--replicas", "0"], "--replicas: expected a positive integer, got 0"),
    (["serve", "--ray-address", "auto"], "--ray-address needs --replicas > 1"),
])
def test_replica_flags_are_validated(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err
