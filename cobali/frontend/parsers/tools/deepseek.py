"""DeepSeek's calls, between its own tokens (full-width bars, `▁` for spaces), a run of them inside
`<｜tool▁calls▁begin｜>` … `<｜tool▁calls▁end｜>`:

- V3 and R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`
  (`deepseek_v3`);
- V3.1: `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (`deepseek_v31`).

Either parser reads both; each writes its own form for a forced call. A run is read once it closes: it is calls
when every call in it reads, else text.
"""

from __future__ import annotations

from cobali.frontend.parsers.calls import ParsedCall, ToolSchemas, every_call, loads, new_call
from cobali.frontend.parsers.tools.tagged import TaggedCalls

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


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
        """Each call from its begin token to its end token (or the block's end); only whitespace between them.
        Read with str.find, each character once (a regex here backtracked over a run of spaces)."""
        calls: list[ParsedCall | None] = []
        at, ended = 0, True
        while (begin := body.find(CALL_BEGIN, at)) >= 0:
            if body[at:begin].strip():
                return None
            end = body.find(CALL_END, begin + len(CALL_BEGIN))
            ended = end >= 0
            calls.append(self._read_call(body[begin + len(CALL_BEGIN):end if ended else len(body)], tools))
            at = end + len(CALL_END) if ended else len(body)
        if not calls or body[at:].strip():
            return None
        if not closed and calls[-1] is None and not ended:
            calls.pop()  # the call the reply's end cut short
        return every_call(calls)

    def _read_call(self, body: str, tools: ToolSchemas) -> ParsedCall | None:
        """V3's `function<sep>NAME\\n```json\\n{...}\\n```` where it is one, else V3.1's `NAME<sep>{...}`."""
        read = _typed_call(body) or _plain_call(body)
        if read is None or read[0].strip() not in tools:
            return None
        return new_call(read[0].strip(), loads(read[1]), self.new_id)

    def call_head(self, name: str) -> str:
        if self.typed:
            return f"{CALL_BEGIN}function{SEP}{name}\n```json\n"
        return f"{CALL_BEGIN}{name}{SEP}"


def _typed_call(body: str) -> tuple[str, str] | None:
    """(name, arguments' text) of a V3 call: the name's line, then a code block (its closing fence optional)."""
    head = "function" + SEP
    rest = body.lstrip()
    newline = rest.find("\n")
    if not rest.startswith(head) or newline <= len(head) or not rest.startswith(FENCE, newline + 1):
        return None
    code = rest[newline + 1 + len(FENCE):]
    code = code.removeprefix("json").strip()
    return rest[len(head):newline], code.removesuffix(FENCE).rstrip()


def _plain_call(body: str) -> tuple[str, str] | None:
    """(name, arguments' text) of a V3.1 call: a name on one line, up to the separator."""
    rest = body.lstrip()
    sep = rest.find("<")
    if sep <= 0 or "\n" in rest[:sep] or not rest.startswith(SEP, sep):
        return None
    return rest[:sep], rest[sep + len(SEP):]
