"""Issue 46: what a stream costs the server is mostly its sends through the ASGI stack, so a stream makes no send
it does not need: the role's opening rides with the first text, and the last text (with [DONE]) is the final body
message, with no empty one after it. Counted at the ASGI boundary, on the fake engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy


class Recorded:
    """The app, with the body messages each HTTP response sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.bodies: list[Message] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def recording(message: Message) -> None:
            if message["type"] == "http.response.body":
                self.bodies.append(message)
            await send(message)

        await self.app(scope, receive, recording)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True}),
])
def test_every_send_of_a_stream_carries_text(path: str, body: dict[str, Any]) -> None:
    """However the texts batch (one send for all that arrived together), no send is the opening alone, nor an
    empty end."""
    recorded = Recorded(fake_app(fake_engine()))
    with TestClient(recorded) as client:  # type: ignore[arg-type]
        wait_healthy(client)
        recorded.bodies.clear()
        reply = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert reply.status_code == 200
    events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert recorded.bodies[-1]["more_body"] is False and recorded.bodies[-1]["body"], "an empty last send"
    for message in recorded.bodies:
        assert b'"text":"' in message["body"] or b'"content":"' in message["body"].replace(b'"content":""', b""), \
            f"a send without text: {message['body'][:200]!r}"
