"""gpt-oss's harmony format, as text: a reply is messages, each a header, `<|message|>` and a body that ends at
`<|end|>`, `<|call|>` (a tool call), `<|return|>` or the next `<|start|>`:

    <|channel|>analysis<|message|>Let me look it up.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

The prompt ends with `<|start|>assistant`, so the reply's first header has no `<|start|>` of its own. A header is
made of its tokens and a few words: the channel (analysis, commentary, final), a recipient (`to=functions.NAME`,
after the channel or before it), a content type (`<|constrain|>json`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cobali.frontend.parsers.text import held_tail

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN, START)
BODY_END = re.compile("|".join(map(re.escape, BODY_ENDS)))  # the first of them, in one pass (none is another's start)
HARMONY_TOKENS = (START, CHANNEL, CONSTRAIN, MESSAGE, END, CALL, RETURN)  # gpt-oss's vocabulary holds each as one
HEADER_OPENERS = (START, CHANNEL, " to=", "to=")  # what a header may begin with
MAX_HEADER = 256  # characters: past this, no header (a stream holds one whole, so it must stay short)
_HEADER_TOKENS = (START, CHANNEL, CONSTRAIN)
_WORDS = re.compile(r"[\w.\-=: ]*")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([\w.\-]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([\w.\-]+)")


@dataclass(frozen=True)
class Header:
    channel: str | None
    recipient: str | None  # e.g. functions.get_weather


def header_end(text: str, start: int = 0) -> int:
    """Where the `<|message|>` that ends a header starting at `start` is, or -1: looked for only as far as a header
    may reach, so that reading a header costs O(MAX_HEADER) however long the text."""
    return text.find(MESSAGE, start, start + MAX_HEADER + len(MESSAGE))


def may_be_header(text: str, start: int = 0) -> bool:
    """Whether `text` from `start` may be the beginning of a header, or more of one (a header opener first, then
    only header tokens and words, the end of which may still be a token's beginning)."""
    text = text[start:start + MAX_HEADER + 1]  # no more is read: past MAX_HEADER, no header
    if len(text) > MAX_HEADER or not any(text.startswith(o) or o.startswith(text) for o in HEADER_OPENERS):
        return False
    return _words_only(text[:len(text) - held_tail(text, (MESSAGE, *_HEADER_TOKENS))])


def read_header(text: str) -> Header | None:
    """The header that `text` (up to `<|message|>`) is, or None where it is not one."""
    if len(text) > MAX_HEADER or not text.startswith(HEADER_OPENERS) or not _words_only(text):
        return None
    channel, recipient = _CHANNEL.search(text), _RECIPIENT.search(text)
    return Header(channel.group(1) if channel else None, recipient.group(1) if recipient else None)


def _words_only(text: str) -> bool:
    for token in _HEADER_TOKENS:
        text = text.replace(token, " ")
    return _WORDS.fullmatch(text) is not None


def open_header(prompt: str) -> Header | None:
    """The header of the message a prompt leaves open (it ends with `<|message|>`), else None."""
    if not prompt.endswith(MESSAGE):
        return None
    end = len(prompt) - len(MESSAGE)
    start = prompt.rfind(START, max(0, end - MAX_HEADER), end)  # a header is short: only the prompt's end is read
    return read_header(prompt[max(start, 0):end]) if start >= 0 or end <= MAX_HEADER else None
