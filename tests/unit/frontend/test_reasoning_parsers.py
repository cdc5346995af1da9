"""Every reasoning parser over recorded replies of its family: read whole, and streamed split at every character
(in two pieces at each point, and one character at a time), always the same; a reply that starts inside the think
block its prompt opened, one with no think block, one cut short; a tag-like text that is no tag stays content;
and a stream holds back no more than what may be a tag."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cobali.frontend.parsers.reasoning import REASONING_PARSERS, choose_reasoning_parser, reasoning_parser
from cobali.frontend.parsers.tools import tool_parser

QWEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
R1_PROMPT = "<｜User｜>What is 2+2?<｜Assistant｜><think>\n"
HARMONY_PROMPT = "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant"
HARMONY_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city":"Paris"}<|call|>')


@dataclass(frozen=True)
class Reply:
    parser: str
    text: str
    reasoning: str | None
    content: str | None
    prompt: str = ""

    def __str__(self) -> str:
        return f"{self.parser}:{self.text[:40]!r}"


REPLIES = [
    Reply("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", "The user greets me.\n",
          "Hello! How can I help?", QWEN_PROMPT),
    Reply("qwen3", "Hello <b>there</b>, 2 < 3.", None, "Hello <b>there</b>, 2 < 3.", QWEN_PROMPT),
    Reply("qwen3", "Plan: say hi.\n</think>\n\nHi!", "Plan: say hi.\n", "Hi!", QWEN_PROMPT + "<think>\n"),
    Reply("qwen3", "Hi!", None, "Hi!", QWEN_PROMPT + "<think>\n\n</think>\n\n"),  # enable_thinking: false
    Reply("qwen3", "<think>\nStill thinking when max_tokens came", "Still thinking when max_tokens came", None),
    Reply("qwen3", "<thinking> is no tag, nor is </think> here.", None, "<thinking> is no tag, nor is </think> here."),
    Reply("qwen3", "Use the <think> tag like this.", None, "Use the <think> tag like this."),
    Reply("qwen3", "<think>\n\n</think>\n\n```python\nprint('<think>')\n```", None, "```python\nprint('<think>')\n```"),
    Reply("deepseek_r1", "Okay, 2+2 is 4.\n</think>\n\nThe answer is **4**.", "Okay, 2+2 is 4.\n",
          "The answer is **4**.", R1_PROMPT),
    Reply("deepseek_r1", "<think>\nHmm, <b>simple</b>.\n</think>\nFour.", "Hmm, <b>simple</b>.\n", "Four."),
    Reply("deepseek_r1", "A reply that never closes its thinking", "A reply that never closes its thinking", None),
    Reply("deepseek_r1", "Four.", None, "Four.", "<｜Assistant｜><think>\n\n</think>"),
    Reply("mistral", "[THINK]Simple greeting.[/THINK]Hello! [b]Welcome[/b].", "Simple greeting.",
          "Hello! [b]Welcome[/b]."),
    Reply("mistral", "Arrays [1, 2] and [THINKING] are text.", None, "Arrays [1, 2] and [THINKING] are text."),
    Reply("openai_gptoss", "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant<|channel|>"
          "final<|message|>2 + 2 = 4.<|return|>", "User asks 2+2. Easy.", "2 + 2 = 4.", HARMONY_PROMPT),
    Reply("openai_gptoss", "<|channel|>analysis<|message|>Need the weather.<|end|>" + HARMONY_CALL,
          "Need the weather.", HARMONY_CALL, HARMONY_PROMPT),
    Reply("openai_gptoss", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
          "<|message|>Done.<|end|>", None, "Checking.Done.", HARMONY_PROMPT),
    Reply("openai_gptoss", ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>',
          None, '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}'
          "<|call|>", HARMONY_PROMPT),
    Reply("openai_gptoss", "It is 4.", None, "It is 4.", HARMONY_PROMPT + "<|channel|>final<|message|>"),
    Reply("openai_gptoss", "<|channel|>analysis<|message|>A long thought cut short", "A long thought cut short",
          None, HARMONY_PROMPT),
    Reply("openai_gptoss", "Just text, <b>no</b> harmony <|here|>.", None, "Just text, <b>no</b> harmony <|here|>."),
    Reply("openai_gptoss", "<|channel|>final\nnot a header<|message|>x", None, "<|channel|>final\nnot a header"
          "<|message|>x"),
    # Issue 44: whitespace before the tag, kept aside as it streams; a header too long to be one; tags back to back.
    Reply("qwen3", " \n\t <think>\n  x</think>  y", "x", "y"),
    Reply("qwen3", "  \n  Hello", None, "  \n  Hello"),
    Reply("deepseek_r1", "  \n Hmm</think>\n\n  Four.", "Hmm", "Four."),
    Reply("openai_gptoss", "<|channel|>" + "a" * 300 + "<|message|>x<|end|>", None,
          "<|channel|>" + "a" * 300 + "<|message|>x"),
    Reply("openai_gptoss", "<|start|><|start|><|end|><|channel|>analysis<|message|>a<|end|><|start|>", "a",
          "<|start|><|start|><|start|>"),
]


def streamed(reply: Reply, pieces: list[str]) -> tuple[str | None, str | None]:
    stream = reasoning_parser(reply.parser).stream(reply.prompt)
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(d.reasoning for d in deltas) or None, "".join(d.content for d in deltas) or None


@pytest.mark.parametrize("reply", REPLIES, ids=str)
def test_each_reply_reads_the_same_whole_and_streamed_at_every_split(reply: Reply) -> None:
    whole = reasoning_parser(reply.parser).parse(reply.text, reply.prompt)
    assert whole == (reply.reasoning, reply.content)
    assert streamed(reply, list(reply.text)) == whole, "one character at a time"
    for cut in range(len(reply.text) + 1):
        assert streamed(reply, [reply.text[:cut], reply.text[cut:]]) == whole, f"split at {cut}"


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(REPLIES), st.lists(st.floats(0, 1), max_size=8))
def test_a_reply_in_any_pieces_reads_as_it_does_whole(reply: Reply, cuts: list[float]) -> None:
    points = sorted({0, len(reply.text), *(int(c * len(reply.text)) for c in cuts)})
    assert streamed(reply, [reply.text[a:b] for a, b in itertools.pairwise(points)]) == (reply.reasoning, reply.content)


@pytest.mark.parametrize(("parser", "prompt", "pieces", "sent"), [
    ("qwen3", "", ["<think>\nI am thinking about it", " </thi", "nk>\n\nAnswer <b>", "!"],
     [("I am thinking about it", ""), (" ", ""), ("", "Answer <b>"), ("", "!")]),
    ("qwen3", "", ["<", "p>Hi"], [("", ""), ("", "<p>Hi")]),
    ("qwen3", "", ["  <thi", "s is text"], [("", ""), ("", "  <this is text")]),
    ("deepseek_r1", R1_PROMPT, ["Thinking <", "b> more", "</think>", "\n\n", "Done"],
     [("Thinking ", ""), ("<b> more", ""), ("", ""), ("", ""), ("", "Done")]),
    ("openai_gptoss", HARMONY_PROMPT, ["<|channel|>analysis<|message|>Thinking", "<|en", "d|><|start|>assistant",
                                       "<|channel|>final<|message|>Hi", " there<|return|>"],
     [("Thinking", ""), ("", ""), ("", ""), ("", "Hi"), ("", " there")]),
    ("openai_gptoss", HARMONY_PROMPT, ["Plain", " text <", "b>"], [("", "Plain"), ("", " text "), ("", "<b>")]),
])
def test_a_stream_holds_back_only_what_may_be_a_tag(parser: str, prompt: str, pieces: list[str],
                                                     sent: list[tuple[str, str]]) -> None:
    stream = reasoning_parser(parser).stream(prompt)
    assert [tuple(stream.feed(piece)) for piece in pieces] == sent


@pytest.mark.parametrize(("parser", "prompt", "read"), [
    ("qwen3", "x" * 1_000_000 + QWEN_PROMPT + "<think>" + "\n" * 1000, ("Plan.", "Hi")),
    ("qwen3", "<think>" + " " * 300 + "x", (None, "Plan.</think>Hi")),
    ("deepseek_r1", "x" * 1_000_000 + "<think>\n\n</think>" + " " * 1000, (None, "Plan.</think>Hi")),
    ("openai_gptoss", "x" * 1_000_000 + HARMONY_PROMPT + "<|channel|>analysis<|message|>", ("Plan.</think>Hi", None)),
    ("openai_gptoss", "<|start|>assistant<|channel|>" + "a" * 300 + "<|message|>", (None, "Plan.</think>Hi")),
    ("openai_gptoss", "a" * 300 + "<|message|>", (None, "Plan.</think>Hi")),
])
def test_only_the_prompts_end_tells_where_the_reply_starts(parser: str, prompt: str,
                                                           read: tuple[str | None, str | None]) -> None:
    """A template's opened block is found at the prompt's end, however long the prompt (a header is at most
    MAX_HEADER characters: one longer is none)."""
    assert reasoning_parser(parser).parse("Plan.</think>Hi", prompt) == read


def test_the_gpt_oss_reasoning_parser_leaves_calls_for_the_tool_parser_at_every_split() -> None:
    reply = "<|channel|>analysis<|message|>Need the weather.<|end|>" + HARMONY_CALL
    for cut in range(len(reply) + 1):
        reasoning = reasoning_parser("openai_gptoss").stream(HARMONY_PROMPT)
        tools = tool_parser("openai").stream({"get_weather"})
        thought, text, calls = "", "", []
        for piece in (reply[:cut], reply[cut:], None):
            read = reasoning.feed(piece) if piece is not None else reasoning.finish()
            found = tools.feed(read.content)
            thought, text, calls = thought + read.reasoning, text + found.content, calls + list(found.calls)
        found = tools.finish()
        text, calls = text + found.content, calls + list(found.calls)
        assert (thought, text, [(c.name, c.arguments) for c in calls]) == (
            "Need the weather.", "", [("get_weather", '{"city": "Paris"}')]), cut


def test_parsers_by_name_and_by_template() -> None:
    assert reasoning_parser("gpt_oss") is REASONING_PARSERS["openai_gptoss"]
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2': one of deepseek_r1, mistral, openai_gptoss"):
        reasoning_parser("r2")
    assert choose_reasoning_parser("{{ messages }}") is None
    assert choose_reasoning_parser("<think>") is REASONING_PARSERS["qwen3"]
    assert choose_reasoning_parser("<｜Assistant｜><think>") is REASONING_PARSERS["deepseek_r1"]
