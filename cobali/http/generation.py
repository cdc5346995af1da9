"""The HTTP side of the generation path every generating route shares: the body parsed and its inputs prepared
(cobali.frontend.inputs) within the operator's limits, in one job on the worker pool unless the queue is full (on
the loop for a short body that asks for no grammar: cobali.http.parse), the generation submitted to the engine
client (cobali.frontend.client), the reply whole (read off the loop) or streamed. A route parses its body, builds
its choices, and renders its reply; the rest is here."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cobali.frontend.client import EngineState
from cobali.frontend.errors import APIError, unknown_model
from cobali.frontend.generation import Generation, GenerationError
from cobali.frontend.inputs import Choices, InputProcessor
from cobali.frontend.request_limits import check_request
from cobali.frontend.work_pool import client_of
from cobali.http.auth import keyed_choices
from cobali.http.disconnect import client_watch
from cobali.http.event_stream import EventStream, LastEvents
from cobali.http.parse import parse_then
from cobali.http.protocol.completions import GenerationRequest
from cobali.http.protocol.messages import MessagesRequest
from cobali.http.protocol.responses import ResponsesRequest
from cobali.http.protocol.unknown_fields import ignored_fields_headers
from cobali.http.render.logprobs import LogprobWriter, prompt_logprobs
from cobali.http.render.replies import Kind, Reply, sse
from cobali.http.state import ServerContext

T = TypeVar("T")
G = TypeVar("G", bound=GenerationRequest)
StreamableBody = GenerationRequest | MessagesRequest | ResponsesRequest  # a generating route's body


class ReplyUnread(GenerationError):
    """The worker pool did not read a finished reply (busy, or over --preprocess-timeout): its client is told
    as the pool's error says, in-band where a stream has begun."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error

    def api_error(self) -> APIError:
        return self.error


async def read_off_loop(http: Request, work: Callable[[], T]) -> T:
    """work() (a whole reply through its parsers, n of them for n choices, or a stream's last read with the
    parsers' finish) on the worker pool: on the event loop a long reply would stall every other stream."""
    server: ServerContext = http.app.state.server
    try:
        return await server.pool.run(client_of(http), work)
    except APIError as err:
        raise ReplyUnread(err) from err


def inputs_for(http: Request, model: str | None) -> InputProcessor:
    """How requests are prepared for the model a request names: this server's. Like OpenAI, an unknown model is
    a 404, not silently served by whatever is loaded; leaving `model` out is allowed. Then a 503 unless the engine
    is ready."""
    server: ServerContext = http.app.state.server
    if not server.serves(model):
        raise unknown_model(str(model), server.model_name)
    return server.inputs()


def within_limits(http: Request, inputs: InputProcessor, body: GenerationRequest, n_prompts: int) -> None:
    """The body within the operator's limits (they measure O(body) text: off the loop), then room in the queue for
    its choices: a request over them, or a full server, costs nothing more."""
    server: ServerContext = http.app.state.server
    check_request(body, server.config.limits, server.config.grammar, inputs.model.n_vocab)
    server.client.check_room(n_prompts * body.n)  # reads a length: safe off the loop


def refuse_when_full(http: Request) -> None:
    """QueueFull if not even one more request fits: before a generation's body is parsed, its choices unknown
    (within_limits counts them). An engine not ready is left to the route, whose 404 comes before its 503."""
    client = http.app.state.server.client
    if client.state in (EngineState.READY, EngineState.RESTARTING):
        client.check_room(1)


# The most choices (prompts x n) a body prepared on the event loop may ask for: each is its sampling params.
INLINE_CHOICES = 8


async def prepared_body(http: Request, model: type[G], n_prompts: Callable[[G], int],
                        prepare: Callable[[InputProcessor, G], T],
                        light: Callable[[G], bool] = lambda _body: True) -> tuple[G, InputProcessor, T]:
    """A generation route's body parsed, and prepare(inputs, body) (tokenizing, the chat template, the grammar)
    once it is within the limits: one job on the worker pool, unless the queue is already full. Answered in the
    order every route answers: the body's 400, the model's 404, the engine's 503, a limit's 400, a full queue's
    429. One job, not two: a hop costs the loop more than parsing a short body does; and none for a short body
    (cobali.http.parse) that asks for no grammar and few choices, and that the route's light(body) passes."""
    refuse_when_full(http)

    def then(body: G) -> tuple[G, InputProcessor, T]:
        inputs = inputs_for(http, body.model)
        within_limits(http, inputs, body, n_prompts(body))
        return body, inputs, prepare(inputs, body)

    def inline(body: G) -> bool:
        return not body.asks_grammar() and n_prompts(body) * body.n <= INLINE_CHOICES and light(body)

    return await parse_then(http, model, then, inline)


def submit(http: Request, body: GenerationRequest, prepared: Choices) -> Generation:
    """The request's choices (prompts x n), queued on the engine under its key's prefix cache, and aborted the
    moment the client goes."""
    server: ServerContext = http.app.state.server
    prepared = keyed_choices(http.scope, prepared, server.config.shared_prefix_cache)
    generation = server.client.submit(prepared, body.priority, server.lora_of(body.model))
    client_watch(http).on_gone(generation.abort)
    return generation


async def replied(http: Request, body: StreamableBody, generation: Generation,
                  events: Callable[[], AsyncIterator[str]], whole: Callable[[], dict],
                  whole_off_loop: bool = True) -> Response:
    """The reply as the body asks: its events() streamed under the operator's limits on a client that stops
    reading, or once the generation is over its whole(), read on the worker pool unless nothing parses it."""
    server: ServerContext = http.app.state.server
    headers = ignored_fields_headers(body)
    if body.stream:
        return EventStream(events(), headers, generation, server.config.send_timeout_s,
                           server.config.max_stream_buffer_chars)
    await _until_finished(generation)
    return JSONResponse(await read_off_loop(http, whole) if whole_off_loop else whole(), headers=headers)


async def _until_finished(generation: Generation) -> None:
    """Until the generation is over (a non-streamed reply); aborted if this is cancelled or fails."""
    try:
        async for _ in generation.events():
            pass
    finally:
        generation.abort()  # a no-op when everything finished


async def generate(http: Request, inputs: InputProcessor, body: GenerationRequest, prepared: Choices,
                   kind: Kind, echoes: list[str] | None = None) -> Response:
    """The choices submitted, and their reply in OpenAI's shape (a completion, or a chat completion)."""
    server: ServerContext = http.app.state.server
    generation = submit(http, body, prepared)
    logprobs = None
    if (k := prepared[0][1].logprobs) is not None:
        logprobs = LogprobWriter(inputs.tokenizer.token_bytes, kind.chat, len(prepared), k,
                                 echoed=None if echoes is None else [tokens for tokens, _ in prepared])
    reply = Reply(kind, server.model_id(body.model), generation, body.n, logprobs,
                  None if echoes is None else [e for e in echoes for _ in range(body.n)], body.continuous_usage,
                  None if body.prompt_logprobs is None else functools.partial(
                      prompt_logprobs, token_bytes=inputs.tokenizer.token_bytes, k=body.prompt_logprobs))
    return await replied(http, body, generation, functools.partial(_stream, http, reply, body.include_usage),
                         reply.full, whole_off_loop=kind.replies is not None)


async def _stream(http: Request, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    opening = reply.opening() or ""  # rides with the first text: one write fewer a stream
    try:
        async for outputs in reply.generation.batches():  # one write for all that arrived together
            read = functools.partial(reply.read, outputs)
            reads = await read_off_loop(http, read) if reply.finishes_reading(outputs) else read()
            chunk, opening = opening + "".join(map(reply.delta_chunk, outputs, reads)), ""
            if not reply.generation.unfinished:  # the last text: the stream's end rides in the same write
                yield LastEvents(chunk + (reply.chunk([], reply.usage()) if include_usage else "") + "data: [DONE]\n\n")
            else:
                yield chunk
    except GenerationError as err:  # headers are sent: report in-band, as OpenAI streams do; then the end, as vLLM's
        yield LastEvents(opening + sse(err.api_error().body()) + "data: [DONE]\n\n")
