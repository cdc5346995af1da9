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
        tail = prompt.rstrip()
        opened = tail.endswith(self.open_tag) or (self.always_thinks and not tail.endswith(self.close_tag))
        return ThinkStream(self, opened)


class Part(Enum):
    OPENING = "opening"  # not yet known whether the reply opens a think block
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkStream(ReasoningStream):
    def __init__(self, tags: ThinkTags, in_reasoning: bool) -> None:
        super().__init__()
        self.tags = tags
        self.part = Part.OPENING
        self.without_tag = Part.REASONING if in_reasoning else Part.CONTENT  # the part a reply with no tag is in
        self.trim = False  # whitespace at the head of `held` is to be dropped

    def _advance(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        while True:
            if self.part is Part.OPENING:
                body = self.held.lstrip()
                if body.startswith(self.tags.open_tag):
                    self.held = body[len(self.tags.open_tag):]
                    self._enter(Part.REASONING)
                elif self.tags.open_tag.startswith(body) and not final:
                    return ReasoningDelta("".join(reasoning))
                else:
                    self._enter(self.without_tag, trim=self.without_tag is Part.REASONING)
                continue
            if self.trim:
                if not self.held.strip() and not final:
                    return ReasoningDelta("".join(reasoning))
                self.held, self.trim = self.held.lstrip(), False
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

    def _enter(self, part: Part, trim: bool = True) -> None:
        self.part, self.trim = part, trim
