"""A cap on request body size, enforced before a route reads (and JSON-parses) the body.

Without it a client could send hundreds of megabytes of prompt: the server would hold it, parse it and
tokenize it on the event loop before the context check rejected it. Checked twice: a declared
Content-Length over the cap is refused without keeping anything, and a chunked body is counted as it arrives.
The 413 comes after the body has been read and discarded, unless the client waits for "100 Continue".
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cobali.frontend.errors import APIError
from cobali.http.config import DEFAULT_MAX_BODY_BYTES

# Beyond this much discarded body, the connection is simply dropped: reading on would be a free sink.
DRAIN_LIMIT_BYTES = 256 * 1024 * 1024


class BodyLimit:
    """ASGI middleware: buffers the body up to `max_bytes`, answers 413 beyond it, then replays it."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # A client that waits for "100 Continue" (curl does, for large bodies) is answered at once: the
            # server sends that only when the body is first read, so this client never sends it.
            waits = headers.get(b"expect", b"").lower() == b"100-continue"
            await self._too_large(scope, receive, send, more=not waits)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client is gone: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send, more=message.get("more_body", False))
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            # The body once, then the real channel: handlers still need to see http.disconnect.
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, more: bool = True) -> None:
        """Answer 413 once the client has sent its body: a client that writes the whole body before it
        reads (urllib, requests) sees a connection reset if the server closes on unread data."""
        drained = 0
        while more and drained <= DRAIN_LIMIT_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)
        error = APIError(413, f"request body exceeds {self.max_bytes} bytes (--max-body-bytes)",
                         code="request_too_large")
        await error.response()(scope, receive, send)
