"""Caps on what clients hold open at once: overall (--max-connections) and per client address
(--max-connections-per-client), so slow uploads or a flood of streams from one address cannot take every
connection the server will serve, nor their buffers.

What is counted is requests in flight: from the request's headers until its response has been sent (its body
being read, its prompt prepared, its generation queued, run or streamed). HTTP/1.1 carries one request at a time
on a connection, so that is the connections doing work; an idle keep-alive connection is not counted (uvicorn
closes it after 5 s without a request). The address is the ASGI scope's client: the peer, or the address a
trusted proxy forwarded (uvicorn's --forwarded-allow-ips; under Ray Serve, its proxy's). A request over a cap is
refused from its headers, before its body is read, and its connection closed: 503 for the server's cap, 429 for
the client's, each naming its flag.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from cobali.frontend.errors import APIError
from cobali.frontend.work_pool import client_address


class ConnectionCaps:
    def __init__(self, app: ASGIApp, overall: int | None, per_client: int | None) -> None:
        self.app = app
        self.overall = overall
        self.per_client = per_client
        self.in_flight = 0
        self.by_client: dict[str, int] = {}  # only clients with a request in flight: bounded by `overall`

    def refusal(self, client: str) -> APIError | None:
        """The client's own cap first: a client over it is told so, whether or not the server is full."""
        held = self.by_client.get(client, 0)
        if self.per_client is not None and held >= self.per_client:
            return APIError(429, f"this client has {held} requests in flight, the most one client may have "
                            f"(--max-connections-per-client {self.per_client}); retry when some are done",
                            "rate_limit_error", code="too_many_connections")
        if self.overall is not None and self.in_flight >= self.overall:
            return APIError(503, f"the server has {self.in_flight} requests in flight, the most it takes "
                            f"(--max-connections {self.overall}); retry later", "server_error",
                            code="too_many_connections")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = client_address(scope)
        if (refused := self.refusal(client)) is not None:
            response = refused.response()
            response.headers["connection"] = "close"  # shed the connection, not only the request
            await response(scope, receive, send)
            return
        self.in_flight += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.by_client[client] -= 1
            if not self.by_client[client]:
                del self.by_client[client]
