"""The frame every tool-call format runs in: a stream that asks its format, at the first text not yet sent, how
much of it is plain text, how much is a call, or whether it must wait for more; a whole reply is one feed and the
finish. And the forced-call grammar of a format whose arguments are JSON.

Model output is hostile, so a reply costs time linear in its length, whole or streamed: the text not yet sent is
kept in the pieces it came in (Held), a format that waits keeps in Held.scan how far it has read, and on the next
feed reads only what came since; the text is joined and read whole only once a call (or text) is decided."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from llguidance import LLMatcher

from cobali.frontend.parsers.calls import ParsedCall, ToolSchemas, openai_call_id, tool_schemas
from cobali.frontend.parsers.stream import read_whole
from cobali.frontend.parsers.text import held_tail
from cobali.structured.grammars import JSON_OPTIONS, MAX_PARALLEL_CALLS, prepared

Functions = Sequence[tuple[str, Any]]  # a forced call's choices: (name, parameters schema or None)


class StreamDelta(NamedTuple):
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


class Held:
    """The reply's text from the first character not yet sent (`start`) to `end`, positions counted from the
    reply's start. New pieces are kept apart until something needs the text whole, so that a block that waits
    for its end is not copied at each piece."""

    def __init__(self) -> None:
        self.start = self.end = 0
        self.scan: Any = None  # what the format has read of the text at `start` so far; None when start moves
        self.opening: Any = None  # Llama 3's reading of the reply's opening (at position 0 only)
        self._text, self._base = "", 0  # text joined so far, and the position of its first character
        self._pieces: list[str] = []

    def add(self, piece: str) -> None:
        self._pieces.append(piece)
        self.end += len(piece)

    def text(self) -> tuple[str, int]:
        """The held text whole, and the position of its first character (at most `start`). Joins what came since
        the last call: a format asks for it to decide, not while it waits."""
        if self._pieces:
            whole = "".join([self._text, *self._pieces])
            self._text, self._base, self._pieces = whole[self.start - self._base:], self.start, []
        return self._text, self._base

    def window(self, at: int) -> tuple[str, int]:
        """The text from `at` (at least `start`) on, as (a text, the position of its first character): the text
        joined so far where nothing came since (no copy), else only what lies from `at` on."""
        return (self._text, self._base) if not self._pieces else (self._since(at), at)

    def _since(self, at: int) -> str:
        """The text from `at` on, reading only that far back (and one piece)."""
        assert self.start <= at <= self.end, (self.start, at, self.end)
        newest: list[str] = []  # the pieces from the newest back to the one `at` falls in
        reach = self.end  # where the first of them starts
        for piece in reversed(self._pieces):
            if reach <= at:
                break
            newest.append(piece)
            reach -= len(piece)
        if reach > at:  # `at` falls in the text already joined
            newest.append(self._text[at - self._base:])
            reach = at
        return "".join(reversed(newest))[at - reach:]

    def find(self, token: str, at: int) -> int:
        """Where `token` first stands from `at` on, or -1; reads only from `at`."""
        text, base = self.window(at)
        found = text.find(token, at - base)
        return found + base if found >= 0 else -1

    def move(self, to: int) -> None:
        """Mark the text before `to` as sent."""
        self.start, self.scan = to, None

    def forget(self) -> None:
        """Drop the text already sent (once a feed is read: within one, positions stay valid in text())."""
        if not self._pieces and self.start > self._base:
            self._text, self._base = self._text[self.start - self._base:], self.start


def plain_text(held: Held, openers: Iterable[str], context: Context) -> Step:
    """Everything from `start` is content, but for a tail that may be the beginning of one of `openers`."""
    text, base = held.text()
    return Step(held.end - (0 if context.final else held_tail(text, openers, held.start - base)))


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
    def step(self, held: Held, context: Context) -> Step:
        """Read the held text from its start. Must not wait when context.final, must decide nothing that more
        text could change, and, waiting, must keep in held.scan what it has read, so as to read it only once."""

    def stream(self, tools: Iterable[str] | ToolSchemas) -> ToolCallStream:
        return ToolCallStream(self, tool_schemas(tools))

    def parse(self, text: str, tools: Iterable[str] | ToolSchemas) -> tuple[str | None, list[ParsedCall]]:
        """(the text that is not a call, or None where nothing is left around the calls; the calls, in order)."""
        read = read_whole(self.stream(tools), text)
        return (read.content.strip() or None, list(read.calls)) if read.calls else (read.content, [])

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
        self.held = Held()
        self.had_calls = False

    def feed(self, delta: str) -> StreamDelta:
        self.held.add(delta)
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        content: list[str] = []
        calls: list[ParsedCall] = []
        held = self.held
        while held.start < held.end:
            step = self.format.step(held, Context(self.tools, final, self.had_calls))
            assert held.start <= step.end <= held.end, (self.format.name, held.start, step)
            if step.end == held.start:
                assert not final, f"{self.format.name} waited at the end of the reply"
                break
            if step.calls is None:
                text, base = held.text()
                content.append(text[held.start - base:step.end - base])
            else:
                calls.extend(step.calls)
                self.had_calls = self.had_calls or bool(step.calls)
            held.move(step.end)
        held.forget()
        return StreamDelta("".join(content), tuple(calls))
