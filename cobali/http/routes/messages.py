"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The body becomes a chat request (protocol/messages.py) and goes the chat route's way: the same limits, template,
grammar and queue; its reply is read by the model's parsers (reasoning, then tool calls) and rendered as
Anthropic's message, or as its stream of events (render/anthropic.py). Errors take Anthropic's shape
(cobali/http/anthropic_errors.py).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cobali.frontend.generation import Generation, GenerationError
from cobali.frontend.inputs import InputProcessor, ReplyReader
from cobali.frontend.request_limits import RequestLimits, check_tools
from cobali.http.disconnect import cancelled_on_disconnect
from cobali.http.generation import read_off_loop, replied
from cobali.http.parse import json_body
from cobali.http.protocol.chat import ChatCompletionRequest
from cobali.http.protocol.messages import CountTokensRequest, MessagesRequest
from cobali.http.protocol.unknown_fields import ignored_fields_headers
from cobali.http.render import anthropic
from cobali.http.request_route import RequestRoute
from cobali.http.routes.as_chat import parsed_as_chat, submitted_as_chat
from cobali.http.routes.chat import chat_prompt
from cobali.http.state import ServerContext

router = APIRouter(route_class=RequestRoute)


@dataclass(frozen=True)
class MessageReply:
    """One generation's reply, read by the model's parsers and named as Anthropic names it."""

    generation: Generation
    replies: ReplyReader
    model: str
    input_tokens: int
    id: str

    def whole(self) -> dict:
        choice = self.generation.choices[0]
        assert choice.last is not None, "a finished generation has its final output"
        reply = self.replies.whole(choice.text)
        return anthropic.message(self.id, self.model, reply, anthropic.stop_reason(choice.last, bool(reply.calls)),
                                 anthropic.final_usage(self.input_tokens, choice.last))

    async def events(self, http: Request) -> AsyncIterator[str]:
        """The stream's events, those of outputs that arrived together in one write."""
        stream, parser = anthropic.MessageStream(self.id, self.model), self.replies.stream()
        try:
            yield "".join(stream.start(anthropic.Usage(self.input_tokens, 0)))
            async for outputs in self.generation.batches():
                events: list[str] = []
                for output in outputs:
                    events += stream.delta(parser.feed(output.text))
                    if output.finished:
                        events += stream.delta(await read_off_loop(http, parser.finish))
                        events += stream.finish(anthropic.stop_reason(output, stream.called),
                                                anthropic.final_usage(self.input_tokens, output))
                if events:
                    yield "".join(events)
        except GenerationError as err:  # headers are sent: report in-band, as Anthropic's streams do
            error = err.api_error()
            yield anthropic.event(anthropic.error_body(error.status, error.message))


@router.post("/v1/messages", openapi_extra=json_body(MessagesRequest))
@cancelled_on_disconnect
async def messages(http: Request) -> Response:
    body, prepared, generation = await submitted_as_chat(http, MessagesRequest)
    server: ServerContext = http.app.state.server
    reply = MessageReply(generation, prepared.replies, server.model_id(body.model), len(prepared.choices[0][0]),
                         anthropic.message_id())
    return await replied(http, body, generation, functools.partial(reply.events, http), reply.whole)


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
@cancelled_on_disconnect  # a vanished client's count waiting for a worker is never run
async def count_tokens(http: Request) -> JSONResponse:
    server: ServerContext = http.app.state.server
    body, count = await parsed_as_chat(http, CountTokensRequest,
                                       functools.partial(_prompt_tokens, server.config.limits))
    return JSONResponse({"input_tokens": count}, headers=ignored_fields_headers(body))


def _prompt_tokens(limits: RequestLimits, body: CountTokensRequest, chat: ChatCompletionRequest,
                   inputs: InputProcessor) -> tuple[CountTokensRequest, int]:
    """On the worker that parsed the body: the tools' limits (they are rendered too), then the prompt as the chat
    route makes it."""
    check_tools(chat.tools, limits)
    return body, len(inputs.prompt_tokens(chat_prompt(inputs, chat, limits), "messages"))

