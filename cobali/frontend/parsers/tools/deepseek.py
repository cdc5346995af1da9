"""DeepSeek's calls, between its own tokens (full-width bars, `▁` for spaces), a run of them inside
`<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>`:

- V3 and R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
  (`deepseek_v3`);
- V3.1: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (`deepseek_v31`).

Either parser reads both; each writes its own form for a forced call. A run is read once it closes: it is calls
when every call in it reads, else text.
"""

from __future__ import annotations

import re

from cobali.frontend.parsers.calls import ParsedCall, ToolSchemas, every_call, loads, new_call
from cobali.frontend.parsers.tools.tagged import TaggedCalls

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + "(.*?)(" + re.escape(CALL_END) + r"|\Z)", re.DOTALL)
_V3_BODY = re.compile(r"\s*function" + SEP + r"([^\n]+)\n```(?:json)?\s*(.*?)\s*(?:```\s*)?\Z", re.DOTALL)
_V31_BODY = re.compile(r"\s*([^\n<]+?)" + SEP + r"(.*)\Z", re.DOTALL)


class DeepSeek(TaggedCalls):
    open_tag, close_tag = CALLS_BEGIN, CALLS_END
    opening, separator, closing = CALLS_BEGIN, "\n", CALLS_END
    special_tags = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP

    def __init__(self, name: str, typed: bool) -> None:
        """typed: V3's form, the call's type and a JSON code block (else V3.1's)."""
        self.name = name
        self.typed = typed
        self.call_tail = "\n```" + CALL_END if typed else CALL_END

    def read_block(self, body: str, tools: ToolSchemas, closed: bool) -> tuple[ParsedCall, ...] | None:
        found = list(_CALL.finditer(body))
        if not found or _CALL.sub("", body).strip():
            return None
        calls = [self._read_call(match.group(1), tools) for match in found]
        if not closed and calls[-1] is None and not found[-1].group(2):
            calls.pop()  # the call the reply's end cut short
        return every_call(calls)

    def _read_call(self, body: str, tools: ToolSchemas) -> ParsedCall | None:
        match = _V3_BODY.match(body) or _V31_BODY.match(body)
        if match is None or match.group(1).strip() not in tools:
            return None
        return new_call(match.group(1).strip(), loads(match.group(2)), self.new_id)

    def call_head(self, name: str) -> str:
        if self.typed:
            return f"{CALL_BEGIN}function{SEP}{name}\n```json\n"
        return f"{CALL_BEGIN}{name}{SEP}"
