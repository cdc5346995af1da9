"""POST /v1/completions, and the generation path it shares with /v1/chat/completions."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cobali.backends.base import SamplingParams
from cobali.engine.engine import Engine
from cobali.server.errors import bad_request, unknown_model
from cobali.server.generation import Generation, GenerationError
from cobali.server.logprobs import LogprobWriter, prompt_logprobs
from cobali.server.replies import COMPLETION, Kind, Reply, sse
from cobali.server.schemas import CompletionRequest, GenerationRequest, ModelLimits
from cobali.server.state import ServerContext
from cobali.server.unknown_fields import ignored_fields_headers

router = APIRouter()


class EventStream(StreamingResponse):
    """Server-sent events from a generator that watches for the client's disconnect itself
    (aborted_on_disconnect). Starlette's StreamingResponse adds a second watcher under ASGI servers older than
    spec 2.4 (uvicorn's is 2.3): a task group per request, whose cancel formats a task's repr. Measured with
    256 short streams on a 5 ms sleeping backend, that was a tenth of the event loop's time."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stream_response(send)


@contextlib.asynccontextmanager
async def aborted_on_disconnect(http: Request, generation: Generation) -> AsyncIterator[None]:
    """Free the slots as soon as the client goes away, even while its requests still wait in the queue."""

    async def watch() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        generation.abort()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        generation.abort()  # a no-op when everything finished; otherwise an error or a cancelled handler


async def _stream(http: Request, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    async with aborted_on_disconnect(http, reply.generation):
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
        if keep is not None:
            tokens = engine.backend.tokenize(prompt) if isinstance(prompt, str) else prompt
            prompt = tokens[-(limit - 1 if keep == -1 else keep):]
        return engine.tokenize_prompt(prompt)
    except ValueError as err:
        raise bad_request(str(err), param) from None


def _choices(engine: Engine, body: GenerationRequest,
             prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    limits = ModelLimits(engine.slots.accountant.seq_limit, engine.backend.info.n_vocab)
    try:
        choices = [(tokens, body.sampling_params(len(tokens), limits, copy))
                   for tokens in prompts for copy in range(body.n)]
        if choices[0][1].grammar is not None:  # compile once here: a bad grammar must not reach the engine
            engine.backend.new_sampler(choices[0][1]).close()
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


def submit(http: Request, engine: Engine, body: GenerationRequest, prompts: list[list[int]]) -> Generation:
    """The request's choices (prompts x n), queued on the engine."""
    server: ServerContext = http.app.state.server
    return server.engine_thread.submit(_choices(engine, body, prompts), body.priority, server.lora_of(body.model))


async def generate(http: Request, engine: Engine, body: GenerationRequest, prompts: list[list[int]],
                   kind: Kind, echoes: list[str] | None = None) -> Response:
    server: ServerContext = http.app.state.server
    generation = submit(http, engine, body, prompts)
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
        return EventStream(_stream(http, reply, body.include_usage), headers)
    async with aborted_on_disconnect(http, generation):
        async for _ in generation.events():
            pass
    return JSONResponse(reply.full(), headers=headers)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request) -> Response:
    engine = served_engine(http, body.model)
    prompts = [tokenize(engine, p, "prompt", body.truncate_prompt_tokens) for p in body.prompts()]
    echoes = None
    if body.echo:  # the prompt as sent; token-id or truncated prompts are rendered from their tokens
        echoes = [p if isinstance(p, str) and body.truncate_prompt_tokens is None else detokenize(engine, t)
                  for p, t in zip(body.prompts(), prompts, strict=True)]
    return await generate(http, engine, body, prompts, COMPLETION, echoes)


def detokenize(engine: Engine, tokens: list[int]) -> str:
    return b"".join(map(engine.backend.token_bytes, tokens)).decode("utf-8", errors="replace")
