"""gpt-oss's calls (vLLM's `openai` parser): a harmony message to a function,

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

its header with or without the `<|start|>assistant` (the reply's first message has none), the recipient after the
channel or before it. Other messages are text, as they stand: the gpt-oss reasoning parser, run first, leaves only
the final channel's text and the calls. Forced, a call is written at the reply's start (the prompt ends with
`<|start|>assistant`) and ends with the model's own `<|call|>`.
"""

from __future__ import annotations

from cobali.frontend.parsers.calls import loads, new_call
from cobali.frontend.parsers.harmony import (
    BODY_ENDS,
    CHANNEL,
    CONSTRAIN,
    HARMONY_TOKENS,
    MESSAGE,
    START,
    may_be_header,
    read_header,
)
from cobali.frontend.parsers.text import first_of
from cobali.frontend.parsers.tools.base import Context, Functions, Step, ToolFormat, plain_text

_OPENERS = (START, CHANNEL)
_RECIPIENT_FIRST = ("to=", " to=")  # a header that opens the reply may start with its recipient
FUNCTIONS = "functions."


class Harmony(ToolFormat):
    name = "openai"
    special_tags = HARMONY_TOKENS

    def call_head(self, name: str) -> str:
        return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"

    def forced_call_grammar(self, functions: Functions, parallel: bool) -> str:
        return super().forced_call_grammar(functions, parallel=False)  # a call ends the turn: one a reply

    def step(self, text: str, start: int, context: Context) -> Step:
        if start == 0 and not context.final and any(o.startswith(text) for o in _RECIPIENT_FIRST):
            return Step(start)
        if not (text.startswith(_OPENERS, start) or (start == 0 and text.startswith(_RECIPIENT_FIRST))):
            found = first_of(text, _OPENERS, start)
            return Step(found[0]) if found is not None else plain_text(text, start, _OPENERS, context)
        at = text.find(MESSAGE, start)
        header = read_header(text[start:at]) if at >= 0 else None
        if header is None:
            if at < 0 and may_be_header(text[start:]) and not context.final:
                return Step(start)
            return Step(start + _opener_length(text, start))  # no header: its opener is text
        body = at + len(MESSAGE)
        recipient = header.recipient or ""
        name = recipient[len(FUNCTIONS):] if recipient.startswith(FUNCTIONS) else None
        if name is None or name not in context.tools:
            return Step(body)  # the header of a message that is no call: text
        ending = first_of(text, BODY_ENDS, body)
        if ending is None and not context.final:
            return Step(start)
        body_end = ending[0] if ending is not None else len(text)
        end = body_end + (len(ending[1]) if ending is not None and ending[1] != START else 0)
        call = new_call(name, loads(text[body:body_end]), self.new_id)
        if call is not None:
            return Step(end, (call,))
        return Step(end, () if ending is None and context.had_calls else None)


def _opener_length(text: str, start: int) -> int:
    for opener in (*_OPENERS, *_RECIPIENT_FIRST):
        if text.startswith(opener, start):
            return len(opener)
    raise AssertionError("step reads a header only where an opener stands")
