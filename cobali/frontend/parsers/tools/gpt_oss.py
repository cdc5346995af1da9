"""gpt-oss's calls (vLLM's `openai` parser): a harmony message to a function,

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

its header with or without the `<|start|>assistant` (the reply's first message has none), the recipient after the
channel or before it. Other messages are text, as they stand: the gpt-oss reasoning parser, run first, leaves only
the final channel's text and the calls. Forced, a call is written at the reply's start (the prompt ends with
`<|start|>assistant`) and ends with the model's own `<|call|>`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cobali.frontend.parsers.calls import loads, new_call
from cobali.frontend.parsers.harmony import (
    BODY_END,
    BODY_ENDS,
    CHANNEL,
    CONSTRAIN,
    HARMONY_TOKENS,
    MESSAGE,
    START,
    header_end,
    may_be_header,
    read_header,
)
from cobali.frontend.parsers.tools.base import Context, Functions, Held, Step, ToolFormat, plain_text

_OPENERS = (START, CHANNEL)
_OPENER = re.compile("|".join(map(re.escape, _OPENERS)))  # the first of them, in one pass
_RECIPIENT_FIRST = ("to=", " to=")  # a header that opens the reply may start with its recipient
FUNCTIONS = "functions."


@dataclass
class _Call:
    """A call's body, read so far (held.scan): no end token before `scanned`."""

    name: str
    body: int
    scanned: int


class Harmony(ToolFormat):
    name = "openai"
    special_tags = HARMONY_TOKENS

    def call_head(self, name: str) -> str:
        return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"

    def forced_call_grammar(self, functions: Functions, parallel: bool) -> str:
        return super().forced_call_grammar(functions, parallel=False)  # a call ends the turn: one a reply

    def step(self, held: Held, context: Context) -> Step:
        if held.scan is not None:
            return self._body(held, held.scan, context)
        text, base = held.text()
        start = held.start - base
        if held.start == 0 and not context.final and any(o.startswith(text) for o in _RECIPIENT_FIRST):
            return Step(held.start)
        if not (text.startswith(_OPENERS, start) or (held.start == 0 and text.startswith(_RECIPIENT_FIRST))):
            found = _OPENER.search(text, start)
            return Step(found.start() + base) if found is not None else plain_text(held, _OPENERS, context)
        at = header_end(text, start)  # a header is read only as far as one may reach
        header = read_header(text[start:at]) if at >= 0 else None
        if header is None:
            if at < 0 and may_be_header(text, start) and not context.final:
                return Step(held.start)
            return Step(held.start + _opener_length(text, start))  # no header: its opener is text
        body = at + len(MESSAGE) + base
        recipient = header.recipient or ""
        name = recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else None
        if name is None or name not in context.tools:
            return Step(body)  # the header of a message that is no call: text
        held.scan = _Call(name, body, body)
        return self._body(held, held.scan, context)

    def _body(self, held: Held, call: _Call, context: Context) -> Step:
        """The call's body up to its end token, looked for only in what came since the last feed."""
        text, base = held.window(call.scanned)
        ending = BODY_END.search(text, call.scanned - base)
        if ending is None and not context.final:
            call.scanned = max(call.body, held.end - max(map(len, BODY_ENDS)) + 1)
            return Step(held.start)
        body_end = ending.start() + base if ending is not None else held.end
        end = body_end + (len(ending.group()) if ending is not None and ending.group() != START else 0)
        text, base = held.text()
        new = new_call(call.name, loads(text[call.body - base:body_end - base]), self.new_id)
        if new is not None:
            return Step(end, (new,))
        return Step(end, () if ending is None and context.had_calls else None)


def _opener_length(text: str, start: int) -> int:
    for opener in (*_OPENERS, *_RECIPIENT_FIRST):
        if text.startswith(opener, start):
            return len(opener)
    raise AssertionError("step reads a header only where an opener stands")
