"""POST /v1/chat/completions: messages through the chat template, tools in; reasoning and tool calls read out of
the reply by the model's parsers."""

from __future__ import annotations

import dataclasses
import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cobali.frontend.generation import EngineUnavailable
from cobali.frontend.inputs import ChatChoices, InputProcessor, ReplyReader
from cobali.frontend.request_limits import RequestLimits
from cobali.http.disconnect import cancelled_on_disconnect
from cobali.http.generation import generate, prepared_body
from cobali.http.parse import json_body
from cobali.http.protocol.chat import ChatCompletionRequest
from cobali.http.render.replies import CHAT
from cobali.http.request_route import RequestRoute

router = APIRouter(route_class=RequestRoute)


def chat_prompt(inputs: InputProcessor, body: ChatCompletionRequest, limits: RequestLimits) -> str:
    """The messages and active tools through the chat template, with the request's own variables."""
    messages = [m.as_template_input() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.active_tools] or None
    return inputs.chat_text(messages, tools, body.chat_template_kwargs, limits)


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
@cancelled_on_disconnect
async def chat_completions(http: Request) -> Response:
    body, inputs, prepared = await prepared_body(http, ChatCompletionRequest, one_prompt,
                                                 functools.partial(chat_choices, http),
                                                 functools.partial(_template_compiled, http))
    return await generate(http, inputs, body, prepared.choices, dataclasses.replace(CHAT, replies=prepared.replies))


def _template_compiled(http: Request, _body: ChatCompletionRequest) -> bool:
    """Whether the chat template and the reply parsers it picks are built: the first chat request builds them on
    a worker (a template compiles slowly); till then none is prepared on the event loop (prepared_body)."""
    try:
        inputs = http.app.state.server.inputs()
    except EngineUnavailable:
        return False  # the route's 503, answered from its job
    return inputs.chat_ready


def one_prompt(_body: ChatCompletionRequest) -> int:
    return 1


def chat_choices(http: Request, inputs: InputProcessor, body: ChatCompletionRequest) -> ChatChoices:
    """The prompt through the template, tokenized, the choices' params (a forced call in the model's own
    format), and how their replies are read: on the worker pool, or on the loop for a short light body
    (prepared_body)."""
    limits = http.app.state.server.config.limits
    prompt = chat_prompt(inputs, body, limits)
    tokens = inputs.prompt_tokens(prompt, "messages", body.truncate_prompt_tokens)
    choices = inputs.choices(body.for_model_writing(inputs.parsers.tools), [tokens], limits)
    return inputs.chat_choices(choices, ReplyReader(inputs.parsers, prompt, body.tool_schemas()))
