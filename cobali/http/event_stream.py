"""Server-sent events whose client costs nothing when it stops reading.

uvicorn applies flow control: once the socket and the transport's buffer are full, a send waits until the
client reads. A client that never does would hold its slot, its KV and its buffered text forever; so each
send has a deadline (--send-timeout), and the text a generation may hold for a stuck stream is bounded
(--max-stream-buffer). Past either, the generation is aborted and the client dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cobali.frontend.cancels import only_our_cancel
from cobali.frontend.generation import Generation
from cobali.http.disconnect import stop_watch

log = logging.getLogger("cobali.http")


class SendDeadline:
    """send() with a time limit. The timer is armed lazily, once per period of the limit, not once per send:
    a stream's sends are many, and almost all of them return at once."""

    def __init__(self, task: asyncio.Task, timeout_s: float) -> None:
        self._task = task
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # when the send in progress began
        self._timer: asyncio.TimerHandle | None = None
        self.dropped: str | None = None  # why the stream's task was cancelled, once it was

    def sending(self) -> None:
        """A send begins: called around it, not wrapping it, so that a send costs no extra coroutine."""
        self._since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self._timeout_s, self._check)

    def sent(self) -> None:
        self._since = None

    def _check(self) -> None:
        self._timer = None
        if self._since is None:  # no send in progress: the next one arms the timer again
            return
        due = self._since + self._timeout_s
        if self._loop.time() >= due:
            self.drop(f"the client read nothing for {self._timeout_s:g} s (--send-timeout)")
        else:
            self._timer = self._loop.call_at(due, self._check)

    def drop(self, reason: str) -> None:
        """End the stream: its task is cancelled wherever it waits (a send, or the generation's next text)."""
        if self.dropped is None:
            self.dropped = reason
            self._task.cancel()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class LastEvents(str):
    """A stream's last text: it goes as the response's final body message, not followed by an empty one (at
    hundreds of short streams a second, each send through the ASGI stack is a share of the server's time)."""


class EventStream(StreamingResponse):
    """Server-sent events from a generator. The client's disconnect is watched by the request's ClientWatch
    (cobali.http.disconnect), started before the handler returned this. Starlette's StreamingResponse adds a
    second watcher under ASGI servers older than spec 2.4 (uvicorn's is 2.3): a task group per request, whose
    cancel formats a task's repr: with many short streams, a large share of the event loop's time
    (docs/results.md, "Host path")."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str], generation: Generation,
                 send_timeout_s: float, max_buffer_chars: int) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self.generation = generation
        self.send_timeout_s = send_timeout_s
        generation.max_buffered = max_buffer_chars

    async def _stream(self, send: Send, deadline: SendDeadline) -> None:
        deadline.sending()
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        deadline.sent()
        ended = False
        async for events in self.body_iterator:
            assert not ended, "nothing follows a stream's last events"
            ended = isinstance(events, LastEvents)
            body = events.encode() if isinstance(events, str) else bytes(events)
            deadline.sending()
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
            deadline.sent()
        if not ended:
            deadline.sending()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            deadline.sent()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        deadline = SendDeadline(task, self.send_timeout_s)
        self.generation.on_overflow = lambda: deadline.drop(
            f"the client fell {self.generation.max_buffered} characters behind (--max-stream-buffer)")
        try:
            await self._stream(send, deadline)
        except asyncio.CancelledError:
            if not (deadline.dropped is not None and only_our_cancel(task)):
                raise
            # uvicorn closes the connection, since the response never completed
            log.warning("dropped a stream's client: %s; its generation is aborted", deadline.dropped)
        finally:
            deadline.close()
            self.generation.on_overflow = None
            self.generation.abort()  # a no-op when it finished; else its slot and KV are freed now
            stop_watch(scope)
