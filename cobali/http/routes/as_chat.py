"""Anthropic's Messages and the Responses API ride the chat path: their body becomes a chat request on the
worker that parsed it, then goes the chat route's way (the same limits, template, grammar and queue)."""

from __future__ import annotations

import functools
from typing import TypeVar

from fastapi import Request

from cobali.frontend.errors import bad_request
from cobali.frontend.generation import Generation
from cobali.frontend.inputs import ChatChoices, InputProcessor
from cobali.http.generation import inputs_for, preprocessed, refuse_when_full, submit
from cobali.http.parse import parse_then
from cobali.http.protocol.chat import ChatCompletionRequest
from cobali.http.protocol.messages import MessagesInput
from cobali.http.protocol.responses import ResponsesRequest
from cobali.http.routes.chat import chat_choices

B = TypeVar("B", bound=MessagesInput | ResponsesRequest)


async def parsed_as_chat(http: Request, model: type[B]) -> tuple[B, ChatCompletionRequest, InputProcessor]:
    """The body, the same request for the chat route, and how this server's model prepares it. What does not fit
    a chat request is the client's 400, raised after the model's 404 or 503, in the order every route answers."""
    body, chat = await parse_then(http, model, _with_chat)
    inputs = inputs_for(http, body.model)
    if isinstance(chat, ValueError):
        raise bad_request(str(chat))
    return body, chat, inputs


async def submitted_as_chat(http: Request, model: type[B]) -> tuple[B, ChatChoices, Generation]:
    """The body (parsed unless the queue is already full), its choices prepared as the chat route prepares them,
    and their generation."""
    refuse_when_full(http)
    body, chat, inputs = await parsed_as_chat(http, model)
    prepared = await preprocessed(http, inputs, chat, 1, functools.partial(chat_choices, http, inputs, chat))
    return body, prepared, submit(http, chat, prepared.choices)


def _with_chat(body: B) -> tuple[B, ChatCompletionRequest | ValueError]:
    """On the worker that parsed it (the chat request validates the whole body again); what does not fit is
    kept, for the route to raise in its turn."""
    try:
        return body, body.as_chat()
    except ValueError as err:
        return body, err
