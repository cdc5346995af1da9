"""Caps on requests in flight, overall (--max-connections, 503) and per client address
(--max-connections-per-client, 429), refused from the headers before any body is read (issue 44, item 4)."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from cobali.config import settings
from cobali.config.serve_flags import server_config
from cobali.faces import cli
from cobali.http.config import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_CLIENT
from cobali.http.connections import ConnectionCaps
from tests.unit.http.test_auth_middleware import live
from tests.unit.http.test_server_api import fake_app, fake_engine
from tests.unit.http.test_server_live import wait_for


def scope(host: str) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "client": (host, 1)}


def test_requests_in_flight_are_capped_per_client_and_overall() -> None:
    async def test() -> None:
        release = asyncio.Event()
        reads = 0

        async def held(_scope: Scope, _receive: Receive, send: Send) -> None:
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        caps = ConnectionCaps(held, overall=3, per_client=2)

        async def request(host: str) -> list[Message]:
            sent: list[Message] = []

            async def receive() -> Message:
                nonlocal reads
                reads += 1
                return {"type": "http.disconnect"}

            async def send(message: Message) -> None:
                sent.append(message)

            await caps(scope(host), receive, send)
            return sent

        admitted = [asyncio.create_task(request(host)) for host in ("10.0.0.1", "10.0.0.1", "10.0.0.2")]
        await asyncio.sleep(0)
        assert (caps.in_flight, caps.by_client) == (3, {"10.0.0.1": 2, "10.0.0.2": 1})
        for host, status, flag in (("10.0.0.1", 429, "--max-connections-per-client 2"),
                                   ("10.0.0.3", 503, "--max-connections 3")):
            start, body = await request(host)
            assert start["status"] == status and (b"connection", b"close") in start["headers"]
            assert flag in json.loads(body["body"])["error"]["message"]
        assert reads == 0, "refused from the headers: no body read"
        release.set()
        assert [sent[0]["status"] for sent in await asyncio.gather(*admitted)] == [200, 200, 200]
        assert (caps.in_flight, caps.by_client) == (0, {}), "every count given back"
        assert (await request("10.0.0.1"))[0]["status"] == 200

    asyncio.run(test())


def slow_upload(port: int) -> socket.socket:
    """An authenticated request whose body has begun and never ends: it holds its connection."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(5)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
    return sock


def test_a_client_over_its_cap_is_refused_and_its_connection_closed() -> None:
    with live(fake_app(fake_engine(), "m", api_keys=("k",), max_connections_per_client=2)) as port:
        held = [slow_upload(port), slow_upload(port)]
        over = slow_upload(port)
        answer = b""
        while chunk := over.recv(65536):  # until the server closes the connection (else a timeout)
            answer += chunk
        over.close()
        assert answer.startswith(b"HTTP/1.1 429 ") and b"--max-connections-per-client 2" in answer
        assert b"connection: close" in answer.lower()
        held.pop().close()  # one upload given up: its place is free again

        def admitted() -> bool:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\r\n")
                return sock.recv(12) == b"HTTP/1.1 200"

        wait_for(admitted)
        for sock in held:
            sock.close()


def test_the_caps_are_flags_with_defaults_in_serve_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--max-connections N" in shown and "--max-connections-per-client N" in shown
    assert "--shared-prefix-cache" in shown
    args = settings.parse_args(cli.build_parser(), ["serve", "--max-connections", "9"])
    config = server_config(args)
    assert (config.max_connections, config.max_connections_per_client) == (9, DEFAULT_MAX_CONNECTIONS_PER_CLIENT)
    assert DEFAULT_MAX_CONNECTIONS_PER_CLIENT < DEFAULT_MAX_CONNECTIONS
