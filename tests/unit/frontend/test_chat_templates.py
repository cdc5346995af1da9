"""The test chat templates shipped in cobali/templates, one per model family: each renders a conversation with a
tool call and its result the way Hugging Face renders templates, names its family's tags so the choosers pick
its parsers, writes the call in its history the way those parsers read it back, and leaves the reply's reasoning
where its reasoning parser looks for it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cobali.frontend.chat_template import JinjaChatTemplate
from cobali.frontend.parsers.reasoning import choose_reasoning_parser
from cobali.frontend.parsers.tools import choose_tool_parser

TEMPLATES = Path(__file__).resolve().parents[3] / "cobali" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASKED = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CALLED = {"role": "assistant", "content": "Let me check.", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
CONVERSATION = [*ASKED, CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "assistant", "content": "It is sunny in Paris."},
                {"role": "user", "content": "Thanks! And Rome?"}]


@dataclass(frozen=True)
class Family:
    template: str
    bos: str
    turn_ends: tuple[str, ...]  # what ends an assistant turn in the history
    reasoning: str | None
    tools: str
    thinking: str = ""  # a reply that thinks, then answers "Let me check Rome."

    def __str__(self) -> str:
        return self.template

    def load(self) -> JinjaChatTemplate:
        return JinjaChatTemplate((TEMPLATES / self.template).read_text(), self.bos, self.turn_ends[0])

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool, **extra: Any) -> str:
        template = self.load()
        return template.template.render(messages=messages, tools=[WEATHER], add_generation_prompt=generation_prompt,
                                        bos_token=template.bos_token, eos_token=template.eos_token, **extra)


FAMILIES = [
    Family("qwen3.jinja", "", ("<|im_end|>",), "qwen3", "hermes",
           "<think>\nRome next.\n</think>\n\nLet me check Rome."),
    Family("qwen3_coder.jinja", "", ("<|im_end|>",), None, "qwen3_coder"),
    Family("llama3.jinja", "<|begin_of_text|>", ("<|eot_id|>", "<|eom_id|>"), None, "llama3_json"),
    Family("mistral.jinja", "<s>", ("</s>",), "mistral", "mistral",
           "[THINK]Rome next.\n[/THINK]\n\nLet me check Rome."),
    Family("deepseek.jinja", "<｜begin▁of▁sentence｜>", ("<｜end▁of▁sentence｜>",), "deepseek_r1", "deepseek_v3",
           "Rome next.\n</think>\n\nLet me check Rome."),  # its prompt opened the think block
    Family("gpt_oss.jinja", "", ("<|end|><|start|>user", "<|return|>"), "openai_gptoss", "openai",
           "<|channel|>analysis<|message|>Rome next.\n<|end|><|start|>assistant<|channel|>final<|message|>"
           "Let me check Rome.<|return|>"),
]


def test_there_is_a_test_for_each_template_shipped() -> None:
    assert {f.template for f in FAMILIES} | {"chatml_tools.jinja"} == {p.name for p in TEMPLATES.glob("*.jinja")}


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_the_template_names_its_family_so_its_parsers_are_chosen(family: Family) -> None:
    text = (TEMPLATES / family.template).read_text()
    assert choose_tool_parser(text).name == family.tools
    chosen = choose_reasoning_parser(text)
    assert (chosen.name if chosen else None) == family.reasoning
    prompt = family.load().render(CONVERSATION, [WEATHER])
    assert "get_weather" in prompt and "Current weather in a city" in prompt and "sunny" in prompt
    assert prompt.startswith(family.bos) and "Thanks! And Rome?" in prompt
    assert "get_weather" not in family.load().render(CONVERSATION[3:])  # without tools, none are described


@pytest.mark.parametrize("family", FAMILIES, ids=str)
def test_the_call_in_the_history_reads_back_with_the_chosen_parser(family: Family) -> None:
    """The assistant turn as the template writes it, after the generation prompt's header and up to the turn's
    end, read as a reply."""
    before = family.render(ASKED, generation_prompt=False)
    header = family.render(ASKED, generation_prompt=True)[len(before):]
    after = family.render([*ASKED, CALLED], generation_prompt=False)
    assert after.startswith(before)
    turn = after[len(before):]
    while header and not turn.startswith(header):
        header = header[:-1]  # a header that opens a think block the history does not show
    reply = turn[len(header):]
    for end in family.turn_ends:
        reply = reply.split(end)[0]
    parser = choose_tool_parser((TEMPLATES / family.template).read_text())
    content, calls = parser.parse(reply, {"get_weather"})
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')], reply
    assert content is None or "Let me check." in content


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.reasoning], ids=str)
def test_the_reasoning_of_a_reply_to_the_rendered_prompt_is_read_apart(family: Family) -> None:
    prompt = family.render(CONVERSATION, generation_prompt=True)
    parser = choose_reasoning_parser((TEMPLATES / family.template).read_text())
    assert parser is not None
    assert parser.parse(family.thinking, prompt) == ("Rome next.\n", "Let me check Rome.")


def test_qwen3_without_thinking_closes_the_think_block_in_the_prompt() -> None:
    [qwen3] = [f for f in FAMILIES if f.template == "qwen3.jinja"]
    prompt = qwen3.render(CONVERSATION, generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    parser = choose_reasoning_parser((TEMPLATES / qwen3.template).read_text())
    assert parser is not None and parser.parse("Let me check Rome.", prompt) == (None, "Let me check Rome.")


def test_earlier_replies_are_shown_without_their_thinking() -> None:
    thought = [*ASKED, {"role": "assistant", "content": "<think>\nSecret plan.\n</think>\n\nSunny."},
               {"role": "user", "content": "Sure?"}]
    for family in FAMILIES:
        if family.reasoning in ("qwen3", "deepseek_r1"):
            prompt = family.load().render(thought)
            assert "Secret plan" not in prompt and "Sunny." in prompt, family


def test_llama3_reads_its_tools_from_custom_tools_as_metas_does() -> None:
    """A request's chat_template_kwargs may set custom_tools (bounded as every variable a template reads)."""
    [llama3] = [f for f in FAMILIES if f.template == "llama3.jinja"]
    template = llama3.load()
    assert "custom_tools" in template.reads
    assert template.render(CONVERSATION, None, {"custom_tools": [WEATHER]}) == template.render(CONVERSATION, [WEATHER])
