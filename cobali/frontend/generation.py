"""One HTTP request's engine requests (n choices), the inbox their outputs reach the event loop through, and what
each has handed over so far."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from cobali.engine.outputs import RequestOutput
from cobali.engine.request import FinishReason
from cobali.engine.sampling import TokenLogprob
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
    """What a generation asks of the engine client that owns it (cobali.frontend.client.EngineClient)."""

    def abort(self, request_id: int) -> None: ...


@dataclass
class Choice:
    """What one engine request of a generation has handed over so far."""

    n_prompt_tokens: int
    pieces: list[str] = field(default_factory=list)  # its text
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    last: RequestOutput | None = None  # its latest output: counts, and (once final) why it ended

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def n_tokens(self) -> int:
        return self.last.n_tokens if self.last is not None else 0

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def take(self, output: RequestOutput) -> None:
        self.pieces.append(output.text)
        self.logprobs += output.logprobs
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.last = output


@dataclass
class Failure:
    message: str
    error: type[GenerationError] = EngineUnavailable


@dataclass(eq=False)  # identity semantics: generations go in sets
class Generation:
    """The engine requests behind one HTTP request (n choices), all reporting into one inbox."""

    loop: asyncio.AbstractEventLoop
    owner: Aborter
    request_ids: list[int] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)  # what each request handed over, as batches() yields it
    unfinished: int = field(default=0, init=False)  # requests whose final output batches() has not yielded
    # Characters of text the inbox may hold (None: no bound). A stream's consumer stuck on a client that does
    # not read takes nothing out, while the engine goes on decoding into it.
    max_buffered: int | None = field(default=None, init=False)
    on_overflow: Callable[[], None] | None = field(default=None, init=False)  # the stream drops its client
    _index: dict[int, int] = field(default_factory=dict, init=False)  # request id -> its choice
    _buffered: int = field(default=0, init=False)
    _overflowed: bool = field(default=False, init=False)
    _inbox: list[RequestOutput | Failure] = field(default_factory=list, init=False)  # event loop only
    _arrived: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def add(self, request_id: int, n_prompt_tokens: int) -> None:
        self._index[request_id] = len(self.request_ids)
        self.request_ids.append(request_id)
        self.choices.append(Choice(n_prompt_tokens))

    def index_of(self, output: RequestOutput) -> int:
        """Which choice an output is of."""
        return self._index[output.request_id]

    def push(self, item: RequestOutput | Failure) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.put, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.abort()

    def put(self, item: RequestOutput | Failure) -> None:
        """On the event loop."""
        if self.max_buffered is not None and isinstance(item, RequestOutput):
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
        """End every unfinished request at the next tick; safe from any thread, a no-op once finished (the engine
        ignores a request it no longer knows)."""
        for request_id, choice in zip(self.request_ids, self.choices, strict=True):
            if not choice.finished:
                self.owner.abort(request_id)

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Outputs until every request has finished, all those that arrived since the last batch at once, each
        taken into its choice as it is yielded. Raises a GenerationError if it failed (after the outputs that came
        before the failure)."""
        self.unfinished = len(self.request_ids)
        while self.unfinished:
            await self._arrived.wait()
            self._arrived.clear()
            items, self._inbox, self._buffered = self._inbox, [], 0
            batch: list[RequestOutput] = []
            for item in items:
                if isinstance(item, Failure):
                    if batch:
                        yield batch
                    raise item.error(item.message)
                self.choices[self.index_of(item)].take(item)
                if (problem := _problem(item)) is not None:
                    if batch:
                        yield batch
                    raise problem
                batch.append(item)
                self.unfinished -= item.finished
            yield batch

    async def events(self) -> AsyncIterator[RequestOutput]:
        """The outputs of batches(), one at a time."""
        async for batch in self.batches():
            for output in batch:
                yield output


def _problem(output: RequestOutput) -> GenerationError | None:
    """What a final output that did not end well tells the client."""
    if output.finish_reason is FinishReason.ERROR:
        return (RequestFailed if output.own_fault else EngineUnavailable)(f"generation failed: {output.error}")
    if output.finish_reason is FinishReason.ABORT:  # shutdown (or a client already gone)
        return EngineUnavailable("the request was aborted: the server is shutting down")
    return None
