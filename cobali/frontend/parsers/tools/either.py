"""The parser where a template names no format: Llama 3.x's JSON where the reply opens with a call, else Hermes's
tags (the two forms models write most, and what cobali read before it had a parser per family)."""

from __future__ import annotations

from cobali.frontend.parsers.tools.base import Context, Held, Step, ToolFormat
from cobali.frontend.parsers.tools.llama3 import Llama3Json, opens_call
from cobali.frontend.parsers.tools.tagged import Hermes


class HermesOrLlama3(ToolFormat):
    name = "hermes_or_llama3_json"
    special_tags = Hermes.special_tags + Llama3Json.special_tags

    def __init__(self) -> None:
        self.hermes, self.llama3 = Hermes(), Llama3Json()
        self.call_tail = self.hermes.call_tail  # a forced call is written the Hermes way

    def call_head(self, name: str) -> str:
        return self.hermes.call_head(name)

    def step(self, held: Held, context: Context) -> Step:
        if held.start == 0:
            opens = opens_call(held, context)
            if opens is None:
                return Step(held.start)
            if opens:
                return self.llama3.step(held, context)
        return self.hermes.step(held, context)
