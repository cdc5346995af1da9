"""POST /v1/completions and /v1/chat/completions: one code path, two response shapes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cobali.backends.base import SamplingParams
from cobali.engine.engine import Engine
from cobali.engine.request import Request as EngineRequest
from cobali.server.engine_thread import EngineUnavailable, Generation
from cobali.server.errors import APIError, bad_request, unavailable
from cobali.server.logprobs import LogprobWriter
from cobali.server.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from cobali.server.state import ServerContext

router = APIRouter()


@dataclass(frozen=True)
class Kind:
    """What differs between the two routes: object names and how a choice carries its text."""

    chat: bool

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def choice(self, index: int, request: EngineRequest, logprobs: dict | None) -> dict:
        text = request.text
        key, value = ("message", {"role": "assistant", "content": text}) if self.chat else ("text", text)
        return {"index": index, key: value, "logprobs": logprobs, "finish_reason": _finish_reason(request)}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        key, value = ("delta", {"content": text} if text else {}) if self.chat else ("text", text)
        return {"index": index, key: value, "logprobs": logprobs, "finish_reason": finish_reason}


COMPLETION, CHAT = Kind(chat=False), Kind(chat=True)


def _finish_reason(request: EngineRequest) -> str | None:
    return request.finish_reason.value if request.finish_reason is not None else None


class Reply:
    """The envelope shared by a response and all of its stream chunks."""

    def __init__(self, kind: Kind, model: str, generation: Generation, prompt_tokens: int,
                 logprobs: LogprobWriter | None) -> None:
        self.kind = kind
        self.logprobs = logprobs
        self.id = f"{'chatcmpl' if kind.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.generation = generation
        self.prompt_tokens = prompt_tokens

    def envelope(self, object_name: str, choices: list[dict], usage: bool) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if usage:
            completion = sum(len(r.output_tokens) for r in self.generation.requests)
            body["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                             "total_tokens": self.prompt_tokens + completion}
        return body

    def new_logprobs(self, index: int) -> dict | None:
        """The logprobs of choice `index`'s tokens not reported yet (all of them, in a full response)."""
        return self.logprobs.render_new(index, self.generation.requests[index]) if self.logprobs else None

    def full(self) -> dict:
        choices = [self.kind.choice(i, r, self.new_logprobs(i)) for i, r in enumerate(self.generation.requests)]
        return self.envelope(self.kind.object, choices, usage=True)

    def chunk(self, choices: list[dict], usage: bool = False) -> str:
        return _sse(self.envelope(self.kind.chunk_object, choices, usage))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@contextlib.asynccontextmanager
async def _aborted_on_disconnect(http: Request, generation: Generation) -> AsyncIterator[None]:
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
    generation = reply.generation
    async with _aborted_on_disconnect(http, generation):
        try:
            if reply.kind.chat:  # OpenAI opens each chat choice with the role
                opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(len(generation.requests))]
                yield reply.chunk(opening)
            async for delta in generation.events():
                request = generation.requests[delta.index]
                reason = _finish_reason(request) if delta.finished else None
                logprobs = reply.new_logprobs(delta.index)
                yield reply.chunk([reply.kind.chunk_choice(delta.index, delta.text, reason, logprobs)])
            if include_usage:
                yield reply.chunk([], usage=True)
            yield "data: [DONE]\n\n"
        except EngineUnavailable as err:  # headers are sent: report in-band, as OpenAI streams do
            yield _sse(unavailable(str(err)).body())


def _tokenize(engine: Engine, prompt: str | list[int], param: str) -> list[int]:
    try:
        return engine.tokenize_prompt(prompt)
    except ValueError as err:
        raise bad_request(str(err), param) from None


def _choices(engine: Engine, body: GenerationRequest,
             prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    n_ctx_seq = engine.backend.info.n_ctx_seq
    try:
        choices = [(tokens, body.sampling_params(len(tokens), n_ctx_seq, copy))
                   for tokens in prompts for copy in range(body.n)]
        if choices[0][1].grammar is not None:  # compile once here: a bad grammar must not reach the engine
            engine.backend.new_sampler(choices[0][1]).close()
    except ValueError as err:
        raise bad_request(str(err)) from None
    return choices


def _engine(http: Request, body: GenerationRequest) -> Engine:
    """The engine, for a request naming this server's model. Like OpenAI, an unknown model is a 404, not
    silently served by whatever is loaded; leaving `model` out is allowed."""
    server: ServerContext = http.app.state.server
    if body.model is not None and body.model != server.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{server.model_name}'",
                       param="model", code="model_not_found")
    return server.engine_thread.require_engine()


async def _generate(http: Request, engine: Engine, body: GenerationRequest, prompts: list[list[int]],
                    kind: Kind) -> Response:
    server: ServerContext = http.app.state.server
    choices = _choices(engine, body, prompts)
    generation = server.engine_thread.submit(choices, priority=body.priority)
    logprobs = None
    if choices[0][1].logprobs is not None:
        logprobs = LogprobWriter(engine.backend.token_bytes, kind.chat, len(choices))
    reply = Reply(kind, server.model_name, generation, sum(map(len, prompts)), logprobs)
    if body.stream:
        return StreamingResponse(_stream(http, reply, body.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async with _aborted_on_disconnect(http, generation):
        async for _ in generation.events():
            pass
    return JSONResponse(reply.full())


@router.post("/v1/completions")
async def completions(body: CompletionRequest, http: Request) -> Response:
    engine = _engine(http, body)
    prompts = [_tokenize(engine, p, "prompt") for p in body.prompts()]
    return await _generate(http, engine, body, prompts, COMPLETION)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
    engine = _engine(http, body)
    try:
        text = engine.backend.apply_chat_template([m.as_template_input() for m in body.messages])
    except ValueError as err:
        raise bad_request(str(err), "messages") from None
    return await _generate(http, engine, body, [_tokenize(engine, text, "messages")], CHAT)
