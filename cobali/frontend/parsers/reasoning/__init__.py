"""The reasoning parsers, by vLLM's names (`--reasoning-parser NAME`), and the one a chat template calls for."""

from __future__ import annotations

from cobali.frontend.parsers.harmony import CHANNEL
from cobali.frontend.parsers.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from cobali.frontend.parsers.reasoning.gpt_oss import GptOss
from cobali.frontend.parsers.reasoning.think import ThinkTags

__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "ReasoningStream", "choose_reasoning_parser",
           "reasoning_parser"]

REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ThinkTags("deepseek_r1", "<think>", "</think>", always_thinks=True),
    "qwen3": ThinkTags("qwen3", "<think>", "</think>"),
    "mistral": ThinkTags("mistral", "[THINK]", "[/THINK]"),
    "openai_gptoss": GptOss(),
}
_ALIASES = {"gpt_oss": "openai_gptoss"}
DEEPSEEK_ASSISTANT = "<｜Assistant｜>"


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser `name` stands for; ValueError naming the known ones."""
    parser = REASONING_PARSERS.get(_ALIASES.get(name, name))
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(sorted(REASONING_PARSERS))}")
    return parser


def choose_reasoning_parser(template: str) -> ReasoningParser | None:
    """The parser for the replies of a model with this chat template, from the tags it writes; None where it
    writes none (the reply is all content)."""
    if CHANNEL in template:
        return REASONING_PARSERS["openai_gptoss"]
    if "<think>" in template:
        return REASONING_PARSERS["deepseek_r1" if DEEPSEEK_ASSISTANT in template else "qwen3"]
    if "[THINK]" in template:
        return REASONING_PARSERS["mistral"]
    return None
