"""Errors on Anthropic's routes (/v1/messages and below) in Anthropic's shape,
`{"type": "error", "error": {"type": ..., "message": ...}}`, with the statuses every route uses.

Every error this app answers is rendered as OpenAI's error object where it arises: the exception handlers
(cobali/frontend/errors.py, app.py), the key check, the connection caps, BodyLimit's 413. So Anthropic's shape is
made in one place, whatever raised the error: this middleware, outside all of them (cobali.http.middleware),
rewrites an error response's body on these paths. Any other response (a stream's 200 included) passes untouched.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cobali.http.render.anthropic import error_body

PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


class AnthropicErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_anthropic_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None  # an error's response start, held until its body is whole
        body = b""

        async def reshaping(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
            elif start is not None and message["type"] == "http.response.body":
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    await _send_reshaped(send, start, body)
            else:
                await send(message)

        await self.app(scope, receive, reshaping)


async def _send_reshaped(send: Send, start: Message, body: bytes) -> None:
    """The OpenAI error object in `body` as Anthropic's, under the same status and headers. A body that is no
    such object (a vanished client's empty 499) goes as it came: there is nothing to reshape, and nobody to read it."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        await send(start)
        await send({"type": "http.response.body", "body": body})
        return
    reshaped = json.dumps(error_body(start["status"], message)).encode()
    headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
    await send({**start, "headers": [*headers, (b"content-length", str(len(reshaped)).encode())]})
    await send({"type": "http.response.body", "body": reshaped})
