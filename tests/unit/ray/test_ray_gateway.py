"""The Ray Serve face without Ray: the ingress app over in-process replicas (the single server's app on the
fake backend, called through the same ASGI bridge a Ray replica uses) routed by the router's policy, the bridge,
the merge of /metrics, and the replica and router flags."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Receive, Scope, Send

from cobali.backends.fake import FakeBackend
from cobali.config.serve_flags import add_serve_args, server_config
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.faces import cli
from cobali.frontend.client import EngineState
from cobali.http.config import ServerConfig
from cobali.http.prometheus import ServerMetrics, merge_expositions
from cobali.ray.asgi import REPLICA_MESSAGE, HTTPRequest, call_app
from cobali.ray.gateway import gateway_app
from cobali.ray.hints import Hinter
from cobali.ray.policy import Policy, PolicyConfig, RoutingHint
from tests.unit.http.test_server_api import fake_app
from tests.unit.http.test_server_live import LONG, SlowBackend

STREAMED = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}


class LocalReplicas:
    """The engine deployment as the ingress sees it, without Ray: replicas' apps by id, each call routed by the
    router's policy as cobali.ray.router does (ranked, then told routed and completed) and called through the
    ASGI bridge, as EngineReplica.handle does inside Ray."""

    def __init__(self, apps: dict[str, FastAPI], policy: Policy | None = None) -> None:
        self.apps = apps
        self.router = policy or Policy(PolicyConfig("least-busy"), seed=0)
        self.picked: list[str] = []  # where each unpinned call went
        self._calls = itertools.count()

    def ids(self) -> Sequence[str]:
        return list(self.apps)

    def policy(self) -> Policy:
        return self.router

    async def messages(self, request: HTTPRequest, hint: RoutingHint) -> AsyncIterator[Message]:
        ranks = self.router.rank(hint, self.ids())
        assert ranks, "a pinned call to a listed replica"
        replica, call = ranks[0][0], str(next(self._calls))
        if hint.replica is None:
            self.picked.append(replica)
        self.router.routed(call, replica, hint)
        try:
            yield {"type": REPLICA_MESSAGE, "replica": replica}
            async for message in call_app(self.apps[replica], request):
                yield message
        finally:
            self.router.completed(call)


def replica_app(api_key: str | None = None) -> FastAPI:
    def engine() -> Engine:
        return Engine(FakeBackend(n_seq_max=4, n_ctx_seq=256, n_batch=64), EngineConfig(max_slots=4, n_batch=64))

    return fake_app(engine, "fake-model", api_keys=(api_key,) if api_key else ())


async def with_gateway(test: Callable[[httpx.AsyncClient], Awaitable[None]], n: int = 2,
                       api_key: str | None = None) -> None:
    """Run `test(client)` against an ingress over n loaded replicas, "r0", "r1", ..."""
    apps = {f"r{i}": replica_app(api_key) for i in range(n)}
    async with AsyncExitStack() as stack:
        for app in apps.values():
            await stack.enter_async_context(app.router.lifespan_context(app))
        config = ServerConfig(max_body_bytes=1 << 16, api_keys=(api_key,) if api_key else ())
        gateway = gateway_app(LocalReplicas(apps), config, no_hints)
        await stack.enter_async_context(gateway.router.lifespan_context(gateway))
        client = await stack.enter_async_context(
            httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gateway"))
        while (await client.get("/health")).status_code != 200:  # the fake models load in milliseconds
            await asyncio.sleep(0.01)
        await test(client)


def no_hints() -> Hinter | None:
    return None


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
        metrics = (await client.get("/metrics")).text
        counts = served_per_replica(metrics)
        assert sum(counts.values()) == 8 and set(counts) == {"r0", "r1"}
        assert "cobali:router_requests_total{how=\"load\"} 8.0" in metrics  # the router's own count

    asyncio.run(with_gateway(test))


def test_health_slots_models_and_bad_input_come_from_the_replicas() -> None:
    async def test(client: httpx.AsyncClient) -> None:
        health = (await client.get("/health")).json()
        assert health == {"status": "ok", "replicas": {"r0": "ok", "r1": "ok"}}
        assert (await client.get("/slots")).status_code == 401  # the replicas' own auth
        slots = (await client.get("/slots", headers={"Authorization": "Bearer k"})).json()
        assert sorted({row["replica"] for row in slots}) == ["r0", "r1"] and len(slots) == 8
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


@pytest.mark.parametrize(("argv", "fragment"), [
    (["serve", "--replicas", "0"], "--replicas: expected a positive integer, got 0"),
    (["serve", "--ray-address", "auto"], "--ray-address needs --replicas > 1"),
    (["serve", "--min-replicas", "1"], "--min-replicas needs --max-replicas"),
    (["serve", "--max-replicas", "2", "--target-ongoing-requests", "0"], "--target-ongoing-requests: expected a"),
    (["serve", "--replicas", "2", "--max-replicas", "3"], "--replicas fixes the number of replicas"),
    (["serve", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is more than --max-replicas 2"),
    (["serve", "--router", "text"], "--router routes among replicas: it needs --replicas > 1"),
    (["serve", "--replicas", "2", "--router", "nearest"], "--router: invalid choice"),
    (["serve", "--replicas", "2", "--router-weights", "3,2"], "--router-weights: expected PREFIX,QUEUE,KV"),
    (["serve", "--replicas", "2", "--router-balance", "8,0.5"], "--router-balance: expected ABS,REL"),
    (["serve", "--replicas", "2", "--router", "least-busy", "--router-weights", "3,2,2"],
     "--router-weights tunes the kv router: not with --router least-busy"),
])
def test_replica_flags_are_validated(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_router_flags_make_the_router_s_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--min-replicas", "0", "--max-replicas", "4", "--target-ongoing-requests", "3",
                              "--router-weights", "3,1,0.5", "--router-balance", "16,2", "--routing-stats-period",
                              "0.25"])
    settings = server_config(args)
    assert settings.on_ray
    config = PolicyConfig.from_settings(settings)
    assert config.policy == "kv"
    r = config.routing
    assert (r.w_prefix, r.w_queue, r.w_kv, r.balance_abs, r.balance_rel, r.report_period_s) == (3, 1, 0.5, 16, 2, 0.25)
    assert PolicyConfig.from_kwargs(config.as_kwargs()) == config  # as it travels to the router
    assert PolicyConfig.from_settings(ServerConfig(replicas=2)) == PolicyConfig()  # kv, llm-d's and SGLang's
