"""The ingress: the one HTTP endpoint in front of the engine replicas, a Ray Serve deployment of its own.

Its front door (the key, the caps, the body limit) lets a request in; for a generating route it computes the
routing hint (cobali.ray.hints, on its worker pool); then the request goes whole to the replica the router picks
(cobali.ray.router), which answers with the single server's own app (validation, 4xx, SSE). A replica that cannot
serve now (a 503: its engine loads, restarts after its process died, or drains) or does not answer hands the
request on to another, the hint then asking the router to pass over those that refused, so one replica's
restart costs the clients nothing while another is ready. /metrics, /health and /slots ask every replica the
router lists, each by a call pinned to it, and combine; /metrics adds the router's own counts.
No Ray import here: the replicas are anything that turns a request into the app's ASGI messages (cobali.ray.serve
wraps a Ray Serve handle; the unit tests call the apps in-process).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import Message, Receive, Scope, Send

from cobali.frontend.errors import APIError, install_error_handlers, unavailable
from cobali.frontend.work_pool import WorkPool, client_address
from cobali.http.auth import KEY_ID
from cobali.http.config import ServerConfig
from cobali.http.middleware import add_front_door
from cobali.http.prometheus import merge_expositions
from cobali.ray.asgi import REPLICA_MESSAGE, HTTPRequest
from cobali.ray.hints import Hinter, generating
from cobali.ray.policy import Policy, RoutingHint

log = logging.getLogger("cobali.http")
UNAVAILABLE = HTTPStatus.SERVICE_UNAVAILABLE
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
REPLICA_HEADER = b"x-cobali-replica"
ASK_TIMEOUT_S = 30.0  # a replica that does not answer /metrics, /health or /slots within it is "unreachable"


class Replicas(Protocol):
    """The engine replicas as the ingress sees them: a deployment behind a router."""

    def ids(self) -> Sequence[str]:
        """The replicas the router can route to now."""
        ...

    def messages(self, request: HTTPRequest, hint: RoutingHint) -> AsyncIterator[Message]:
        """The request through the replica the router picks: its id (REPLICA_MESSAGE), then the app's messages."""
        ...

    def policy(self) -> Policy | None:
        """The router's policy, for its counts in /metrics (None: no router yet)."""
        ...


@dataclass(frozen=True)
class JsonReply:
    status: int
    body: bytes

    def response(self) -> Response:
        return Response(self.body, self.status, media_type="application/json")


class Relay(Response):
    """The chosen replica's response, message by message: status, headers and every SSE chunk as sent. Until
    one has begun a response other than a 503, the request goes on to another, those that refused passed over."""

    def __init__(self, replicas: Replicas, request: HTTPRequest, hint: RoutingHint) -> None:
        super().__init__()
        self._replicas, self._request, self._hint = replicas, request, hint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tried: set[str] = set()
        refusal: list[Message] = []
        for _ in range(max(1, len(self._replicas.ids()))):  # each replica once at most
            hint = dataclasses.replace(self._hint, avoid=frozenset(tried))
            replica, refused = await self._relay(hint, send)
            if refused is None:
                return
            refusal = refused or refusal
            if replica in tried:  # every replica refused: the router came back to one
                break
            if replica is not None:
                tried.add(replica)
        if refusal:
            for message in refusal:
                await send(message)
        else:
            await unavailable("no replica answered").response()(scope, receive, send)

    async def _relay(self, hint: RoutingHint, send: Send) -> tuple[str | None, list[Message] | None]:
        """(the replica that took it, if it said; None once its response went to the client, else what it refused
        with (its 503, held back: a small error body) or [] if it did not answer, and nothing was sent)."""
        held: list[Message] = []
        replica: str | None = None
        started = False
        try:
            async for message in self._replicas.messages(self._request, hint):
                if message["type"] == REPLICA_MESSAGE:
                    replica = message["replica"]
                elif held or (message["type"] == "http.response.start" and message["status"] == UNAVAILABLE):
                    held.append(message)
                else:
                    started = True
                    await send(served_by(message, replica))
        except Exception as err:
            if started:  # too late for another replica: the connection just ends
                raise
            log.warning("replica %s failed: %s", replica, err)
            return replica, []
        return replica, None if started else held


def served_by(message: Message, replica: str | None) -> Message:
    """The response's start names the replica that answered (x-cobali-replica), so that a client, a log or a
    benchmark can see where the router sent a request."""
    if message["type"] != "http.response.start" or replica is None:
        return message
    return {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, replica.encode())]}


async def _fetch(replicas: Replicas, replica: str, request: HTTPRequest) -> JsonReply | None:
    """A whole response from one replica; None if it could not be reached in time."""
    status, chunks = 0, []

    async def read() -> None:
        nonlocal status
        async for message in replicas.messages(request, RoutingHint(replica=replica)):
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

    try:
        await asyncio.wait_for(read(), ASK_TIMEOUT_S)
    except Exception as err:  # TimeoutError among them: a replica gone since it was listed
        log.warning("replica %s did not answer %s: %s", replica, request.path, err)
        return None
    return JsonReply(status, b"".join(chunks)) if status else None


async def _incoming(http: Request) -> HTTPRequest:
    client = http.scope.get("client")
    return HTTPRequest(http.method, http.url.path, http.scope["query_string"], list(http.scope["headers"]),
                       await http.body(), None if client is None else (client[0], client[1]))


def router_metrics(policy: Policy | None) -> bytes:
    """The router's counts: how requests were routed, how old each replica's report is, and its calls in flight."""
    registry = CollectorRegistry()
    if policy is not None:
        routed = CounterMetricFamily("cobali:router_requests", "Requests routed, by how the replica was chosen "
                                     "(prefix held, load, balance thresholds, text tree, pinned)", labels=["how"])
        for how, count in dict(policy.counts).items():
            routed.add_metric([how], count)
        ages = GaugeMetricFamily("cobali:router_report_age_seconds", "Age of the routing report the router holds",
                                 labels=["replica"])
        for replica, age in policy.report_ages().items():
            ages.add_metric([replica], age)
        in_flight = GaugeMetricFamily("cobali:router_in_flight", "Requests routed to each replica and not completed, "
                                      "as the router counts them", labels=["replica"])
        for replica, count in policy.in_flight().items():
            in_flight.add_metric([replica], count)

        class Families:
            def collect(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
                return [routed, ages, in_flight]

        registry.register(Families())
    return generate_latest(registry)


def gateway_app(replicas: Replicas, config: ServerConfig, hinter: Callable[[], Hinter | None]) -> FastAPI:
    """The front door (cobali.http.middleware): CORS, the connection caps, the key and the body limit are checked
    here, before a body is read or travels to a replica; the replicas check the key again, since it names the
    prefix cache's tenant, and run none of the rest (cobali.ray.serve). hinter(): how hints are made now (None:
    the model's text side has not loaded yet, requests route on load alone)."""
    pool = WorkPool(config.preprocess)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        pool.close()

    # No docs routes of its own: /docs and /openapi.json are relayed, so they describe the replicas' API.
    app = FastAPI(title="cobali", openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)
    install_error_handlers(app)
    add_front_door(app, config)

    async def ask_all(http: Request) -> dict[str, JsonReply | None]:
        request = await _incoming(http)
        ids = list(replicas.ids())
        return dict(zip(ids, await asyncio.gather(*(_fetch(replicas, r, request) for r in ids)), strict=True))

    async def hint_for(http: Request, request: HTTPRequest) -> RoutingHint:
        hints = hinter()
        if hints is None or not generating(request):
            return RoutingHint()
        key_id = http.scope.get("state", {}).get(KEY_ID)
        try:
            return await pool.run(client_address(http.scope), lambda: hints.hint(request, key_id))
        except APIError:  # the pool is busy: the request still goes, routed on load alone
            return RoutingHint()

    @app.get("/metrics")
    async def metrics(http: Request) -> Response:
        replies = await ask_all(http)
        texts = {r: reply.body.decode() for r, reply in replies.items() if reply is not None and reply.status == 200}
        body = merge_expositions(texts) + router_metrics(replicas.policy())
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health(http: Request) -> Response:
        """Healthy while any replica can serve; each replica's own answer is listed."""
        states = {r: _health_state(reply) for r, reply in (await ask_all(http)).items()}
        if "ok" not in states.values():
            return unavailable(f"no replica is ready: {states}").response()
        return JSONResponse({"status": "ok", "replicas": states})

    @app.get("/slots")
    async def slots(http: Request) -> Response:
        rows = []
        for replica, reply in (await ask_all(http)).items():
            if reply is None:
                continue
            if reply.status != 200:  # e.g. 401: the replicas check the API key
                return reply.response()
            rows += [{"replica": replica, **row} for row in json.loads(reply.body)]
        return JSONResponse(rows)

    @app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def relay(http: Request) -> Response:
        request = await _incoming(http)
        return Relay(replicas, request, await hint_for(http, request))

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
