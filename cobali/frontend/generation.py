"""One HTTP request's engine requests (n choices) and the inbox their text reaches the event loop through."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from cobali.engine.request import FinishReason, Request
from cobali.frontend.errors import APIError, bad_request, unavailable


class GenerationError(Exception):
    """A generation that cannot go on; api_error(): what its client is told (an HTTP error, or in-band)."""

    def api_error(self) -> APIError:
        return unavailable(str(self))


class EngineUnavailable(GenerationError):
    """The engine cannot take or finish this request (loading, failed, shutting down): a 503."""


class RequestFailed(GenerationError):
    """The request's own input ended its generation (a grammar that allows no token): a 400, which retrying the
    same request would not mend, where a 503 would have a client retry it."""

    def api_error(self) -> APIError:
        return bad_request(str(self))


class StreamOverflow(GenerationError):
    """A stream's client fell too far behind (--max-stream-buffer): its generation was aborted."""


class Aborter(Protocol):
    """What a generation asks of the engine thread that owns it (cobali.frontend.client.EngineThread)."""

    def abort(self, request_id: int) -> None: ...


class Delta(NamedTuple):
    index: int  # which request of the generation
    text: str
    finished: bool
    n_tokens: int  # the request's output tokens when this text was handed over: its logprobs end there


@dataclass
class Failure:
    message: str
    error: type[GenerationError] = EngineUnavailable


@dataclass(eq=False)  # identity semantics: generations go in sets
class Generation:
    """The engine requests behind one HTTP request (n choices), all reporting into one inbox."""

    loop: asyncio.AbstractEventLoop
    owner: Aborter
    requests: list[Request] = field(default_factory=list)
    unfinished: int = field(default=0, init=False)  # requests whose final delta batches() has not yielded
    # Characters of text the inbox may hold (None: no bound). A stream's consumer stuck on a client that does
    # not read takes nothing out, while the engine goes on decoding into it.
    max_buffered: int | None = field(default=None, init=False)
    on_overflow: Callable[[], None] | None = field(default=None, init=False)  # the stream drops its client
    _buffered: int = field(default=0, init=False)
    _overflowed: bool = field(default=False, init=False)
    _inbox: list[Delta | Failure] = field(default_factory=list, init=False)  # event loop only
    _arrived: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def add(self, request: Request) -> None:
        self.requests.append(request)

    def push(self, item: Delta | Failure) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.put, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.abort()

    def put(self, item: Delta | Failure) -> None:
        """On the event loop."""
        if self.max_buffered is not None and isinstance(item, Delta):
            self._buffered += len(item.text)
            if self._buffered > self.max_buffered or self._overflowed:
                self._overflow()
                return
        self._inbox.append(item)
        self._arrived.set()

    def _overflow(self) -> None:
        """Past max_buffered: the text held is dropped, the requests aborted, and the reader told."""
        if self._overflowed:
            return
        self._overflowed = True
        self._inbox = [Failure(f"the client fell more than {self.max_buffered} characters behind its stream",
                               StreamOverflow)]
        self._arrived.set()
        self.abort()
        if self.on_overflow is not None:
            self.on_overflow()

    def abort(self) -> None:
        """End every unfinished request at the next tick; safe from any thread, a no-op once finished."""
        for request in self.requests:
            if not request.is_finished:
                self.owner.abort(request.id)

    async def batches(self) -> AsyncIterator[list[Delta]]:
        """Text deltas until every request has finished, all those that arrived since the last batch at once.
        Raises a GenerationError if it failed (after the deltas that came before the failure)."""
        self.unfinished = len(self.requests)
        while self.unfinished:
            await self._arrived.wait()
            self._arrived.clear()
            items, self._inbox, self._buffered = self._inbox, [], 0
            batch: list[Delta] = []
            for item in items:
                problem = self._problem(item)
                if problem is not None:
                    if batch:
                        yield batch
                    raise problem
                batch.append(item)
                self.unfinished -= item.finished
            yield batch

    async def events(self) -> AsyncIterator[Delta]:
        """The deltas of batches(), one at a time."""
        async for batch in self.batches():
            for delta in batch:
                yield delta

    def _problem(self, item: Delta | Failure) -> GenerationError | None:
        if isinstance(item, Failure):
            return item.error(item.message)
        if not item.finished:
            return None
        request = self.requests[item.index]
        if request.finish_reason is FinishReason.ERROR:
            return (RequestFailed if request.own_fault else EngineUnavailable)(f"generation failed: {request.error}")
        if request.finish_reason is FinishReason.ABORT:  # shutdown (or a client already gone)
            return EngineUnavailable("the request was aborted: the server is shutting down")
        return None
