"""Reasoning between two tags: `<think>…</think>` (Qwen3, DeepSeek-R1, QwQ, GLM), `[THINK]…[/THINK]` (Magistral).

A reply may open its think block itself, start inside one its template opened in the prompt (DeepSeek-R1's and
Qwen3-2507's generation prompts end with `<think>`), or have none (Qwen3 with `enable_thinking: false`). The
whitespace just inside the opening tag and just after the closing one is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from cobali.frontend.parsers.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from cobali.frontend.parsers.text import held_tail


@dataclass(frozen=True)
class ThinkTags(ReasoningParser):
    name: str
    open_tag: str
    close_tag: str
    # A reply with no opening tag is reasoning up to the closing one (DeepSeek-R1 always thinks: vLLM's
    # deepseek_r1); else it is content (vLLM's qwen3), unless its prompt opened the block.
    always_thinks: bool = False

    @property
    def special_tags(self) -> tuple[str, ...]:
        return self.open_tag, self.close_tag

    def stream(self, prompt: str = "") -> ThinkStream:
        end = stripped_end(prompt)
        opened = prompt.endswith(self.open_tag, 0, end) or (
            self.always_thinks and not prompt.endswith(self.close_tag, 0, end))
        return ThinkStream(self, opened)


def stripped_end(text: str, window: int = 256) -> int:
    """len(text.rstrip()), reading only the end of `text` (a stream is made on the event loop, and its prompt
    may be megabytes)."""
    end = len(text)
    while end:
        start = max(0, end - window)
        kept = text[start:end].rstrip()
        end = start + len(kept)
        if kept:
            break
    return end


class Part(Enum):
    OPENING = "opening"  # not yet known whether the reply opens a think block
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkStream(ReasoningStream):
    """Keeps for the next feed no more than what may be a tag's beginning: whitespace that may come before the
    opening tag is set aside as it comes (it is dropped if the tag follows), and whitespace to be dropped is
    dropped as it comes, so that a feed costs O(its text) even in a run of spaces."""

    def __init__(self, tags: ThinkTags, in_reasoning: bool) -> None:
        super().__init__()
        self.tags = tags
        self.part = Part.OPENING
        self.without_tag = Part.REASONING if in_reasoning else Part.CONTENT  # the part a reply with no tag is in
        self.trim = False  # whitespace at the head of `held` is to be dropped
        self.lead: list[str] = []  # the reply's whitespace so far, while it is OPENING

    def _advance(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        while True:
            if self.part is Part.OPENING and not self._open(final):
                return ReasoningDelta("".join(reasoning))
            if self.trim:
                self.held = self.held.lstrip()
                if not self.held and not final:
                    return ReasoningDelta("".join(reasoning))
                self.trim = False
            if self.part is Part.CONTENT:
                content, self.held = self.held, ""
                return ReasoningDelta("".join(reasoning), content)
            at = self.held.find(self.tags.close_tag)
            if at >= 0:
                reasoning.append(self.held[:at])
                self.held = self.held[at + len(self.tags.close_tag):]
                self._enter(Part.CONTENT)
                continue
            keep = 0 if final else held_tail(self.held, (self.tags.close_tag,))
            reasoning.append(self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            return ReasoningDelta("".join(reasoning))

    def _open(self, final: bool) -> bool:
        """Whether the reply opens with the tag, once its text tells; False: wait for more."""
        body = self.held.lstrip()
        if len(body) < len(self.held):
            self.lead.append(self.held[:len(self.held) - len(body)])
            self.held = body
        if body.startswith(self.tags.open_tag):
            self.held = body[len(self.tags.open_tag):]
            self._enter(Part.REASONING)
        elif self.tags.open_tag.startswith(body) and not final:
            return False
        else:  # no tag: the whitespace set aside is the reply's (dropped too where it is reasoning)
            self.held = "".join(self.lead) + body
            self._enter(self.without_tag, trim=self.without_tag is Part.REASONING)
        self.lead = []
        return True

    def _enter(self, part: Part, trim: bool = True) -> None:
        self.part, self.trim = part, trim
