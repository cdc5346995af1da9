"""POST /v1/responses: the Responses API over the chat path, whole or streamed as the SDK's typed events
(response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta/.done, response.function_call_arguments.done, response.output_item.done,
response.completed)."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cobali.engine.request import FinishReason
from cobali.frontend.errors import bad_request
from cobali.frontend.generation import Generation, GenerationError
from cobali.frontend.tool_calls import ParsedCall, ToolCallStream, parse_tool_calls
from cobali.http.disconnect import cancelled_on_disconnect
from cobali.http.parse import json_body, parse_then
from cobali.http.protocol.chat import ChatCompletionRequest
from cobali.http.protocol.responses import FunctionChoice, ResponsesRequest
from cobali.http.protocol.unknown_fields import ignored_fields_headers
from cobali.http.routes.chat import chat_choices
from cobali.http.routes.completions import (
    event_stream,
    preprocessed,
    refuse_when_full,
    served_engine,
    submit,
    until_finished,
)

router = APIRouter()


class ResponseObject:
    """The response and its output items as they grow."""

    def __init__(self, body: ResponsesRequest, model: str, generation: Generation, input_tokens: int) -> None:
        self.body = body
        self.model = model
        self.generation = generation
        self.input_tokens = input_tokens
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = time.time()
        self.tool_names = {t.name for t in body.tools or ()} if body.tool_choice != "none" else set()

    def message(self, text: str, status: str = "completed") -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def function_call(call: ParsedCall) -> dict:
        return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
                "name": call.name, "arguments": call.arguments, "status": "completed"}

    def output(self, text: str, calls: list[ParsedCall]) -> list[dict]:
        return ([self.message(text)] if text else []) + [self.function_call(c) for c in calls]

    def envelope(self, status: str, output: list[dict]) -> dict:
        request = self.generation.requests[0]
        incomplete = status == "completed" and request.finish_reason is FinishReason.LENGTH
        body = self.body
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        response = {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": "incomplete" if incomplete else status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature, "top_p": body.top_p, "tools": tools,
            "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice)
            else (body.tool_choice or "auto"),
            "text": {"format": {"type": "text"}}, "previous_response_id": None, "store": False,
            "metadata": body.metadata or {}, "user": body.user,
        }
        if status != "in_progress":
            output_tokens = len(request.output_tokens)
            response["usage"] = {"input_tokens": self.input_tokens,
                                 "input_tokens_details": {"cached_tokens": request.cached_tokens},
                                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": self.input_tokens + output_tokens}
        return response

    def final(self) -> dict:
        text = self.generation.requests[0].text
        content, calls = parse_tool_calls(text, self.tool_names) if self.tool_names else (text, [])
        return self.envelope("completed", self.output(content or "", calls))


class EventWriter:
    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: object) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _events(reply: ResponseObject) -> AsyncIterator[str]:
    event, stream = EventWriter(), ToolCallStream(reply.tool_names)
    text, opened = "", False
    part = {"item_id": reply.message_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=reply.envelope("in_progress", []))
        yield event("response.in_progress", response=reply.envelope("in_progress", []))
        async for delta in reply.generation.events():
            ready = stream.push(delta.text) if reply.tool_names else delta.text
            calls: list[ParsedCall] = []
            if delta.finished and reply.tool_names:
                rest, calls = stream.finish()
                ready += rest
            if ready and not opened:
                opened = True
                yield event("response.output_item.added", output_index=0, item=reply.message("", "in_progress"))
                yield event("response.content_part.added", **part,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            if ready:
                text += ready
                yield event("response.output_text.delta", **part, delta=ready, logprobs=[])
        if opened:
            yield event("response.output_text.done", **part, text=text, logprobs=[])
            yield event("response.content_part.done", **part, part=reply.message(text)["content"][0])
            yield event("response.output_item.done", output_index=0, item=reply.message(text))
        for index, call in enumerate(calls, start=int(opened)):
            item = reply.function_call(call)
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=call.arguments, name=call.name)
            yield event("response.output_item.done", output_index=index, item=item)
        yield event("response.completed", response=reply.envelope("completed", reply.output(text, calls)))
    except GenerationError as err:  # headers are sent: report in-band
        error = err.api_error()
        yield event("error", code=error.code, message=error.message, param=None)


@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
@cancelled_on_disconnect
async def responses(http: Request) -> Response:
    refuse_when_full(http)
    body, chat = await parse_then(http, ResponsesRequest, _as_chat)
    engine = served_engine(http, body.model)
    if isinstance(chat, ValueError):  # after the model's 404 or 503, as it always came
        raise bad_request(str(chat))
    prepared = await preprocessed(http, engine, chat, 1, functools.partial(chat_choices, http, engine, chat))
    generation = submit(http, chat, prepared)
    reply = ResponseObject(body, http.app.state.server.model_id(body.model), generation, len(prepared[0][0]))
    headers = ignored_fields_headers(body)
    if body.stream:
        return event_stream(http, _events(reply), headers, generation)
    await until_finished(generation)
    return JSONResponse(reply.final(), headers=headers)


def _as_chat(body: ResponsesRequest) -> tuple[ResponsesRequest, ChatCompletionRequest | ValueError]:
    """On the worker that parsed it (it validates the whole body again, as a chat request); what does not fit
    is kept for the route to raise."""
    try:
        return body, body.as_chat()
    except ValueError as err:
        return body, err
