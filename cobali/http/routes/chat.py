"""POST /v1/chat/completions: messages through the chat template, tools in and tool calls out."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cobali.engine.engine import Engine
from cobali.frontend.chat_template import ChatPrompter
from cobali.frontend.errors import bad_request
from cobali.http.disconnect import cancelled_on_disconnect
from cobali.http.parse import json_body
from cobali.http.protocol.chat import ChatCompletionRequest
from cobali.http.render.replies import CHAT
from cobali.http.routes.completions import (
    Choices,
    build_choices,
    generate,
    generation_body,
    preprocessed,
    served_engine,
    tokenize,
)
from cobali.http.state import ServerContext

router = APIRouter()


def chat_prompter(http: Request, engine: Engine) -> ChatPrompter:
    """Built once, on first use: the template is the loaded model's (or the --chat-template override)."""
    state = http.app.state
    if getattr(state, "prompter", None) is None:
        server: ServerContext = state.server
        source = engine.backend.chat_template_source()
        if server.chat_template is not None:
            source = dataclasses.replace(source, text=server.chat_template)
        state.prompter = ChatPrompter(source, engine.backend.apply_chat_template)
    return state.prompter


def chat_prompt_text(http: Request, engine: Engine, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None) -> str:
    """The messages and tools through the chat template; a template that refuses them is a 400."""
    try:
        return chat_prompter(http, engine).prompt(messages, tools)
    except ValueError as err:
        raise bad_request(str(err), "messages") from None


def chat_prompt(http: Request, engine: Engine, body: ChatCompletionRequest) -> list[int]:
    """The prompt's tokens: the messages and active tools through the chat template."""
    messages = [m.as_template_input() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.active_tools] or None
    return tokenize(engine, chat_prompt_text(http, engine, messages, tools), "messages", body.truncate_prompt_tokens)


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
@cancelled_on_disconnect
async def chat_completions(http: Request) -> Response:
    body = await generation_body(http, ChatCompletionRequest)
    engine = served_engine(http, body.model)
    kind = dataclasses.replace(CHAT, tool_names=frozenset(t.function.name for t in body.active_tools))
    prepared = await preprocessed(http, engine, body, 1, functools.partial(chat_choices, http, engine, body))
    return await generate(http, engine, body, prepared, kind)


def chat_choices(http: Request, engine: Engine, body: ChatCompletionRequest) -> Choices:
    """The prompt through the template, tokenized, and the choices' params: on the worker pool."""
    return build_choices(engine, body, [chat_prompt(http, engine, body)], http.app.state.server.limits)
