"""Anthropic's Messages API shapes: a whole message, its stream of events, and its errors.

A stream is message_start, then for each content block (thinking, text, tool_use) content_block_start, its
deltas and content_block_stop, then message_delta (the stop reason and the usage) and message_stop.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from cobali.frontend.interface import FinishReason, RequestOutput
from cobali.frontend.parsers.calls import ParsedCall
from cobali.frontend.parsers.reply import ReplyDelta

# Anthropic's error types by HTTP status (its API reference, "Errors").
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0

    def as_anthropic(self) -> dict:
        # Cached prompt tokens are read from the prefix cache, and counted apart as Anthropic does.
        return {"input_tokens": self.input_tokens - self.cached_tokens, "output_tokens": self.output_tokens,
                "cache_read_input_tokens": self.cached_tokens, "cache_creation_input_tokens": 0}


def final_usage(input_tokens: int, last: RequestOutput) -> Usage:
    return Usage(input_tokens, last.n_tokens, last.cached_tokens)


def stop_reason(last: RequestOutput, calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the chat path's finish: tool calls, the length limit, a stop
    sequence, or the end of the turn."""
    if calls:
        return "tool_use", None
    if last.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if isinstance(last.stop_reason, str):
        return "stop_sequence", last.stop_reason
    return "end_turn", None


def tool_use(call: ParsedCall) -> dict:
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name,
            "input": json.loads(call.arguments)}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def message(id_: str, model: str, reply: ReplyDelta, reason: tuple[str, str | None], usage: Usage) -> dict:
    """The whole reply: thinking first, then text, then the tool calls."""
    content: list[dict] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content or not (reply.reasoning or reply.calls):
        content.append({"type": "text", "text": reply.content})
    content += [tool_use(c) for c in reply.calls]
    return {"id": id_, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage.as_anthropic()}


def event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class MessageStream:
    """The events of one streamed reply, as its deltas come: each kind of content opens a block of its own."""

    id: str
    model: str
    called: bool = False  # whether a tool_use block was written
    _index: int = -1
    _open: str | None = None  # the kind of the block being written: "thinking" or "text"

    def start(self, usage: Usage) -> list[str]:
        envelope: dict = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": usage.as_anthropic()}
        return [event({"type": "message_start", "message": envelope})]

    def delta(self, reply: ReplyDelta) -> list[str]:
        out: list[str] = []
        if reply.reasoning:
            out += self._write("thinking", {"type": "thinking_delta", "thinking": reply.reasoning})
        if reply.content:
            out += self._write("text", {"type": "text_delta", "text": reply.content})
        for call in reply.calls:
            self.called = True
            out += self._close()
            self._index += 1
            block = tool_use(call)
            out.append(event({"type": "content_block_start", "index": self._index,
                              "content_block": block | {"input": {}}}))
            out.append(event({"type": "content_block_delta", "index": self._index,
                              "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))
            out.append(event({"type": "content_block_stop", "index": self._index}))
        return out

    def finish(self, reason: tuple[str, str | None], usage: Usage) -> list[str]:
        """The last events; usage: the whole reply's (a message_delta's counts are totals, not increments)."""
        out = self._close()
        if self._index < 0:  # an empty reply still has its one (empty) text block
            out += self._write("text", None) + self._close()
        out.append(event({"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                          "usage": usage.as_anthropic()}))
        out.append(event({"type": "message_stop"}))
        return out

    def _write(self, kind: str, delta: dict | None) -> list[str]:
        out: list[str] = []
        if self._open != kind:
            out += self._close()
            self._index += 1
            self._open = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {
                "type": "text", "text": ""}
            out.append(event({"type": "content_block_start", "index": self._index, "content_block": block}))
        if delta is not None:
            out.append(event({"type": "content_block_delta", "index": self._index, "delta": delta}))
        return out

    def _close(self) -> list[str]:
        if self._open is None:
            return []
        out = []
        if self._open == "thinking":  # the SDK expects a signature; this server signs nothing
            out.append(event({"type": "content_block_delta", "index": self._index,
                              "delta": {"type": "signature_delta", "signature": ""}}))
        self._open = None
        return [*out, event({"type": "content_block_stop", "index": self._index})]
