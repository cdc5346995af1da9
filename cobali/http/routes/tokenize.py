"""POST /tokenize and /detokenize, with vLLM's request and response shapes.

A client counts a prompt's tokens before sending it (to fit the context, or to price it): the count must be the
one generation will use, so a prompt is tokenized as /v1/completions tokenizes it, and messages go through the
chat template exactly as /v1/chat/completions sends them.
"""

from __future__ import annotations

import functools
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from cobali.frontend.inputs import InputProcessor
from cobali.frontend.request_limits import RequestLimits, check_tools
from cobali.frontend.work_pool import client_of
from cobali.http.generation import inputs_for
from cobali.http.parse import json_body, parse_body
from cobali.http.protocol.bodies import RequestBody
from cobali.http.protocol.chat import ChatMessage, Tool
from cobali.http.protocol.unknown_fields import ignored_fields_headers
from cobali.http.state import ServerContext

router = APIRouter()


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None  # at most --max-tools
    # The chat route always ends the prompt where the reply starts; a count of anything else would mislead.
    add_generation_prompt: Literal[True] = True
    add_special_tokens: bool = True  # as both generation routes tokenize (a template's own BOS is not doubled)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize_route(http: Request) -> JSONResponse:
    body = await parse_body(http, TokenizeRequest)
    inputs = inputs_for(http, body.model)
    server: ServerContext = http.app.state.server
    work = functools.partial(_tokenized, inputs, body, server.config.limits)
    reply = await server.pool.run(client_of(http), work)
    return JSONResponse(reply, headers=ignored_fields_headers(body))


def _tokenized(inputs: InputProcessor, body: TokenizeRequest, limits: RequestLimits) -> dict:
    """On the worker pool: the tools' limits (their JSON is measured), the template, the tokens and their texts.
    A text that cannot fit the context is refused as generation refuses it, before it is tokenized (the chat
    template stops writing there); one that may fit is counted, its count beside max_model_len."""
    check_tools(body.tools, limits)
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()] or None
        text = inputs.chat_text([m.as_template_input() for m in body.messages], tools, None, limits)
    else:
        assert body.prompt is not None
        text = body.prompt
        inputs.check_length(text, "prompt")
    tokenizer = inputs.tokenizer
    tokens = tokenizer.encode(text, body.add_special_tokens)
    strs = None
    if body.return_token_strs:
        strs = [tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in tokens]
    return {"count": len(tokens), "max_model_len": inputs.model.max_model_len, "tokens": tokens,
            "token_strs": strs}


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize_route(http: Request) -> JSONResponse:
    body = await parse_body(http, DetokenizeRequest)
    inputs = inputs_for(http, body.model)
    server: ServerContext = http.app.state.server
    text = await server.pool.run(client_of(http), functools.partial(_detokenized, inputs, body.tokens))
    return JSONResponse({"prompt": text}, headers=ignored_fields_headers(body))


def _detokenized(inputs: InputProcessor, tokens: list[int]) -> str:
    """On the worker pool: up to a million ids checked, then their text."""
    inputs.check_token_ids(tokens, "token ids", "tokens")
    return inputs.tokenizer.decode(tokens)
