"""POST /v1/completions: prompts (text or token ids) tokenized as sent, their replies all content; the prompts
echoed back when asked. The generation path it shares with the other routes is cobali/http/generation.py."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cobali.frontend.inputs import Choices, InputProcessor
from cobali.frontend.request_limits import RequestLimits
from cobali.http.disconnect import cancelled_on_disconnect
from cobali.http.generation import generate, prepared_body
from cobali.http.parse import json_body
from cobali.http.protocol.completions import CompletionRequest
from cobali.http.render.replies import COMPLETION
from cobali.http.request_route import RequestRoute

router = APIRouter(route_class=RequestRoute)


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
@cancelled_on_disconnect
async def completions(http: Request) -> Response:
    work = functools.partial(_completion_choices, http.app.state.server.config.limits)
    body, inputs, (prepared, echoes) = await prepared_body(http, CompletionRequest, _n_prompts, work)
    return await generate(http, inputs, body, prepared, COMPLETION, echoes)


def _n_prompts(body: CompletionRequest) -> int:
    return len(body.prompts())


def _completion_choices(limits: RequestLimits, inputs: InputProcessor,
                        body: CompletionRequest) -> tuple[Choices, list[str] | None]:
    prompts = [inputs.prompt_tokens(p, "prompt", body.truncate_prompt_tokens) for p in body.prompts()]
    echoes = None
    if body.echo:  # the prompt as sent; token-id or truncated prompts are rendered from their tokens
        echoes = [p if isinstance(p, str) and body.truncate_prompt_tokens is None else inputs.tokenizer.decode(t)
                  for p, t in zip(body.prompts(), prompts, strict=True)]
    return inputs.choices(body, prompts, limits), echoes
