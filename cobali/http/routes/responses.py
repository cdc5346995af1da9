"""POST /v1/responses: the Responses API over the chat path, whole or streamed as the SDK's typed events
(response.created, response.in_progress; per output item response.output_item.added, response.content_part.added,
response.reasoning_text.delta/.done or response.output_text.delta/.done, response.content_part.done,
response.output_item.done, or for a call response.function_call_arguments.done; then response.completed).

The reply is read by the model's parsers: its reasoning is a `reasoning` item before the message, its tool calls
`function_call` items after it."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cobali.frontend.generation import Generation, GenerationError
from cobali.frontend.inputs import ReplyReader
from cobali.frontend.interface import FinishReason
from cobali.frontend.parsers.calls import ParsedCall
from cobali.frontend.parsers.reply import ReplyDelta
from cobali.http.disconnect import cancelled_on_disconnect
from cobali.http.generation import read_off_loop, replied
from cobali.http.parse import json_body
from cobali.http.protocol.responses import FunctionChoice, ResponsesRequest
from cobali.http.request_route import RequestRoute
from cobali.http.routes.as_chat import submitted_as_chat

router = APIRouter(route_class=RequestRoute)
REASONING, MESSAGE = "reasoning", "message"  # the kinds of text item
_ID_PREFIX = {REASONING: "rs", MESSAGE: "msg"}
_TEXT = {REASONING: "reasoning_text", MESSAGE: "output_text"}  # their parts' type, and their events' names


def new_item_id(kind: str) -> str:
    return f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}"


def text_part(kind: str, text: str) -> dict:
    if kind == REASONING:
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def text_item(kind: str, item_id: str, text: str, status: str = "completed") -> dict:
    """A reasoning item or the message, with its one part once it has text."""
    content = [text_part(kind, text)] if text else []
    if kind == REASONING:
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(call: ParsedCall) -> dict:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}


class ResponseObject:
    """The response around its output items."""

    def __init__(self, body: ResponsesRequest, model: str, generation: Generation, input_tokens: int,
                 replies: ReplyReader) -> None:
        self.body = body
        self.model = model
        self.generation = generation
        self.input_tokens = input_tokens
        self.replies = replies
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = time.time()

    def envelope(self, status: str, output: list[dict]) -> dict:
        choice = self.generation.choices[0]
        last = choice.last
        incomplete = status == "completed" and last is not None and last.finish_reason is FinishReason.LENGTH
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
            output_tokens = choice.n_tokens
            cached = last.cached_tokens if last is not None else 0
            response["usage"] = {"input_tokens": self.input_tokens,
                                 "input_tokens_details": {"cached_tokens": cached},
                                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": self.input_tokens + output_tokens}
        return response

    def final(self) -> dict:
        read = self.replies.whole(self.generation.choices[0].text)
        output = [text_item(kind, new_item_id(kind), text)
                  for kind, text in ((REASONING, read.reasoning), (MESSAGE, read.content)) if text]
        return self.envelope("completed", output + [function_call_item(c) for c in read.calls])


class EventWriter:
    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: object) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


class StreamedOutput:
    """The output items as a stream writes them: a run of reasoning or of content is an item (a reasoning item,
    a message), opened at its first text and done when text of the other kind, a call or the end comes; each call
    is an item, done at once."""

    def __init__(self, event: EventWriter) -> None:
        self.event = event
        self.done: list[dict] = []  # the items done, in order
        self._open: tuple[str, str] | None = None  # the open text item: its kind and id
        self._text: list[str] = []  # its text so far

    def read(self, read: ReplyDelta) -> Iterator[str]:
        yield from self._write(REASONING, read.reasoning)
        yield from self._write(MESSAGE, read.content)
        yield from self._calls(read.calls)

    def close(self) -> Iterator[str]:
        """The open text item, done."""
        if self._open is None:
            return
        kind, item_id = self._open
        text, index = "".join(self._text), len(self.done)
        part = {"item_id": item_id, "output_index": index, "content_index": 0}
        yield self.event(f"response.{_TEXT[kind]}.done", **part, text=text, **_logprobs(kind))
        yield self.event("response.content_part.done", **part, part=text_part(kind, text))
        item = text_item(kind, item_id, text)
        yield self.event("response.output_item.done", output_index=index, item=item)
        self.done.append(item)
        self._open, self._text = None, []

    def _write(self, kind: str, delta: str) -> Iterator[str]:
        if not delta:
            return
        if self._open is None or self._open[0] != kind:
            yield from self.close()
            self._open = kind, new_item_id(kind)
            yield self.event("response.output_item.added", output_index=len(self.done),
                             item=text_item(kind, self._open[1], "", "in_progress"))
            yield self.event("response.content_part.added", **self._part(), part=text_part(kind, ""))
        self._text.append(delta)
        yield self.event(f"response.{_TEXT[kind]}.delta", **self._part(), delta=delta, **_logprobs(kind))

    def _part(self) -> dict:
        assert self._open is not None
        return {"item_id": self._open[1], "output_index": len(self.done), "content_index": 0}

    def _calls(self, calls: Sequence[ParsedCall]) -> Iterator[str]:
        if calls:
            yield from self.close()
        for call in calls:
            item, index = function_call_item(call), len(self.done)
            yield self.event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=call.arguments, name=call.name)
            yield self.event("response.output_item.done", output_index=index, item=item)
            self.done.append(item)


def _logprobs(kind: str) -> dict:
    """Output text's events carry logprobs (none are asked for here); reasoning text's have no such field."""
    return {"logprobs": []} if kind == MESSAGE else {}


async def _events(http: Request, reply: ResponseObject) -> AsyncIterator[str]:
    event, stream = EventWriter(), reply.replies.stream()
    output = StreamedOutput(event)
    try:
        yield event("response.created", response=reply.envelope("in_progress", []))
        yield event("response.in_progress", response=reply.envelope("in_progress", []))
        async for got in reply.generation.events():
            for text in output.read(stream.feed(got.text)):
                yield text
            if got.finished:
                for text in (*output.read(await read_off_loop(http, stream.finish)), *output.close()):
                    yield text
        yield event("response.completed", response=reply.envelope("completed", output.done))
    except GenerationError as err:  # headers are sent: report in-band
        error = err.api_error()
        yield event("error", code=error.code, message=error.message, param=None)


@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
@cancelled_on_disconnect
async def responses(http: Request) -> Response:
    body, prepared, generation = await submitted_as_chat(http, ResponsesRequest)
    reply = ResponseObject(body, http.app.state.server.model_id(body.model), generation,
                           len(prepared.choices[0][0]), prepared.replies)
    return await replied(http, body, generation, functools.partial(_events, http, reply), reply.final)
