"""Regular expressions -> GBNF: vLLM's `structured_outputs.regex` (the output matches the whole pattern) and
JSON Schema's `pattern` (a JSON string whose text contains a match).

A regular language needs no more than GBNF has: literals, classes, groups, alternation and bounded repetition.
What is not regular, or not worth a grammar, is refused with a ValueError naming it: lookarounds,
backreferences, conditionals, atomic groups and possessive repeats, word boundaries, inline flags, anchors
anywhere but the pattern's ends, and a NUL character (llama.cpp reads grammars as C strings). Classes read as
ASCII (`re.ASCII`): \\d is [0-9], \\w is [A-Za-z0-9_], \\s is [ \\t\\n\\r\\f\\v]; `.` is any character but a
newline. Lazy repeats match the same texts as greedy ones. Braces read as Python reads them: `{m}`, `{m,}`,
`{,n}`, `{m,n}` and `{,}` (ASCII digits) repeat, any other `{` is itself. Groups nest at most MAX_NESTING deep.

Inside a JSON string each character is written as json.dumps writes it (gbnf.json_text).
"""

from __future__ import annotations

import re
from typing import NoReturn

from cobali.server.gbnf import alternatives, char_class, counted, gbnf_literal, json_class, json_text, repeat_fits

MAX_REPEAT = 1000  # llama.cpp refuses repetitions past 2000, and long ones of big groups sooner
MAX_NESTING = 50  # groups in groups; each level is a few Python frames of the recursive descent

_DIGITS = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_SHORTHANDS = {"d": _DIGITS, "w": _WORD, "s": _SPACE}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_REFUSED_GROUPS = {"=": "lookahead", "!": "negative lookahead", "<=": "lookbehind", "<!": "negative lookbehind",
                   "P=": "backreference", ">": "atomic group", "(": "conditional", "#": "comment"}
_COUNTS = re.compile(r"\{([0-9]*)(,?)([0-9]*)\}")  # ASCII digits, as Python's re reads them
MAX_CODE = 0x10FFFF


def regex_grammar(pattern: str) -> str:
    """A grammar whose texts are exactly those `re.fullmatch(pattern, text, re.ASCII)` accepts."""
    return f"root ::= {RegexTranslator(pattern).translate()}\n"


def json_string_expression(pattern: str, char_rule: str) -> str:
    """A GBNF expression for the inside of a JSON string containing a match of `pattern` (JSON Schema's
    search semantics: unanchored ends admit any `char_rule` characters)."""
    translator = RegexTranslator(pattern, in_json=True)
    expr = translator.translate()
    if translator.anchored != (False, False) and translator.top_level_branches > 1:
        raise ValueError("anchors inside an alternation")  # `^a|b$` anchors each branch at one end only
    head = "" if translator.anchored[0] else f"{char_rule}* "
    tail = "" if translator.anchored[1] else f" {char_rule}*"
    return f"{head}( {expr} ){tail}"


class RegexTranslator:
    """One pass of recursive descent over the pattern, writing GBNF as it goes."""

    def __init__(self, pattern: str, in_json: bool = False) -> None:
        self.pattern, self.pos, self.in_json = pattern, 0, in_json
        self.anchored = (False, False)
        self.top_level_branches = 1
        self.nesting = 0

    def translate(self) -> str:
        branches = self._branches()
        if self.pos < len(self.pattern):
            self._fail("unbalanced ')'")
        self.top_level_branches = len(branches)
        return alternatives(branches)

    def _fail(self, what: str) -> NoReturn:
        raise ValueError(f"regex {self.pattern!r}: {what} at position {self.pos}")

    def _peek(self, ahead: int = 0) -> str:
        at = self.pos + ahead
        return self.pattern[at] if at < len(self.pattern) else ""

    def _branches(self) -> list[str]:
        branches = [self._sequence()]
        while self._peek() == "|":
            self.pos += 1
            branches.append(self._sequence())
        return branches

    def _sequence(self) -> str:
        items: list[str] = []
        literal = ""  # a run of plain characters, written as one GBNF literal
        while self._peek() not in ("", "|", ")"):
            atom, char = self._atom()
            if atom is None:
                continue
            quantifier = self._quantifier()
            if char is not None and not quantifier:
                literal += char
                continue
            if literal:
                items.append(self._text(literal))
                literal = ""
            if quantifier and not repeat_fits(atom, quantifier):
                self._fail("a repeat of more than llama.cpp's grammars hold (its count times the groups and "
                           "repeats inside it)")
            items.append(f"( {atom} ){quantifier}" if quantifier else atom)
        if literal:
            items.append(self._text(literal))
        return " ".join(items) if items else '""'

    def _text(self, text: str) -> str:
        if self.in_json:
            return json_text(text)  # a NUL is written as \u0000
        if "\0" in text:
            self._fail("a NUL character (llama.cpp's grammars cannot match one)")
        return gbnf_literal(text)

    def _atom(self) -> tuple[str | None, str | None]:
        """(GBNF expression, the plain character it is, if it is one); (None, None) for an anchor."""
        char = self._peek()
        if char in "*+?" or self._counts() is not None:
            self._fail("nothing to repeat")
        self.pos += 1
        if char == "(":
            return self._group(), None
        if char == "[":
            return self._set(*self._class_body()), None
        if char == ".":
            return self._set([(0x0A, 0x0A)], negated=True), None
        if char == "\\":
            return self._escape()
        if char in "^$":
            self._anchor(start=char == "^", length=1)
            return None, None
        return self._text(char), char

    def _anchor(self, start: bool, length: int) -> None:
        if start and self.pos != length:
            self._fail("'^' or \\A not at the start")
        if not start and self.pos != len(self.pattern):
            self._fail("'$' or \\Z not at the end")
        self.anchored = (True, self.anchored[1]) if start else (self.anchored[0], True)

    def _group(self) -> str:
        self.nesting += 1
        if self.nesting > MAX_NESTING:
            self._fail(f"groups nested deeper than {MAX_NESTING}")
        if self._peek() == "?":
            self.pos += 1
            if self.pattern.startswith(":", self.pos):
                self.pos += 1
            elif self._names_a_group():
                end = self.pattern.find(">", self.pos)
                if end < 0:
                    self._fail("unterminated group name")
                self.pos = end + 1
            else:
                kind = next((name for key, name in _REFUSED_GROUPS.items() if self.pattern.startswith(key, self.pos)),
                            "inline flags")
                self._fail(f"{kind} (not a regular language or not supported)")
        branches = self._branches()
        if self._peek() != ")":
            self._fail("missing ')'")
        self.pos += 1
        self.nesting -= 1
        return "( " + " | ".join(branches) + " )"

    def _names_a_group(self) -> bool:
        """At `P<name>` (Python) or `<name>` (ECMAScript), not at a lookbehind's `<=` or `<!`."""
        name_at = self.pos + (2 if self.pattern.startswith("P<", self.pos) else 1)
        return self.pattern.startswith(("P<", "<"), self.pos) and self.pattern[name_at:name_at + 1] not in ("=", "!")

    def _counts(self) -> tuple[int, int | None, int] | None:
        """A `{m}`, `{m,}`, `{m,n}`, `{,n}` or `{,}` at the position: (min, max or None, its length); None when
        the brace is a plain character, as Python reads it (`{}` included)."""
        match = _COUNTS.match(self.pattern, self.pos)
        if match is None or match.group() == "{}":
            return None
        low, comma, high = match.groups()
        high_count = int(high) if high else None if comma else int(low)  # `{m}` is `{m,m}`
        return int(low or 0), high_count, match.end() - self.pos

    def _quantifier(self) -> str:
        char = self._peek()
        if char in ("*", "+", "?"):
            self.pos += 1
            text = char
        elif (counts := self._counts()) is not None:
            low, high, length = counts
            if high is not None and high < low:
                self._fail(f"repeat {low} exceeds its maximum {high}")
            if max(low, high or 0) > MAX_REPEAT:
                self._fail(f"repeat counts above {MAX_REPEAT}")
            self.pos += length
            text = counted(low, high)
        else:
            return ""
        if self._peek() == "+":
            self._fail("possessive repeat")
        if self._peek() == "?":
            self.pos += 1  # lazy: the same texts match
        if self._peek() in ("*", "+", "?") or self._counts() is not None:
            self._fail("multiple repeat")
        return text

    def _escape(self) -> tuple[str | None, str | None]:
        char = self._peek()
        if char in ("A", "Z"):
            self.pos += 1
            self._anchor(start=char == "A", length=2)
            return None, None
        if char.lower() in _SHORTHANDS:
            self.pos += 1
            return self._set(_SHORTHANDS[char.lower()], negated=char.isupper()), None
        code = self._escaped_code()
        return self._text(chr(code)), chr(code)

    def _escaped_code(self) -> int:
        """The character of a single-character escape (the backslash consumed)."""
        char = self._peek()
        if not char:
            self._fail("a pattern ending in a backslash")
        self.pos += 1
        if char in _CHAR_ESCAPES:
            return ord(_CHAR_ESCAPES[char])
        if char in _HEX_ESCAPES:
            digits = self.pattern[self.pos:self.pos + _HEX_ESCAPES[char]]
            if len(digits) != _HEX_ESCAPES[char] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self._fail(f"a bad \\{char} escape")
            self.pos += len(digits)
            if int(digits, 16) > MAX_CODE:
                self._fail("a character past U+10FFFF")
            return int(digits, 16)
        if char == "0":
            digits = ""
            while len(digits) < 2 and self._peek() in tuple("01234567"):
                digits += self._peek()
                self.pos += 1
            return int(digits or "0", 8)
        if char.isdigit():
            self._fail("backreference")
        if char in "bB":
            self._fail("word boundary")
        if char.isascii() and char.isalnum():
            self._fail(f"unknown escape \\{char}")
        return ord(char)

    def _class_body(self) -> tuple[list[tuple[int, int]], bool]:
        negated = self._peek() == "^"
        self.pos += negated
        ranges: list[tuple[int, int]] = []
        first = True
        while first or self._peek() != "]":
            if not self._peek():
                self._fail("unterminated character class")
            first = False
            low = self._class_member(ranges)
            if low is None:
                continue
            if self._peek() == "-" and self._peek(1) not in ("]", ""):
                self.pos += 1
                high = self._class_member(ranges)
                if high is None or high < low:
                    self._fail("a bad range in a character class")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        self.pos += 1
        return sorted(ranges), negated

    def _class_member(self, ranges: list[tuple[int, int]]) -> int | None:
        """One character of a class, or None after adding a \\d, \\w or \\s to `ranges`."""
        char = self._peek()
        self.pos += 1
        if char != "\\":
            return ord(char)
        escaped = self._peek()
        if escaped in _SHORTHANDS:
            self.pos += 1
            ranges.extend(_SHORTHANDS[escaped])
            return None
        if escaped.lower() in _SHORTHANDS:
            self._fail(f"\\{escaped} inside a character class")
        if escaped == "b":
            self.pos += 1
            return 0x08  # a backspace, inside a class
        return self._escaped_code()

    def _set(self, ranges: list[tuple[int, int]], negated: bool) -> str:
        return json_class(ranges, negated) if self.in_json else char_class(ranges, negated)
