"""One HTTP request through an ASGI app in-process, its response as the ASGI messages the app sends.

This is how a Ray Serve replica hosts the single server's FastAPI app unchanged: the gateway ships the
request over (a plain picklable value), the replica runs it through the app and streams the app's messages
back as they are sent, so SSE tokens flow one by one. No Ray import here: the unit tests drive it directly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

log = logging.getLogger("cobali.http")
# A replica's first message, before the app's: which replica it is (Ray Serve's replica id), so that the ingress
# can pass over one that refused a request, and label what each replica answers.
REPLICA_MESSAGE = "cobali.replica"


@dataclass(frozen=True)
class HTTPRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    # The client's (host, port) as the gateway's scope has it (Ray Serve's proxy passes its own uvicorn's on): the
    # replica's per-client fairness (cobali.frontend.work_pool) is by it.
    client: tuple[str, int] | None = None


def _scope(request: HTTPRequest) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
            "method": request.method, "path": request.path, "raw_path": request.path.encode(), "root_path": "",
            "query_string": request.query_string, "headers": request.headers, "client": request.client, "server": None}


async def call_app(app: ASGIApp, request: HTTPRequest) -> AsyncIterator[Message]:
    """The app's http.response.* messages until the response is complete.

    Closing the iterator early (the client went away) is a disconnect: the app's receive() says so and its
    task is cancelled, so the handlers' own clean-up (aborting the generation, freeing the slot) runs.
    """
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    pending = [{"type": "http.request", "body": request.body, "more_body": False}]

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await gone.wait()  # the body is read: the next thing a client can do is leave
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(_scope(request), receive, sent.put)
        except Exception:  # as uvicorn does: the app's error handlers have answered if they could
            log.exception("exception in the ASGI app")
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    complete = False
    try:
        while not complete and (message := await sent.get()) is not None:
            complete = message["type"] == "http.response.body" and not message.get("more_body", False)
            yield message
    finally:
        gone.set()
        if not complete:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
