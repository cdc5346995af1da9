"""Anthropic's Messages and the Responses API ride the chat path: their body becomes a chat request on the
worker that parsed it, then goes the chat route's way (the same limits, template, grammar and queue)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from cobali.frontend.errors import bad_request
from cobali.frontend.generation import Generation
from cobali.frontend.inputs import ChatChoices, InputProcessor
from cobali.http.generation import inputs_for, refuse_when_full, submit, within_limits
from cobali.http.parse import parse_then
from cobali.http.protocol.chat import ChatCompletionRequest
from cobali.http.protocol.messages import MessagesInput
from cobali.http.protocol.responses import ResponsesRequest
from cobali.http.routes.chat import chat_choices

B = TypeVar("B", bound=MessagesInput | ResponsesRequest)
T = TypeVar("T")


async def parsed_as_chat(http: Request, model: type[B],
                         then: Callable[[B, ChatCompletionRequest, InputProcessor], T]) -> T:
    """then(body, the same request for the chat route, how this server's model prepares it), on the worker that
    parsed the body (the chat request validates the whole body again)."""
    return await parse_then(http, model, lambda body: then(body, *_as_chat(http, body)))


def _as_chat(http: Request, body: B) -> tuple[ChatCompletionRequest, InputProcessor]:
    """What does not fit a chat request is the client's 400, raised after the model's 404 or 503, in the order
    every route answers."""
    try:
        chat, unfit = body.as_chat(), None
    except ValueError as err:
        chat, unfit = None, err
    inputs = inputs_for(http, body.model)
    if chat is None:
        raise bad_request(str(unfit))
    return chat, inputs


async def submitted_as_chat(http: Request, model: type[B]) -> tuple[B, ChatChoices, Generation]:
    """The body (parsed unless the queue is already full), its choices prepared as the chat route prepares them,
    in the same job, and their generation."""
    refuse_when_full(http)

    def prepared(body: B, chat: ChatCompletionRequest, inputs: InputProcessor) -> tuple[B, ChatCompletionRequest,
                                                                                        ChatChoices]:
        within_limits(http, inputs, chat, 1)
        return body, chat, chat_choices(http, inputs, chat)

    body, chat, choices = await parsed_as_chat(http, model, prepared)
    return body, choices, submit(http, chat, choices.choices)
