"""The tool-call parsers, by vLLM's names (`--tool-call-parser NAME`), and the one a chat template calls for.

Each reads a reply whole (`parse(text, tools) -> (content, calls)`) or as it streams (`stream(tools)`, then
`feed(delta)` and `finish()`, each a StreamDelta of text and calls), and writes the grammar of a forced call in
its own format (`forced_call_grammar(functions, parallel)`). Only calls naming one of the request's tools count:
anything else stays text.
"""

from __future__ import annotations

from cobali.frontend.parsers.harmony import CHANNEL
from cobali.frontend.parsers.tools.base import StreamDelta, ToolCallStream, ToolFormat
from cobali.frontend.parsers.tools.deepseek import CALLS_BEGIN, DeepSeek
from cobali.frontend.parsers.tools.either import HermesOrLlama3
from cobali.frontend.parsers.tools.gpt_oss import Harmony
from cobali.frontend.parsers.tools.llama3 import PYTHON_TAG, Llama3Json
from cobali.frontend.parsers.tools.mistral import ARGS, TOOL_CALLS, Mistral
from cobali.frontend.parsers.tools.qwen3_coder import Qwen3Coder
from cobali.frontend.parsers.tools.tagged import Hermes

__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "StreamDelta", "ToolCallStream", "ToolFormat", "choose_tool_parser",
           "tool_parser"]

TOOL_PARSERS: dict[str, ToolFormat] = {parser.name: parser for parser in (
    Hermes(), Qwen3Coder(), Llama3Json(), Mistral(), DeepSeek("deepseek_v3", typed=True),
    DeepSeek("deepseek_v31", typed=False), Harmony())}
DEFAULT_TOOL_PARSER: ToolFormat = HermesOrLlama3()
_MISTRAL_LIST = Mistral(named=False)  # templates from before v11 write the calls as one JSON list


def tool_parser(name: str) -> ToolFormat:
    """The parser `name` stands for; ValueError naming the known ones."""
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown tool-call parser {name!r}: one of {', '.join(sorted(TOOL_PARSERS))}")
    return parser


def choose_tool_parser(template: str) -> ToolFormat:
    """The parser for a model with this chat template, from the way its template writes calls in the history;
    DEFAULT_TOOL_PARSER where it shows none of them."""
    if CHANNEL in template:
        return TOOL_PARSERS["openai"]
    if CALLS_BEGIN in template:
        return TOOL_PARSERS["deepseek_v3" if "```json" in template else "deepseek_v31"]
    if TOOL_CALLS in template:
        return TOOL_PARSERS["mistral"] if ARGS in template else _MISTRAL_LIST
    if "<function=" in template:
        return TOOL_PARSERS["qwen3_coder"]
    if "<tool_call>" in template:
        return TOOL_PARSERS["hermes"]
    if PYTHON_TAG in template or "<|start_header_id|>" in template:
        return TOOL_PARSERS["llama3_json"]
    return DEFAULT_TOOL_PARSER
