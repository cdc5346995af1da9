"""Hostile input: every bad body is a 4xx with an OpenAI error message, and the server still serves after.

Decisions these cases pin down:
- an unknown `model` is a 404 `model_not_found` (as OpenAI); leaving `model` out is fine;
- bodies over --max-body-bytes (default 1 MiB) are a 413 before anything is parsed;
- prompts longer than the context are a 400; n and prompts x n are capped at 16;
- a max_tokens beyond the room the context leaves is a 400 stating the context length (as OpenAI, vLLM).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.unit.http.test_server_api import N_CTX_SEQ, fake_app, fake_engine, wait_healthy
from tests.unit.http.test_server_live import live_server

JSON = {"content-type": "application/json"}
MIB = 1024 * 1024


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


def _nested(depth: int) -> bytes:
    return b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"


def _deep_schema(depth: int) -> bytes:
    schema = '{"type": "array", "items": ' * depth + "{}" + "}" * depth
    return ('{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": '
            + schema + "}}}").encode()


# (case, route, body, content type, status, fragment of the message)
CORPUS = [
    ("wrong type: stream", "completions", _json({"prompt": "x", "stream": "yes"}), JSON, 400, "stream"),
    ("wrong type: prompt", "completions", _json({"prompt": 5}), JSON, 400, "expected a string"),
    ("wrong type: messages", "chat", _json({"messages": [{"role": 1, "content": "x"}]}), JSON, 400, "role"),
    ("missing field: messages", "chat", _json({"max_tokens": 1}), JSON, 400, "Field required"),
    ("missing field: role", "chat", _json({"messages": [{"content": "x"}]}), JSON, 400, "Field required"),
    ("huge n", "completions", _json({"prompt": "x", "n": 10**6}), JSON, 400, "less than or equal to 16"),
    ("n beyond 64 bits", "completions", _json({"prompt": "x", "n": 10**40}), JSON, 400, "n"),
    ("negative max_tokens", "completions", _json({"prompt": "x", "max_tokens": -1}), JSON, 400, "max_tokens"),
    ("negative n", "completions", _json({"prompt": "x", "n": -3}), JSON, 400, "greater than or equal to 1"),
    ("negative top_p", "completions", _json({"prompt": "x", "top_p": -0.5}), JSON, 400, "top_p"),
    ("negative seed", "completions", _json({"prompt": "x", "seed": -1}), JSON, 400, "seed"),
    ("top_k beyond a C int", "completions", _json({"prompt": "x", "top_k": 2**40}), JSON, 400, "top_k"),
    ("NaN temperature", "completions", b'{"prompt": "x", "temperature": NaN}', JSON, 400, "finite number"),
    ("Infinity top_p", "completions", b'{"prompt": "x", "top_p": Infinity}', JSON, 400, "finite number"),
    ("invalid UTF-8", "completions", b'{"prompt": "\xff\xfe\xc3"}', JSON, 400, "parsing the body"),
    ("10 MB prompt", "completions", _json({"prompt": "a" * (10 * MIB)}), JSON, 413, "exceeds"),
    ("prompt over the context", "completions", _json({"prompt": "a" * (N_CTX_SEQ * 8)}), JSON, 400,
     "context holds"),
    ("token id out of vocabulary", "completions", _json({"prompt": [1, 2, 10**9]}), JSON, 400, "token ids"),
    ("deeply nested JSON", "completions", _nested(100_000), JSON, 400, "parsing the body"),
    ("deeply nested schema", "completions", _deep_schema(200), JSON, 400, "nests deeper"),
    ("unknown model", "completions", _json({"prompt": "x", "model": "gpt-17"}), JSON, 404, "does not exist"),
    ("unknown response_format", "chat", _json({"messages": [{"role": "user", "content": "x"}],
                                               "response_format": {"type": "grammar"}}), JSON, 400, "type"),
    ("schema not an object", "completions", _json({"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"schema": 5}}}), JSON, 400, "schema"),
    ("too many stop strings", "completions", _json({"prompt": "x", "stop": ["s"] * 1000}), JSON, 400, "stop"),
    ("empty body", "completions", b"", JSON, 400, "Field required"),
    ("non-JSON content type", "completions", b"prompt=x&max_tokens=1",
     {"content-type": "application/x-www-form-urlencoded"}, 400, "valid dictionary"),
    ("text/plain JSON", "chat", _json({"messages": []}), {"content-type": "text/plain"}, 400, "valid dictionary"),
    ("array instead of object", "chat", _json([{"messages": []}]), JSON, 400, "valid dictionary"),
    ("null body", "completions", b"null", JSON, 400, "valid dictionary"),
    ("truncated JSON", "completions", b'{"prompt": "x", "max_tok', JSON, 400, "invalid JSON"),
]

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@pytest.fixture(scope="module")
def hostile_api() -> Iterator[TestClient]:
    """One server for the whole corpus: what one case does must not break the next."""
    with TestClient(fake_app(fake_engine(), "fake-model")) as client:
        wait_healthy(client)
        yield client


@pytest.mark.parametrize(("route", "content", "headers", "status", "fragment"),
                         [case[1:] for case in CORPUS], ids=[case[0] for case in CORPUS])
def test_hostile_body_is_a_4xx_with_a_message(hostile_api: TestClient, route: str, content: bytes,
                                               headers: dict, status: int, fragment: str) -> None:
    response = hostile_api.post(ROUTES[route], content=content, headers=headers)
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert fragment in error["message"], error


def test_after_the_corpus_the_server_still_serves(hostile_api: TestClient) -> None:
    assert hostile_api.get("/health").status_code == 200
    body = hostile_api.post("/v1/completions", json={"prompt": "fine", "max_tokens": 4, "ignore_eos": True,
                                                     "model": "fake-model"}).json()
    assert body["usage"]["completion_tokens"] == 4


def test_huge_max_tokens_is_refused_naming_the_context(hostile_api: TestClient) -> None:
    response = hostile_api.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 10**30})
    assert response.status_code == 400
    assert f"context length is {N_CTX_SEQ} tokens" in response.json()["error"]["message"]
    exact = hostile_api.post("/v1/completions", json={"prompt": "abcd", "max_tokens": N_CTX_SEQ - 4,
                                                      "ignore_eos": True})
    assert exact.status_code == 200 and exact.json()["usage"]["total_tokens"] == N_CTX_SEQ


def test_body_limit_on_a_live_server() -> None:
    with live_server() as (client, server):
        big = client.post("/v1/completions", json={"prompt": "a" * (10 * MIB)})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must count the bytes as they come
            yield b'{"prompt": "'
            for _ in range(5):
                yield b"a" * MIB
            yield b'"}'

        chunked = client.post("/v1/completions", content=chunks(), headers=JSON)
        assert chunked.status_code == 413
        # A client that waits for "100 Continue" before sending a body over the limit is answered at once.
        port = server.servers[0].sockets[0].getsockname()[1]
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Expect: 100-continue\r\nContent-Length: 10485760\r\n\r\n")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(head)
            assert sock.recv(65536).startswith(b"HTTP/1.1 413")
        # Just under the limit: read and parsed, then refused for the context, not the size.
        under = client.post("/v1/completions", json={"prompt": "a" * (MIB - 1024)})
        assert under.status_code == 400 and "context holds" in under.json()["error"]["message"]
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
