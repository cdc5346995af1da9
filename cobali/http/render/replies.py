"""The response shapes of /v1/completions and /v1/chat/completions, whole and streamed."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as json_string

from cobali.frontend.generation import Generation
from cobali.frontend.inputs import ReplyReader
from cobali.frontend.interface import RequestOutput, TokenLogprob
from cobali.frontend.parsers.calls import ParsedCall
from cobali.frontend.parsers.reply import ReplyDelta, ReplyStream
from cobali.frontend.parsers.stream import read_piece
from cobali.http.render.logprobs import LogprobWriter


@dataclass(frozen=True)
class Kind:
    """What differs between the routes: object names, how a choice carries its text, and (chat) how its reply is
    read: its reasoning and its tool calls apart from its content (None: the reply is all content)."""

    chat: bool
    replies: ReplyReader | None = None

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def choice(self, index: int, text: str, last: RequestOutput | None, logprobs: dict | None) -> dict:
        """A whole choice; last: its final output."""
        reason = finish_reason(last)
        stop_reason = last.stop_reason if last is not None else None
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                    "stop_reason": stop_reason}
        read = self.replies.whole(text) if self.replies is not None else ReplyDelta(content=text)
        return {"index": index, "message": chat_message(read), "logprobs": logprobs,
                "finish_reason": "tool_calls" if read.calls else reason, "stop_reason": stop_reason}

    def chunk_choice(self, index: int, text: str, reason: str | None, logprobs: dict | None,
                     stop_reason: str | int | None = None, reasoning: str = "", calls: Sequence[dict] = ()) -> dict:
        """stop_reason (vLLM's): what ended the choice, in its last chunk; calls: rendered, with their index."""
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason,
                    "stop_reason": stop_reason}
        delta: dict = {"reasoning_content": reasoning} if reasoning else {}
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = list(calls)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": stop_reason}

    def text_chunk_choices(self, index: int, text: str) -> str:
        """JSON of [chunk_choice(index, text, None, None)] for a non-empty text, from a template: most chunks
        are just that, and rendering dicts costs far more (a stream serves every token through here)."""
        rest = ',"logprobs":null,"finish_reason":null,"stop_reason":null}]'
        if self.chat:
            return f'[{{"index":{index},"delta":{{"content":{json_string(text)}}}{rest}'
        return f'[{{"index":{index},"text":{json_string(text)}{rest}'


def chat_message(read: ReplyDelta) -> dict:
    """A whole chat reply: its content (null where reasoning or calls left none), its reasoning (vLLM's
    reasoning_content, null where there is none) and its calls."""
    message: dict = {"role": "assistant", "content": read.content or (None if read.reasoning or read.calls else ""),
                     "reasoning_content": read.reasoning or None}
    if read.calls:
        message["tool_calls"] = [c.as_openai() for c in read.calls]
    return message


class ChoiceReading:
    """One streamed chat choice's reply through its parsers; its calls are numbered across the whole reply."""

    def __init__(self, stream: ReplyStream) -> None:
        self.stream = stream
        self.calls = 0  # calls sent so far

    def read(self, text: str, finished: bool) -> ReplyDelta:
        return read_piece(self.stream, text, last=finished)

    def rendered_calls(self, calls: Sequence[ParsedCall]) -> list[dict]:
        rendered = [call.as_openai(self.calls + i) for i, call in enumerate(calls)]
        self.calls += len(calls)
        return rendered


COMPLETION, CHAT = Kind(chat=False), Kind(chat=True)


def finish_reason(output: RequestOutput | None) -> str | None:
    return output.finish_reason.value if output is not None and output.finish_reason is not None else None


class Reply:
    """The envelope shared by a response and all of its stream chunks."""

    def __init__(self, kind: Kind, model: str, generation: Generation, per_prompt: int,
                 logprobs: LogprobWriter | None, echoes: list[str] | None = None,
                 continuous_usage: bool = False,
                 prompt_logprobs: Callable[[Sequence[TokenLogprob]], list[dict | None]] | None = None) -> None:
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
        n = len(generation.request_ids)
        replies = kind.replies
        self._readings = [ChoiceReading(replies.stream()) for _ in range(n)] if replies is not None else None
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
        choices = self.generation.choices
        completion = sum(c.n_tokens for c in choices)
        # Each prompt counts once however many choices share it; so do its cached tokens (its first choice's).
        firsts = choices[:: self._per_prompt]
        prompt = sum(c.n_prompt_tokens for c in firsts)
        cached = sum(c.last.cached_tokens for c in firsts if c.last is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def new_logprobs(self, index: int, entries: Sequence[TokenLogprob],
                     prompt_logprobs: Sequence[TokenLogprob] | None) -> dict | None:
        """Choice `index`'s logprobs not reported yet: `entries` (an output's, or all of them)."""
        return self.logprobs.render(index, entries, prompt_logprobs) if self.logprobs else None

    def echo(self, index: int) -> str:
        """The echoed prompt of choice `index` the first time it is asked for, then ''."""
        if self._echoes is None:
            return ""
        text, self._echoes[index] = self._echoes[index], ""
        return text

    def full(self) -> dict:
        got = self.generation.choices
        choices = [self.kind.choice(i, self.echo(i) + c.text, c.last,
                                    self.new_logprobs(i, c.logprobs, c.prompt_logprobs)) for i, c in enumerate(got)]
        body = self.envelope(self.kind.object, choices, usage=True)
        # vLLM: per choice in completions, once for a chat's one prompt
        if self.prompt_logprobs is not None and self.kind.chat:
            body["prompt_logprobs"] = self.prompt_logprobs(got[0].prompt_logprobs or ())
        elif self.prompt_logprobs is not None:
            for rendered, choice in zip(choices, got, strict=True):
                rendered["prompt_logprobs"] = self.prompt_logprobs(choice.prompt_logprobs or ())
        return body

    def opening(self) -> str | None:
        """OpenAI opens each streamed chat choice with the role."""
        if not self.kind.chat:
            return None
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(len(self.generation.request_ids))],
                          self.usage_so_far(0, 0) if self.continuous_usage else None)

    def finishes_reading(self, outputs: Sequence[RequestOutput]) -> bool:
        """Whether reading these ends a choice's parsers: their finish() costs O(what they held), so the read is
        for the worker pool, not the event loop (the feeds before cost O(their text))."""
        return self._readings is not None and any(output.finished for output in outputs)

    def read(self, outputs: Sequence[RequestOutput]) -> list[ReplyDelta]:
        """Each output's new text through its choice's parsers (the echoed prompt first, once)."""
        reads = []
        for output in outputs:
            index = self.generation.index_of(output)
            text = self.echo(index) + output.text
            reading = self._readings[index] if self._readings is not None else None
            reads.append(reading.read(text, output.finished) if reading is not None else ReplyDelta(content=text))
        return reads

    def delta_chunk(self, output: RequestOutput, read: ReplyDelta) -> str:
        """The chunk of an output, `read` its text."""
        index = self.generation.index_of(output)
        reading = self._readings[index] if self._readings is not None else None
        if self._is_plain(output, read):
            return f"{self._chunk_head}{self.kind.text_chunk_choices(index, read.content)}}}\n\n"
        reason = finish_reason(output) if output.finished else None
        calls = reading.rendered_calls(read.calls) if reading is not None else []
        if reason is not None and reading is not None and reading.calls:
            reason = "tool_calls"
        logprobs = self.new_logprobs(index, output.logprobs, output.prompt_logprobs)
        choice = self.kind.chunk_choice(index, read.content, reason, logprobs, output.stop_reason, read.reasoning,
                                        calls)
        return self.chunk([choice], self.usage_so_far(index, output.n_tokens) if self.continuous_usage else None)

    def _is_plain(self, output: RequestOutput, read: ReplyDelta) -> bool:
        """Content alone: not the end, no reasoning or calls, no logprobs, no usage."""
        return (bool(read.content) and not output.finished and not read.reasoning and not read.calls
                and self.logprobs is None and not self.continuous_usage)

    def usage_so_far(self, index: int, completion_tokens: int) -> dict:
        """A chunk's usage under continuous_usage_stats: choice `index`'s own prompt, and its tokens so far (vLLM)."""
        prompt = self.generation.choices[index].n_prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        tail = f',"usage":{encode_json(usage)}}}' if usage is not None else "}"
        return f"{self._chunk_head}{encode_json(choices)}{tail}\n\n"


# One encoder for all: json.dumps with options other than the defaults builds a new one on every call.
encode_json = json.JSONEncoder(separators=(",", ":")).encode


def sse(payload: dict) -> str:
    return f"data: {encode_json(payload)}\n\n"
