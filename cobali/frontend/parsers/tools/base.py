"""The frame every tool-call format runs in: a stream that asks its format, at the first text not yet sent, how
much of it is plain text, how much is a call, or whether it must wait for more; a whole reply is one feed and the
finish. And the forced-call grammar of a format whose arguments are JSON."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from cobali.frontend.parsers.calls import ParsedCall, ToolSchemas, openai_call_id, tool_schemas
from cobali.frontend.parsers.text import held_tail
from cobali.structured.grammars import JSON_OPTIONS, MAX_PARALLEL_CALLS, prepared

Functions = Sequence[tuple[str, Any]]  # a forced call's choices: (name, parameters schema or None)


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class Context:
    tools: ToolSchemas
    final: bool  # the reply has ended: no more text will come, so nothing may wait
    had_calls: bool  # calls were read earlier in this reply


@dataclass(frozen=True)
class Step:
    """What a format read from the stream's position up to `end` (the position itself: it waits for more)."""

    end: int
    calls: tuple[ParsedCall, ...] | None = None  # None: that text is content; else a call block, its text dropped


def plain_text(text: str, start: int, openers: Iterable[str], context: Context) -> Step:
    """Everything from `start` is content, but for a tail that may be the beginning of one of `openers`."""
    return Step(len(text) - (0 if context.final else held_tail(text, openers, start)))


class ToolFormat(ABC):
    """One model family's way of writing tool calls."""

    name: str
    # The tags it reads (`[TOOL_CALLS]`): where a model's vocabulary holds one as a control token, which llama.cpp
    # shows as no text, the server keeps its text in the reply (SamplingParams.preserved_tokens).
    special_tags: tuple[str, ...]
    # How forced calls are written: the text around them all, and between two of them. With JSON arguments, a
    # call is call_head(name), the arguments, then call_tail.
    opening = ""
    separator = "\n"
    closing = ""
    call_tail = ""

    def new_id(self) -> str:
        return openai_call_id()

    @abstractmethod
    def step(self, text: str, start: int, context: Context) -> Step:
        """Read `text` from `start` (a position some earlier step ended at). Must not wait when context.final, and
        must decide nothing that more text could change."""

    def stream(self, tools: Iterable[str] | ToolSchemas) -> ToolCallStream:
        return ToolCallStream(self, tool_schemas(tools))

    def parse(self, text: str, tools: Iterable[str] | ToolSchemas) -> tuple[str | None, list[ParsedCall]]:
        """(the text that is not a call, or None where nothing is left around the calls; the calls, in order)."""
        stream = self.stream(tools)
        fed, finished = stream.feed(text), stream.finish()
        calls = [*fed.calls, *finished.calls]
        content = fed.content + finished.content
        return (content.strip() or None, calls) if calls else (content, [])

    def call_head(self, name: str) -> str:
        """The text a call of `name` starts with, up to its JSON arguments."""
        raise NotImplementedError(f"{self.name} writes no JSON arguments")

    def forced_call_grammar(self, functions: Functions, parallel: bool) -> str:
        """The llguidance grammar of one call (up to MAX_PARALLEL_CALLS with `parallel`) in this format, naming
        one of `functions`, its arguments following the schema."""
        calls, rules = self.call_rules(functions)
        repeat = f"({literal(self.separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else ""
        start = " ".join(filter(None, [literal(self.opening), "call", repeat, literal(self.closing)]))
        return LLMatcher.grammar_from_lark("\n".join([f"start: {start}", f"call: {' | '.join(calls)}", *rules]))

    def call_rules(self, functions: Functions) -> tuple[list[str], list[str]]:
        """Lark: one alternative a function (a call of it), and the rules they use."""
        calls, rules = [], []
        for i, (name, parameters) in enumerate(functions):
            calls.append(" ".join(filter(None, [literal(self.call_head(name)), f"args{i}", literal(self.call_tail)])))
            rules.append(json_rule(f"args{i}", parameters))
        return calls, rules


def literal(text: str) -> str:
    """A Lark string literal (JSON's quoting, which llguidance's Lark reads); '' for no text."""
    return json.dumps(text) if text else ""


def json_rule(rule: str, parameters: Any) -> str:
    schema = prepared(parameters) if parameters is not None else {"type": "object"}
    return f"{rule}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"  # ours win


class ToolCallStream:
    """A reply's text as it comes: `feed` returns what can be sent now (text, and calls read whole), `finish`
    the rest once the reply has ended."""

    def __init__(self, format_: ToolFormat, tools: ToolSchemas) -> None:
        self.format = format_
        self.tools = tools
        self.text = ""
        self.sent = 0  # text before this was sent, or read as calls
        self.had_calls = False

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        content: list[str] = []
        calls: list[ParsedCall] = []
        while self.sent < len(self.text):
            step = self.format.step(self.text, self.sent, Context(self.tools, final, self.had_calls))
            assert self.sent <= step.end <= len(self.text), (self.format.name, self.sent, step)
            if step.end == self.sent:
                assert not final, f"{self.format.name} waited at the end of the reply"
                break
            if step.calls is None:
                content.append(self.text[self.sent:step.end])
            else:
                calls.extend(step.calls)
                self.had_calls = self.had_calls or bool(step.calls)
            self.sent = step.end
        return StreamDelta("".join(content), tuple(calls))
