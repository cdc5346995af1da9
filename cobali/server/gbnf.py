"""Writing GBNF text as llama.cpp's grammar parser reads it: string literals, alternatives, repetitions,
character classes over code-point ranges (inclusive (low, high) pairs), and characters inside a JSON string."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_REPETITION_RULES = 2000  # llama.cpp refuses a repetition whose repeated rules times its count pass this
_RULE_MAKERS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{([0-9]+)(,?)([0-9]*)\}|[(*+?]')

# RFC 3339 as JSON Schema's formats read it; no 29 February (the grammar cannot tell leap years).
JSON_FORMATS = {
    "date": '[1-9] [0-9]{3} "-" ( ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | "1" [0-9] | "2" [0-8] ) '
            '| ( "0" [13-9] | "1" [0-2] ) "-" ( "29" | "30" ) | ( "0" [13578] | "1" [02] ) "-31" )',
    "time": '( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? '
            '( "Z" | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
    "date-time": 'format-date "T" format-time',
    "uuid": '[0-9a-f]{8} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{12}',
}


# llama.cpp's grammars/json.gbnf, with bounded whitespace so a model cannot pad forever.
JSON_RULES = r"""
value ::= object | array | string | number | boolean | null
object ::= "{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws
array ::= "[" ws ( value ( "," ws value )* )? "]" ws
string ::= "\"" char* "\"" ws
char ::= [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )
number ::= "-"? ( [0-9] | [1-9] [0-9]{0,15} ) ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )? ws
integer ::= "-"? ( [0-9] | [1-9] [0-9]{0,15} ) ws
boolean ::= ( "true" | "false" ) ws
null ::= "null" ws
ws ::= | " " | "\n" [ \t]{0,20}
"""


def gbnf_literal(text: str) -> str:
    """A GBNF string literal matching exactly `text` (llama.cpp's escapes: \\\\, \\", \\xHH, \\uHHHH, \\UHHHHHHHH)."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= ord(char) < 0x7F:
            out.append(char)
        else:
            out.append(hex_escape(ord(char)))
    return '"' + "".join(out) + '"'


def json_literal(value: Any) -> str:
    """A GBNF literal matching `value` as JSON writes it."""
    return gbnf_literal(json.dumps(value, ensure_ascii=False))


def alternatives(options: list[str]) -> str:
    return options[0] if len(options) == 1 else "( " + " | ".join(options) + " )"


def counted(low: int, high: int | None) -> str:
    """A repetition's `{low,high}` (None: no upper bound)."""
    return f"{{{low},{'' if high is None else high}}}"


def repeat(item: str, low: int, high: int | None) -> str:
    return f"( {item} ){counted(low, high)}"


def repeat_fits(item: str, quantifier: str) -> bool:
    """Whether llama.cpp's parser takes `( item )quantifier`: it refuses a repetition when the rules the repeated
    group makes (itself, the groups in it, a rule per optional step of their repetitions) times its count pass
    MAX_REPETITION_RULES."""
    made = 1
    for match in _RULE_MAKERS.finditer(item):
        if match.group()[0] == "{":
            made += int(match[3]) - int(match[1]) if match[3] else 1 if match[2] else 0
        elif match.group()[0] not in '"[':
            made += 1
    counts = re.fullmatch(r"\{([0-9]+),([0-9]*)\}", quantifier)
    low, high = (int(counts[1]), int(counts[2] or 0)) if counts else (0, quantifier == "?")
    return made * (high or low or 1) <= MAX_REPETITION_RULES


def hex_escape(code: int) -> str:
    return f"\\x{code:02X}" if code <= 0xFF else f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


def class_char(code: int) -> str:
    char = chr(code)
    return char if char.isascii() and char.isalnum() else hex_escape(code)


def char_class(ranges: list[tuple[int, int]], negated: bool) -> str:
    items = "".join(class_char(lo) if lo == hi else f"{class_char(lo)}-{class_char(hi)}" for lo, hi in ranges)
    return f"[{'^' if negated else ''}{items}]"


def contains(ranges: list[tuple[int, int]], code: int) -> bool:
    return any(lo <= code <= hi for lo, hi in ranges)


def without(ranges: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` less every code in `cut`."""
    for c_lo, c_hi in cut:
        kept = []
        for lo, hi in ranges:
            if hi < c_lo or lo > c_hi:
                kept.append((lo, hi))
                continue
            if lo < c_lo:
                kept.append((lo, c_lo - 1))
            if hi > c_hi:
                kept.append((c_hi + 1, hi))
        ranges = kept
    return ranges


# Inside a JSON string each character is written as json.dumps writes it: these escaped short, the other
# control characters as \u00xx, the rest as themselves.
_JSON_SHORT = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r"}
_JSON_ESCAPED = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]


def json_text(text: str) -> str:
    """A GBNF literal for `text` inside a JSON string."""
    return gbnf_literal(json.dumps(text, ensure_ascii=False)[1:-1])


def json_class(ranges: list[tuple[int, int]], negated: bool) -> str:
    """A character class inside a JSON string: the characters JSON escapes written as their escapes (as
    json_text writes them), the others as the class."""
    included = [code for lo, hi in _JSON_ESCAPED for code in range(lo, hi + 1) if contains(ranges, code) != negated]
    plain = char_class(ranges + _JSON_ESCAPED, True) if negated else char_class(without(ranges, _JSON_ESCAPED), False)
    options = [plain] if plain != "[]" else []
    options += [gbnf_literal(_JSON_SHORT[code]) for code in included if code in _JSON_SHORT]
    for high in (0, 1):  # \u0000-\u000f, then \u0010-\u001f: one class of last digits each
        lows = [code & 0xF for code in included if code >> 4 == high and code not in _JSON_SHORT]
        if lows:
            digits = char_class([(ord(f"{low:x}"), ord(f"{low:x}")) for low in lows], False)
            options.append(gbnf_literal(f"\\u00{high}") + " " + digits)
    return alternatives(options)
