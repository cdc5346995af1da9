"""The API key is checked from the headers alone, before any body byte is read (issue 44, item 3): a client
without it cannot make the server wait for, or buffer, a body. Keys are found by one hash of what is offered,
whatever the number of keys."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.types import Message

from cobali.http import auth
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy
from tests.unit.http.test_server_live import wait_for

KEY = "sekret"
ANNOUNCED = 1024 * 1024  # the default --max-body-bytes: the most an unauthenticated client could have made us hold


@contextmanager
def live(app: FastAPI) -> Iterator[int]:
    """uvicorn on a loopback port, in a thread; yields the port."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(15)


def answer_to_headers(port: int, path: str, headers: str = "", wait_s: float = 5) -> tuple[bytes, float]:
    """Sends a POST's headers announcing a body of ANNOUNCED bytes, and none of the body; the first bytes of the
    answer, whole (b"" if none came within wait_s), and how long it took."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(wait_s)
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
                f"Content-Length: {ANNOUNCED}\r\n\r\n")
        start = time.perf_counter()
        sock.sendall(head.encode())
        try:
            answer = whole_answer(sock)
        except TimeoutError:
            answer = b""
        return answer, time.perf_counter() - start


def whole_answer(sock: socket.socket) -> bytes:
    """One HTTP answer: its head, then as many body bytes as its Content-Length says. uvicorn writes the head
    and the body in two sends, which may arrive as two segments: one recv() is not enough."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        if not (more := sock.recv(65536)):
            return answer
        answer += more
    head = answer.partition(b"\r\n\r\n")[0]
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    whole = len(head) + 4 + (int(length.group(1)) if length else 0)
    while len(answer) < whole and (more := sock.recv(65536)):
        answer += more
    return answer


@pytest.mark.parametrize("path, shape", [
    ("/v1/completions", {"error": {"message": auth.UNAUTHORIZED.message, "type": "authentication_error",
                                   "param": None, "code": "invalid_api_key"}}),
    ("/v1/messages", {"type": "error", "error": {"type": "authentication_error",
                                                 "message": auth.UNAUTHORIZED.message}})])
def test_a_request_without_the_key_is_answered_before_its_body_is_sent(path: str, shape: dict) -> None:
    with live(fake_app(fake_engine(), "m", api_keys=(KEY,))) as port:
        answer, took = answer_to_headers(port, path, "Authorization: Bearer wrong\r\n")
        print(f"{path}: 401 after {took * 1000:.1f} ms, no body sent")
        assert answer.startswith(b"HTTP/1.1 401 "), answer  # the old check waited for the whole body
        assert json.loads(answer.partition(b"\r\n\r\n")[2]) == shape  # OpenAI's, or Anthropic's on its routes
        # With the key, the same headers are let through: the server then waits for the body.
        waiting, _ = answer_to_headers(port, path, f"Authorization: Bearer {KEY}\r\n", wait_s=0.5)
        assert waiting == b""


def call(app: FastAPI, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """One request through the app's middleware without a lifespan (an engine is never needed here): its
    status, and how many times the app asked for the body."""
    reads = 0
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
                             "root_path": "", "query_string": b"", "headers": headers, "client": ("10.0.0.1", 1),
                             "server": None, "scheme": "http", "http_version": "1.1", "asgi": {"version": "3.0"}}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], reads


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
                                  "/tokenize", "/v1/embeddings", "/no/such/route"])
def test_no_body_byte_is_read_without_the_key(path: str) -> None:
    app = fake_app(fake_engine(), "m", api_keys=(KEY,))
    for headers in ([], [(b"authorization", b"Bearer wrong")], [(b"x-api-key", b"wrong")],
                    [(b"authorization", b"Basic " + KEY.encode())]):
        assert call(app, path, headers) == (401, 0), headers


def test_only_the_first_bearer_token_and_the_first_x_api_key_are_read() -> None:
    with TestClient(fake_app(fake_engine(), "m", api_keys=("alpha", "beta"))) as client:
        wait_healthy(client)

        def status(*headers: tuple[str, str]) -> int:
            return client.get("/v1/models", headers=list(headers)).status_code

        assert status(("authorization", "Bearer alpha")) == status(("x-api-key", "beta")) == 200
        assert status(("authorization", "Bearer wrong"), ("authorization", "Bearer alpha")) == 401
        assert status(("x-api-key", "wrong"), ("x-api-key", "alpha")) == 401
        assert status(("authorization", "Bearer wrong"), ("x-api-key", "beta")) == 200  # either header may hold it
        assert status(("authorization", "bearer  alpha ")) == 200  # the scheme in any case, the token stripped
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_a_key_is_found_by_one_hash_whatever_the_number_of_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [f"key-{i}" for i in range(10_000)]
    middleware = auth.ApiKeyAuth(FastAPI(), keys)
    hashed: list[bytes] = []
    sha256 = hashlib.sha256

    def counted(data: bytes) -> Any:
        hashed.append(data)
        return sha256(data)

    monkeypatch.setattr(auth.hashlib, "sha256", counted)
    for offered, found in ((b"key-9999", True), (b"key-0", True), (b"nope", False)):
        hashed.clear()
        key_id = middleware.key_id([(b"authorization", b"Bearer " + offered), (b"x-api-key", b"also-nope")])
        assert (key_id is not None) == found
        assert len(hashed) == (1 if found else 2), "one hash per offered key, at most two: no loop over the keys"
    assert middleware.key_id([(b"x-api-key", b"key-5")]) == hashlib.sha256(b"key-5").hexdigest()[:16]
