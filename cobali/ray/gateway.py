"""The one HTTP endpoint in front of several engine replicas.

Requests are relayed whole to one replica, which answers with the single server's own app (validation, 4xx,
SSE): the gateway only chooses, once its front door (the key, the caps, the body limit) has let a request in. A
replica that cannot serve now (a 503: its engine loads, restarts after its process died, or drains) or does
not answer hands the request on to another, so one replica's restart costs the clients nothing while another
is ready.
/metrics, /health and /slots ask every replica and combine. No Ray import here: an engine is anything that
turns a request into the app's ASGI messages (cobali.ray.serve wraps a Ray Serve handle; the unit tests call
the apps in-process).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Message, Receive, Scope, Send

from cobali.frontend.errors import install_error_handlers, unavailable
from cobali.http.config import ServerConfig
from cobali.http.middleware import add_front_door
from cobali.http.prometheus import merge_expositions
from cobali.ray.asgi import HTTPRequest

log = logging.getLogger("cobali.http")
UNAVAILABLE = HTTPStatus.SERVICE_UNAVAILABLE
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


class EngineClient(Protocol):
    def messages(self, request: HTTPRequest) -> AsyncIterator[Message]: ...


class LeastBusy:
    """Power of two choices on requests in flight. Every request passes through the gateway, so its counts
    are exact and current: a burst spreads at once, with no stale probe and no extra round trip."""

    def __init__(self, n: int, rng: random.Random | None = None) -> None:
        self.in_flight = [0] * n
        self._rng = rng or random.Random()

    def pick(self, among: Sequence[int] | None = None) -> int:
        """The less busy of two replicas drawn from `among` (default: all of them)."""
        choices = range(len(self.in_flight)) if among is None else among
        candidates = self._rng.sample(choices, min(2, len(choices)))
        return min(candidates, key=self.in_flight.__getitem__)  # random order, so ties break at random


@dataclass(frozen=True)
class JsonReply:
    status: int
    body: bytes

    def response(self) -> Response:
        return Response(self.body, self.status, media_type="application/json")


class Relay(Response):
    """The chosen replica's response, message by message: status, headers and every SSE chunk as sent. Until
    one has begun a response other than a 503, the request goes on to the least busy of the rest."""

    def __init__(self, engines: Sequence[EngineClient], router: LeastBusy, request: HTTPRequest) -> None:
        super().__init__()
        self._engines, self._router, self._request = engines, router, request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        untried = list(range(len(self._engines)))
        refusal: list[Message] = []
        while untried:  # each replica once at most: a request that every replica refuses gets the last refusal
            index = self._router.pick(untried)
            untried.remove(index)
            self._router.in_flight[index] += 1
            try:
                refused = await self._relay(index, send)
            finally:
                self._router.in_flight[index] -= 1
            if refused is None:
                return
            refusal = refused or refusal
        if refusal:
            for message in refusal:
                await send(message)
        else:
            await unavailable("no replica answered").response()(scope, receive, send)

    async def _relay(self, index: int, send: Send) -> list[Message] | None:
        """None once replica `index`'s response went to the client; else what it refused with (its 503, held
        back: a small error body) or [] if it did not answer, and nothing was sent."""
        held: list[Message] = []
        started = False
        try:
            async for message in self._engines[index].messages(self._request):
                if held or (message["type"] == "http.response.start" and message["status"] == UNAVAILABLE):
                    held.append(message)
                    continue
                started = True
                await send(message)
        except Exception as err:
            if started:  # too late for another replica: the connection just ends
                raise
            log.warning("replica %d failed: %s", index, err)
            return []
        return None if started else held


async def _fetch(engine: EngineClient, request: HTTPRequest) -> JsonReply | None:
    """A whole response from one replica; None if the replica could not be reached."""
    status, chunks = 0, []
    try:
        async for message in engine.messages(request):
            if message["type"] == "http.response.start":
                status = message["status"]
            else:
                chunks.append(message.get("body", b""))
    except Exception as err:
        log.warning("a replica did not answer %s: %s", request.path, err)
        return None
    return JsonReply(status, b"".join(chunks)) if status else None


async def _incoming(http: Request) -> HTTPRequest:
    client = http.scope.get("client")
    return HTTPRequest(http.method, http.url.path, http.scope["query_string"], list(http.scope["headers"]),
                       await http.body(), None if client is None else (client[0], client[1]))


def gateway_app(engines: Sequence[EngineClient], config: ServerConfig) -> FastAPI:
    """The front door (cobali.http.middleware): CORS, the connection caps, the key and the body limit are checked
    here, before a body is read or travels to a replica; the replicas check the key again, since it names the
    prefix cache's tenant, and run none of the rest (cobali.ray.serve)."""
    router = LeastBusy(len(engines))
    # No docs routes of its own: /docs and /openapi.json are relayed, so they describe the replicas' API.
    app = FastAPI(title="cobali", openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    add_front_door(app, config)

    async def ask_all(http: Request) -> list[JsonReply | None]:
        request = await _incoming(http)
        return await asyncio.gather(*(_fetch(engine, request) for engine in engines))

    @app.get("/metrics")
    async def metrics(http: Request) -> Response:
        replies = await ask_all(http)
        texts = {str(i): r.body.decode() for i, r in enumerate(replies) if r is not None and r.status == 200}
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health(http: Request) -> Response:
        """Healthy while any replica can serve; each replica's own answer is listed."""
        states = {str(i): _health_state(r) for i, r in enumerate(await ask_all(http))}
        if "ok" not in states.values():
            return unavailable(f"no replica is ready: {states}").response()
        return JSONResponse({"status": "ok", "replicas": states})

    @app.get("/slots")
    async def slots(http: Request) -> Response:
        rows = []
        for i, reply in enumerate(await ask_all(http)):
            if reply is None:
                continue
            if reply.status != 200:  # e.g. 401: the replicas check the API key
                return reply.response()
            rows += [{"replica": str(i), **row} for row in json.loads(reply.body)]
        return JSONResponse(rows)

    @app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def relay(http: Request) -> Response:
        return Relay(engines, router, await _incoming(http))

    return app


def _health_state(reply: JsonReply | None) -> str:
    if reply is None:
        return "unreachable"
    if reply.status == 200:
        return "ok"
    try:
        return json.loads(reply.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {reply.status}"
