"""The Anthropic error-shape middleware: OpenAI error objects reshaped, anything else passed as it came."""

from __future__ import annotations

import asyncio
import json

from starlette.types import Message, Receive, Scope, Send

from cobali.http.anthropic_errors import AnthropicErrors


def _answering(status: int, body: bytes):  # type: ignore[no-untyped-def]
    async def app(_scope: Scope, _receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})
    return app


def _call(status: int, body: bytes) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope: Scope = {"type": "http", "path": "/v1/messages", "headers": []}
    asyncio.run(AnthropicErrors(_answering(status, body))(scope, receive, send))
    return sent


def test_an_openai_error_is_reshaped_as_anthropics() -> None:
    sent = _call(400, json.dumps({"error": {"message": "bad max_tokens", "type": "invalid_request_error"}}).encode())
    body = json.loads(sent[-1]["body"])
    assert body["type"] == "error" and body["error"]["message"] == "bad max_tokens"
    assert sent[0]["status"] == 400


def test_a_vanished_clients_empty_499_passes_untouched() -> None:
    sent = _call(499, b"")  # raised JSONDecodeError in the middleware before
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 499 and sent[1]["body"] == b""
