"""A client's disconnect, noticed at any phase of its request: while the handler awaits its prompt's rendering
(it is then never submitted), queued, prefilling, decoding or streaming.

Starlette's receive channel must have exactly one reader, and a request has many phases: one ClientWatch per
request, kept in its ASGI scope, reads it from the handler's start to the response's end. BodyLimit has read
the body and replayed it to FastAPI by then, so all the watcher can see is the disconnect (uvicorn also reports
one once the response is complete, by which time there is nothing left to abort).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope

from cobali.frontend.cancels import Canceller

P = ParamSpec("P")
SCOPE_KEY = "cobali.client_watch"
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, but logs and metrics see it


class ClientWatch:
    """Reads the request's receive channel until the disconnect, then runs the callbacks given to on_gone."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._callbacks: list[Callable[[], None]] = []
        self._task: asyncio.Task | None = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Run callback when the client goes, or now if it has gone already."""
        if self.gone:
            callback()
        else:
            self._callbacks.append(callback)

    def forget(self, callback: Callable[[], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def stop(self) -> None:
        """The response is done with: nothing left to abort. The task is let go of as it is cancelled: its
        CancelledError's traceback holds this watch (a frame's `self`), so a watch that kept its task would close a
        cycle around the request's scope, its receive channel and four frames, freed only by the cyclic GC. At
        hundreds of requests a second those made its full collections a tenth of the server's time, each stalling
        the event loop for ~0.1 s (bench/engine/sleeping_backend.py)."""
        self._callbacks.clear()
        if self._task is not None:
            self._task.cancel()
            self._task = None


def client_watch(http: Request) -> ClientWatch:
    """The request's watch, started on first use (after the body is read: the watcher must not take it)."""
    watch = http.scope.get(SCOPE_KEY)
    if watch is None:
        watch = http.scope[SCOPE_KEY] = ClientWatch(http.receive)
    return watch


def stop_watch(scope: Scope) -> None:
    """Called by a streamed response once it is over; the handler stops the watch of any other response."""
    watch = scope.get(SCOPE_KEY)
    if watch is not None:
        watch.stop()


def cancelled_on_disconnect(handler: Callable[P, Awaitable[Response]]) -> Callable[P, Awaitable[Response]]:
    """A route handler (taking a Request) cancelled at its next await when its client goes: one that goes while
    its prompt is rendered or its grammar compiled is never submitted. Generations it submits register their
    abort with client_watch(http) themselves, for the phases after the handler returns (a stream)."""

    @functools.wraps(handler)  # FastAPI reads the handler's signature through __wrapped__
    async def guarded(*args: P.args, **kwargs: P.kwargs) -> Response:
        http = next(value for value in kwargs.values() if isinstance(value, Request))
        await http.body()  # kept by the Request for the handler's parse_body: the watcher must not take it
        watch, cancel = client_watch(http), Canceller()
        watch.on_gone(cancel)
        streaming = False
        try:
            response = await handler(*args, **kwargs)
            streaming = isinstance(response, StreamingResponse)  # EventStream stops the watch when it ends
            return response
        except asyncio.CancelledError:
            if not cancel.was_ours():
                raise
            return Response(status_code=CLIENT_GONE)
        finally:
            watch.forget(cancel)
            if not streaming:
                watch.stop()

    return guarded
