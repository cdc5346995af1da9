"""The gateway hands a request that a replica cannot serve now (its 503: loading, restarting, draining) or that a
replica does not answer on to another one; a response that has begun is never sent twice."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.types import Message

from cobali.http.config import ServerConfig
from cobali.ray.asgi import HTTPRequest
from cobali.ray.gateway import LeastBusy, gateway_app

BODY = {"prompt": "hello", "max_tokens": 2}


class Scripted:
    """A replica that answers every request the same way: `status` with a body naming it, or (None) an error
    before anything; `breaks` ends the connection after the status line."""

    def __init__(self, name: str, status: int | None, breaks: bool = False) -> None:
        self.name, self.status, self.breaks = name, status, breaks
        self.calls = 0

    async def messages(self, request: HTTPRequest) -> AsyncIterator[Message]:
        self.calls += 1
        if self.status is None:
            raise RuntimeError(f"{self.name} is gone")
        yield {"type": "http.response.start", "status": self.status,
               "headers": [(b"content-type", b"application/json")]}
        if self.breaks:
            raise RuntimeError(f"{self.name} died mid-response")
        yield {"type": "http.response.body", "body": json.dumps({"replica": self.name}).encode()}


async def post_all(replicas: list[Scripted], n: int) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=gateway_app(replicas, ServerConfig()))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        return [await client.post("/v1/completions", json=BODY) for _ in range(n)]


@pytest.mark.parametrize("refusing", [Scripted("restarting", 503), Scripted("gone", None)])
def test_a_replica_that_cannot_serve_hands_every_request_on(refusing: Scripted) -> None:
    ready = Scripted("ready", 200)
    replies = asyncio.run(post_all([refusing, ready], 40))
    assert [(r.status_code, r.json()) for r in replies] == [(200, {"replica": "ready"})] * 40
    assert ready.calls == 40 and refusing.calls > 0  # the router chose it first for about half of them


def test_a_request_every_replica_refuses_gets_a_refusal_after_one_try_each() -> None:
    replicas = [Scripted("a", 503), Scripted("b", 503), Scripted("c", None)]
    (reply,) = asyncio.run(post_all(replicas, 1))
    assert reply.status_code == 503 and reply.json()["replica"] in ("a", "b")
    assert [r.calls for r in replicas] == [1, 1, 1]
    (reply,) = asyncio.run(post_all([Scripted("gone", None)], 1))
    assert reply.status_code == 503 and reply.json()["error"]["message"] == "no replica answered"


def test_a_response_that_began_is_not_sent_again() -> None:
    replicas = [Scripted("a", 200, breaks=True), Scripted("b", 200, breaks=True)]
    with pytest.raises(RuntimeError, match="died mid-response"):
        asyncio.run(post_all(replicas, 1))
    assert sum(r.calls for r in replicas) == 1


def test_least_busy_picks_among_the_replicas_it_is_given() -> None:
    router = LeastBusy(4, random.Random(0))
    router.in_flight[:] = [0, 5, 9, 7]
    assert {router.pick([1, 2]) for _ in range(20)} == {1}
    assert {router.pick([1, 2, 3]) for _ in range(20)} <= {1, 3}  # never 0, the least busy of all
    assert router.pick([2]) == 2
