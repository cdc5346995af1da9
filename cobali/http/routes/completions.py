"""POST /v1/completions, and the generation path it shares with /v1/chat/completions."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cobali.backends.base import SamplingParams
from cobali.engine.engine import Engine
from cobali.frontend.client import EngineState
from cobali.frontend.errors import bad_request, unknown_model
from cobali.frontend.generation import Generation, GenerationError
from cobali.frontend.request_limits import RequestLimits, check_prompt_logprobs, check_request
from cobali.frontend.work_pool import client_of
from cobali.http.disconnect import cancelled_on_disconnect, client_watch
from cobali.http.event_stream import EventStream
from cobali.http.parse import json_body, parse_body
from cobali.http.protocol.completions import CompletionRequest, GenerationRequest, ModelLimits
from cobali.http.protocol.unknown_fields import ignored_fields_headers
from cobali.http.render.logprobs import LogprobWriter, prompt_logprobs
from cobali.http.render.replies import COMPLETION, Kind, Reply, sse
from cobali.http.state import ServerContext

T = TypeVar("T")
G = TypeVar("G", bound=GenerationRequest)
Choices = list[tuple[list[int], SamplingParams]]  # one (prompt tokens, params) per engine request

router = APIRouter()


async def _stream(reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    try:
        if (opening := reply.opening()) is not None:
            yield opening
        async for deltas in reply.generation.batches():  # one write for all that arrived together
            chunk = "".join(map(reply.delta_chunk, deltas))
            if not reply.generation.unfinished:  # the last text: the stream's end rides in the same write
                chunk += (reply.chunk([], reply.usage()) if include_usage else "") + "data: [DONE]\n\n"
            yield chunk
    except GenerationError as err:  # headers are sent: report in-band, as OpenAI streams do
        yield sse(err.api_error().body())


def tokenize(engine: Engine, prompt: str | list[int], param: str, keep: int | None = None) -> list[int]:
    """The prompt's tokens; keep (vLLM's truncate_prompt_tokens): only its last `keep`, -1 as many as the
    context holds beside one output token. A `keep` past the context is vLLM's 400, whatever the prompt's length."""
    limit = engine.slots.accountant.seq_limit
    if keep is not None and keep > limit:
        raise bad_request(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({limit}). "
                          "Please, select a smaller truncation size.", "truncate_prompt_tokens")
    try:
        return engine.tokenize_prompt(prompt, None if keep is None else limit - 1 if keep == -1 else keep)
    except ValueError as err:
        raise bad_request(str(err), param) from None


def build_choices(engine: Engine, body: GenerationRequest, prompts: list[list[int]],
                  request_limits: RequestLimits) -> Choices:
    """Every choice's params, its grammar built and compiled: on the worker pool (preprocessed)."""
    if body.prompt_logprob_count() is not None:  # vLLM's, or echo's with logprobs
        check_prompt_logprobs(sum(map(len, prompts)) * body.n,
                              "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs", request_limits)
    accountant = engine.slots.accountant
    limits = ModelLimits(accountant.seq_limit, engine.backend.info.n_vocab, accountant.context_hint())
    try:
        choices = [(tokens, body.sampling_params(len(tokens), limits, copy))
                   for tokens in prompts for copy in range(body.n)]
        if choices[0][1].grammar is not None:  # compile once here: a bad grammar must not reach the engine
            engine.grammars.check(choices[0][1].grammar)
    except ValueError as err:
        raise bad_request(str(err)) from None
    return choices


def served_engine(http: Request, model: str | None) -> Engine:
    """The engine, for a request naming this server's model. Like OpenAI, an unknown model is a 404, not
    silently served by whatever is loaded; leaving `model` out is allowed."""
    server: ServerContext = http.app.state.server
    if not server.serves(model):
        raise unknown_model(model, server.model_name)
    return server.engine_thread.require_engine()


async def preprocessed(http: Request, engine: Engine, body: GenerationRequest, n_prompts: int,
                       work: Callable[[], T]) -> T:
    """work() (tokenizing, the chat template, the grammar) on the worker pool, once the body is within the
    operator's limits and the queue has room for its choices: both checked first in the same job (the limits
    measure O(body) text), so a request over them, or a full server, costs nothing more."""
    server: ServerContext = http.app.state.server

    def checked() -> T:
        check_request(body, server.limits, server.grammar, engine.backend.info.n_vocab)
        server.engine_thread.check_room(n_prompts * body.n)  # reads a length: safe off the loop
        return work()

    return await server.pool.run(client_of(http), checked)


def refuse_when_full(http: Request) -> None:
    """QueueFull if not even one more request fits: before a generation's body is parsed, its choices unknown
    (preprocessed counts them). An engine not ready is left to the route, whose 404 comes before its 503."""
    thread = http.app.state.server.engine_thread
    if thread.state is EngineState.READY:
        thread.check_room(1)


async def generation_body(http: Request, model: type[G]) -> G:
    """A generation route's body, parsed on the worker pool unless the queue is already full."""
    refuse_when_full(http)
    return await parse_body(http, model)


def submit(http: Request, body: GenerationRequest, prepared: Choices) -> Generation:
    """The request's choices (prompts x n), queued on the engine, and aborted the moment the client goes."""
    server: ServerContext = http.app.state.server
    generation = server.engine_thread.submit(prepared, body.priority, server.lora_of(body.model))
    client_watch(http).on_gone(generation.abort)
    return generation


def event_stream(http: Request, events: AsyncIterator[str], headers: dict[str, str],
                 generation: Generation) -> EventStream:
    """A generation's stream, under the operator's limits on a client that stops reading."""
    server: ServerContext = http.app.state.server
    return EventStream(events, headers, generation, server.send_timeout_s, server.max_stream_buffer_chars)


async def until_finished(generation: Generation) -> None:
    """Until the generation is over (a non-streamed reply); aborted if this is cancelled or fails."""
    try:
        async for _ in generation.events():
            pass
    finally:
        generation.abort()  # a no-op when everything finished


async def generate(http: Request, engine: Engine, body: GenerationRequest, prepared: Choices,
                   kind: Kind, echoes: list[str] | None = None) -> Response:
    server: ServerContext = http.app.state.server
    generation = submit(http, body, prepared)
    logprobs = None
    if generation.requests[0].params.logprobs is not None:
        logprobs = LogprobWriter(engine.backend.token_bytes, kind.chat, len(generation.requests),
                                 echo=echoes is not None)
    reply = Reply(kind, server.model_id(body.model), generation, body.n, logprobs,
                  None if echoes is None else [e for e in echoes for _ in range(body.n)], body.continuous_usage,
                  None if body.prompt_logprobs is None else functools.partial(
                      prompt_logprobs, token_bytes=engine.backend.token_bytes, k=body.prompt_logprobs))
    headers = ignored_fields_headers(body)
    if body.stream:
        return event_stream(http, _stream(reply, body.include_usage), headers, generation)
    await until_finished(generation)
    return JSONResponse(reply.full(), headers=headers)


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
@cancelled_on_disconnect
async def completions(http: Request) -> Response:
    body = await generation_body(http, CompletionRequest)
    engine = served_engine(http, body.model)
    work = functools.partial(_completion_choices, engine, body, http.app.state.server.limits)
    prepared, echoes = await preprocessed(http, engine, body, len(body.prompts()), work)
    return await generate(http, engine, body, prepared, COMPLETION, echoes)


def _completion_choices(engine: Engine, body: CompletionRequest,
                        limits: RequestLimits) -> tuple[Choices, list[str] | None]:
    prompts = [tokenize(engine, p, "prompt", body.truncate_prompt_tokens) for p in body.prompts()]
    echoes = None
    if body.echo:  # the prompt as sent; token-id or truncated prompts are rendered from their tokens
        echoes = [p if isinstance(p, str) and body.truncate_prompt_tokens is None else detokenize(engine, t)
                  for p, t in zip(body.prompts(), prompts, strict=True)]
    return build_choices(engine, body, prompts, limits), echoes


def detokenize(engine: Engine, tokens: list[int]) -> str:
    return b"".join(map(engine.backend.token_bytes, tokens)).decode("utf-8", errors="replace")
