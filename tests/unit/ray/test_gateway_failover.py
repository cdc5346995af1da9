"""The ingress hands a request that a replica cannot serve now (its 503: loading, restarting, draining) or that a
replica does not answer on to another one, asking the router to pass over those that refused; a response that has
begun is never sent twice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
from starlette.types import Message

from cobali.http.config import ServerConfig
from cobali.ray.asgi import REPLICA_MESSAGE, HTTPRequest
from cobali.ray.gateway import gateway_app
from cobali.ray.policy import Policy, PolicyConfig, RoutingHint
from tests.unit.ray.test_ray_gateway import no_hints

BODY = {"prompt": "hello", "max_tokens": 2}


class Scripted:
    """A replica that answers every request the same way: `status` with a body naming it, or (None) an error
    before anything; `breaks` ends the connection after the status line."""

    def __init__(self, name: str, status: int | None, breaks: bool = False) -> None:
        self.name, self.status, self.breaks = name, status, breaks
        self.calls = 0

    async def messages(self) -> AsyncIterator[Message]:
        self.calls += 1
        yield {"type": REPLICA_MESSAGE, "replica": self.name}
        if self.status is None:
            raise RuntimeError(f"{self.name} is gone")
        yield {"type": "http.response.start", "status": self.status,
               "headers": [(b"content-type", b"application/json")]}
        if self.breaks:
            raise RuntimeError(f"{self.name} died mid-response")
        yield {"type": "http.response.body", "body": json.dumps({"replica": self.name}).encode()}


class ScriptedDeployment:
    """Scripted replicas behind the least-busy policy, as the Ray router ranks them: the first rank's."""

    def __init__(self, replicas: list[Scripted]) -> None:
        self.replicas = {r.name: r for r in replicas}
        self.router = Policy(PolicyConfig("least-busy"))
        self.hints: list[RoutingHint] = []

    def ids(self) -> Sequence[str]:
        return list(self.replicas)

    def policy(self) -> Policy:
        return self.router

    def messages(self, request: HTTPRequest, hint: RoutingHint) -> AsyncIterator[Message]:
        self.hints.append(hint)
        return self.replicas[self.router.rank(hint, self.ids())[0][0]].messages()


async def post_all(deployment: ScriptedDeployment, n: int) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=gateway_app(deployment, ServerConfig(), no_hints))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        return [await client.post("/v1/completions", json=BODY) for _ in range(n)]


@pytest.mark.parametrize("refusing", [Scripted("restarting", 503), Scripted("gone", None)])
def test_a_replica_that_cannot_serve_hands_every_request_on(refusing: Scripted) -> None:
    ready = Scripted("ready", 200)
    deployment = ScriptedDeployment([refusing, ready])
    replies = asyncio.run(post_all(deployment, 40))
    assert [(r.status_code, r.json()) for r in replies] == [(200, {"replica": "ready"})] * 40
    assert {r.headers["x-cobali-replica"] for r in replies} == {"ready"}  # the one that answered is named
    assert ready.calls == 40 and refusing.calls > 0  # the router chose it first for about half of them
    assert refusing.calls == sum(hint.avoid == {refusing.name} for hint in deployment.hints)  # then passed over


def test_a_request_every_replica_refuses_gets_a_refusal_after_one_try_each() -> None:
    replicas = [Scripted("a", 503), Scripted("b", 503), Scripted("c", None)]
    (reply,) = asyncio.run(post_all(ScriptedDeployment(replicas), 1))
    assert reply.status_code == 503 and reply.json()["replica"] in ("a", "b")
    assert [r.calls for r in replicas] == [1, 1, 1]
    (reply,) = asyncio.run(post_all(ScriptedDeployment([Scripted("gone", None)]), 1))
    assert reply.status_code == 503 and reply.json()["error"]["message"] == "no replica answered"


def test_a_response_that_began_is_not_sent_again() -> None:
    replicas = [Scripted("a", 200, breaks=True), Scripted("b", 200, breaks=True)]
    with pytest.raises(RuntimeError, match="died mid-response"):
        asyncio.run(post_all(ScriptedDeployment(replicas), 1))
    assert sum(r.calls for r in replicas) == 1
