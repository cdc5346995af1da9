"""Writing GBNF text as llama.cpp's grammar parser reads it: string literals, and character classes over
code-point ranges (inclusive (low, high) pairs)."""

from __future__ import annotations


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
