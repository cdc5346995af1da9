"""Under --replicas: the client's address reaches the replica, whose per-client fairness and caps are by it
(issue 44), and the ingress checks the key before it reads or relays a body."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from cobali.frontend.client import EngineState
from cobali.http import parse
from cobali.http.config import ServerConfig
from cobali.ray.asgi import HTTPRequest, call_app
from cobali.ray.gateway import gateway_app
from tests.unit.ray.test_ray_gateway import LocalReplicas, no_hints, replica_app

CLIENT = ("203.0.113.7", 4242)  # as Ray Serve's proxy puts it in the scope: the peer, or a trusted X-Forwarded-For


class Recording:
    """A replica's app that answers 200 and keeps the scopes it was called with."""

    def __init__(self) -> None:
        self.scopes: list[Scope] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def through_gateway(replica: Recording, config: ServerConfig, path: str, **request: object) -> httpx.Response:
    async def run() -> httpx.Response:
        gateway = gateway_app(LocalReplicas({"r0": replica}), config, no_hints)  # type: ignore[dict-item]
        transport = httpx.ASGITransport(app=gateway, client=CLIENT)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.post(path, **request)  # type: ignore[arg-type]

    return asyncio.run(run())


def test_the_client_address_reaches_the_replica() -> None:
    replica = Recording()
    assert through_gateway(replica, ServerConfig(), "/v1/completions", json={}).status_code == 200
    assert [tuple(scope["client"]) for scope in replica.scopes] == [CLIENT]  # was None: every client one "-"


def test_the_replica_s_work_pool_tells_clients_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parse, "INLINE_BODY_BYTES", -1)  # a short body on the pool too, as a long one is

    async def test() -> None:
        app = replica_app()
        async with app.router.lifespan_context(app):
            while app.state.server.client.state is not EngineState.READY:  # else a 503: "the model is loading"
                await asyncio.sleep(0.01)
            seen: list[str] = []
            pool = app.state.server.pool
            run = pool.run

            async def recording_run(client: str, work: object) -> object:
                seen.append(client)
                return await run(client, work)  # type: ignore[arg-type]

            pool.run = recording_run
            body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
            for host in ("198.51.100.1", "198.51.100.2"):
                request = HTTPRequest("POST", "/v1/completions", b"", [(b"content-type", b"application/json")],
                                      body, (host, 1))
                messages = [m async for m in call_app(app, request)]
                assert messages[0]["status"] == 200
            assert set(seen) == {"198.51.100.1", "198.51.100.2"}

    asyncio.run(test())


def test_the_gateway_checks_the_key_before_it_relays() -> None:
    replica = Recording()
    config = ServerConfig(api_keys=("k",))
    refused = through_gateway(replica, config, "/v1/messages", content=b"x" * 1000)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert refused.json()["type"] == "error", "Anthropic's shape on its routes"
    assert replica.scopes == [], "nothing relayed"
    let_in = through_gateway(replica, config, "/v1/messages", json={}, headers={"x-api-key": "k"})
    assert let_in.status_code == 200 and len(replica.scopes) == 1
