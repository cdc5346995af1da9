"""The response shapes of /v1/completions and /v1/chat/completions, whole and streamed."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as json_string

from cobali.engine.request import Request as EngineRequest
from cobali.frontend.generation import Delta, Generation
from cobali.frontend.tool_calls import ParsedCall, ToolCallStream, parse_tool_calls
from cobali.http.render.logprobs import LogprobWriter


@dataclass(frozen=True)
class Kind:
    """What differs between the routes: object names, how a choice carries its text, and (chat) the tools
    whose calls are read from the output."""

    chat: bool
    tool_names: frozenset[str] = field(default_factory=frozenset)

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def choice(self, index: int, text: str, request: EngineRequest, logprobs: dict | None) -> dict:
        reason = finish_reason(request)
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                    "stop_reason": request.stop_reason}
        message: dict = {"role": "assistant", "content": text}
        if self.tool_names:
            content, calls = parse_tool_calls(text, set(self.tool_names))
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [c.as_openai() for c in calls]}
                reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": request.stop_reason}

    def chunk_choice(self, index: int, text: str, reason: str | None, logprobs: dict | None,
                     calls: Sequence[ParsedCall] = (), stop_reason: str | int | None = None) -> dict:
        """stop_reason (vLLM's): what ended the choice, in its last chunk."""
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                    "stop_reason": stop_reason}
        delta: dict = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = [c.as_openai(i) for i, c in enumerate(calls)]
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": stop_reason}

    def text_chunk_choices(self, index: int, text: str) -> str:
        """JSON of [chunk_choice(index, text, None, None)] for a non-empty text, from a template: most chunks
        are just that, and rendering dicts costs ~40x more (a stream serves every token through here)."""
        rest = ',"logprobs":null,"finish_reason":null,"stop_reason":null}]'
        if self.chat:
            return f'[{{"index":{index},"delta":{{"content":{json_string(text)}}}{rest}'
        return f'[{{"index":{index},"text":{json_string(text)}{rest}'


COMPLETION, CHAT = Kind(chat=False), Kind(chat=True)


def finish_reason(request: EngineRequest) -> str | None:
    return request.finish_reason.value if request.finish_reason is not None else None


class Reply:
    """The envelope shared by a response and all of its stream chunks."""

    def __init__(self, kind: Kind, model: str, generation: Generation, per_prompt: int,
                 logprobs: LogprobWriter | None, echoes: list[str] | None = None,
                 continuous_usage: bool = False,
                 prompt_logprobs: Callable[[EngineRequest], list[dict | None]] | None = None) -> None:
        self.kind = kind
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs, rendered (logprobs.prompt_logprobs)
        self.continuous_usage = continuous_usage  # vLLM's continuous_usage_stats: usage in every chunk
        self.logprobs = logprobs
        self._echoes = echoes  # per choice, the prompt text that opens it (completions' echo)
        self.id = f"{'chatcmpl' if kind.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.generation = generation
        self._per_prompt = per_prompt  # choices (n) per prompt: the requests run prompt by prompt, n each
        n = len(generation.requests)
        self._tool_streams = [ToolCallStream(set(kind.tool_names)) for _ in range(n)] if kind.tool_names else None
        # A chunk is this envelope's JSON with the choices (and usage) appended: rendered once, not per chunk.
        head = encode_json(self.envelope(kind.chunk_object, [], usage=False))
        self._chunk_head = "data: " + head[: head.rindex("[")]

    def envelope(self, object_name: str, choices: list[dict], usage: bool) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if usage:
            body["usage"] = self.usage()
        return body

    def usage(self) -> dict:
        completion = sum(len(r.output_tokens) for r in self.generation.requests)
        # Each prompt counts once however many choices share it; so do its cached tokens (its first choice's).
        firsts = self.generation.requests[:: self._per_prompt]
        prompt = sum(len(r.prompt_tokens) for r in firsts)
        cached = sum(r.cached_tokens for r in firsts)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def new_logprobs(self, index: int, end: int | None = None) -> dict | None:
        """The logprobs of choice `index`'s tokens not reported yet, up to token `end` (None: all of them)."""
        return self.logprobs.render_new(index, self.generation.requests[index], end) if self.logprobs else None

    def echo(self, index: int) -> str:
        """The echoed prompt of choice `index` the first time it is asked for, then ''."""
        if self._echoes is None:
            return ""
        text, self._echoes[index] = self._echoes[index], ""
        return text

    def full(self) -> dict:
        requests = self.generation.requests
        choices = [self.kind.choice(i, self.echo(i) + r.text, r, self.new_logprobs(i)) for i, r in enumerate(requests)]
        body = self.envelope(self.kind.object, choices, usage=True)
        # vLLM: per choice in completions, once for a chat's one prompt
        if self.prompt_logprobs is not None and self.kind.chat:
            body["prompt_logprobs"] = self.prompt_logprobs(requests[0])
        elif self.prompt_logprobs is not None:
            for choice, request in zip(choices, requests, strict=True):
                choice["prompt_logprobs"] = self.prompt_logprobs(request)
        return body

    def opening(self) -> str | None:
        """OpenAI opens each streamed chat choice with the role."""
        if not self.kind.chat:
            return None
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(len(self.generation.requests))],
                          self.usage_so_far(0, 0) if self.continuous_usage else None)

    def delta_chunk(self, delta: Delta) -> str:
        if self._is_plain(delta):
            return f"{self._chunk_head}{self.kind.text_chunk_choices(delta.index, delta.text)}}}\n\n"
        request = self.generation.requests[delta.index]
        reason = finish_reason(request) if delta.finished else None
        text, calls = self.echo(delta.index) + delta.text, []
        if self._tool_streams is not None:
            stream = self._tool_streams[delta.index]
            text = stream.push(text)
            if delta.finished:
                rest, calls = stream.finish()
                text += rest
                reason = "tool_calls" if calls else reason
        logprobs = self.new_logprobs(delta.index, delta.n_tokens)  # the engine may be tokens ahead by now
        choice = self.kind.chunk_choice(delta.index, text, reason, logprobs, calls,
                                        request.stop_reason if delta.finished else None)
        return self.chunk([choice], self.usage_so_far(delta.index, delta.n_tokens) if self.continuous_usage else None)

    def _is_plain(self, delta: Delta) -> bool:
        """Text alone: not the end, no logprobs, no tool calls to look for, no echo still to send, no usage."""
        return (bool(delta.text) and not delta.finished and self.logprobs is None and self._tool_streams is None
                and not (self._echoes and self._echoes[delta.index]) and not self.continuous_usage)

    def usage_so_far(self, index: int, completion_tokens: int) -> dict:
        """A chunk's usage under continuous_usage_stats: choice `index`'s own prompt, and its tokens so far (vLLM)."""
        prompt = len(self.generation.requests[index].prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        tail = f',"usage":{encode_json(usage)}}}' if usage is not None else "}"
        return f"{self._chunk_head}{encode_json(choices)}{tail}\n\n"


# One encoder for all: json.dumps with options other than the defaults builds a new one on every call.
encode_json = json.JSONEncoder(separators=(",", ":")).encode


def sse(payload: dict) -> str:
    return f"data: {encode_json(payload)}\n\n"
