"""Every tool-call parser over recorded replies in its family's format: read whole, and streamed split at every
character (in two pieces at each point, and one character at a time, and in random pieces), always the same;
text that only looks like a call stays text; prose before a call is sent before the call is complete; and each
format's forced-call grammar writes what its parser reads (asked of llguidance over a one-byte-a-token
vocabulary)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cobali.frontend.parsers.tools import DEFAULT_TOOL_PARSER, TOOL_PARSERS, ToolFormat, choose_tool_parser, tool_parser
from cobali.frontend.parsers.tools.mistral import Mistral
from tests.structured_oracle import bytes_oracle

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
BOOK = {"type": "object", "properties": {"people": {"type": "integer"}, "when": {"type": "string"},
                                         "vegan": {"type": "boolean"}}}
TOOLS = {"get_weather": WEATHER, "book_table": BOOK}
PARIS = ("get_weather", {"city": "Paris"})
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
HARMONY_CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


@dataclass(frozen=True)
class Reply:
    parser: str
    text: str
    content: str | None  # what parse() gives: None where nothing is left around the calls
    calls: tuple[tuple[str, dict], ...] = ()

    def __str__(self) -> str:
        return f"{self.parser}:{self.text[:40]!r}"


def text(parser: str, reply: str) -> Reply:
    """A reply that is text only, whatever it looks like."""
    return Reply(parser, reply, reply)


REPLIES = [
    # Hermes / Qwen2.5
    Reply("hermes", 'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"days": 2}}\n</tool_call>', "Let me check the weather.", (("get_weather", {"city": "Paris", "days": 2}),)),
    Reply("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>'
          '\n{"name": "book_table", "arguments": {"people": 4, "when": "20:00"}}\n</tool_call>', None,
          (PARIS, ("book_table", {"people": 4, "when": "20:00"}))),
    Reply("hermes", 'Je vérifie… <tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call> 👍',
          "Je vérifie…  👍", (("get_weather", {"city": "Zürich"}),)),
    Reply("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>'
          '\n{"name": "book_ta', None, (PARIS,)),  # the second call cut short by max_tokens
    text("hermes", 'Use <b>bold</b> or <tool> tags; {"name": "get_weather", "arguments": {}} is JSON.'),
    text("hermes", 'Here:\n```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n```'),
    text("hermes", '<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>'),
    text("hermes", "<tool_call>not json</tool_call> and <tool_call"),
    # Qwen3-Coder
    Reply("qwen3_coder", "I will look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
          "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "I will look it up.",
          (("get_weather", {"city": "San Francisco", "days": 3}),)),
    Reply("qwen3_coder", "<tool_call>\n<function=book_table>\n<parameter=people>\n4\n</parameter>\n<parameter=when>\n"
          "Friday\n8 pm\n</parameter>\n<parameter=vegan>\ntrue\n</parameter>\n</function>\n</tool_call>", None,
          (("book_table", {"people": 4, "when": "Friday\n8 pm", "vegan": True}),)),
    Reply("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n</function>\n"
          "</tool_call>", None, (("get_weather", {"city": "12"}),)),  # a string parameter stays a string
    text("qwen3_coder", "In XML you would write <function=f> or <b>x</b>."),
    text("qwen3_coder", "<tool_call>\n<function=send_email>\n<parameter=to>\nx\n</parameter>\n</function>\n"
         "</tool_call>"),
    # Llama 3.x JSON
    Reply("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, (PARIS,)),
    Reply("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "book_table", '
          '"parameters": {"people": 2}}', None, (PARIS, ("book_table", {"people": 2}))),
    Reply("llama3_json", '[{"name": "get_weather", "parameters": {"city": "Oslo; Norway"}}]', None,
          (("get_weather", {"city": "Oslo; Norway"}),)),
    Reply("llama3_json", ' \n{"parameters": {"city": "Paris"}, "name": "get_weather"}', None, (PARIS,)),
    text("llama3_json", 'The JSON {"name": "get_weather"} is an example.'),
    text("llama3_json", '{"city": "Paris", "temp": 21}'),
    text("llama3_json", '{"name": "send_email", "parameters": {}}'),
    text("llama3_json", '{"name": "get_weather", "parameters": {}} and then some prose'),
    text("llama3_json", "<b>bold</b> [1, 2]"),
    # Mistral
    Reply("mistral", 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Let me check.", (PARIS,)),
    Reply("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]book_table[ARGS]{"people": 2, '
          '"when": "[soon]"}', None, (PARIS, ("book_table", {"people": 2, "when": "[soon]"}))),
    Reply("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]', None,
          (PARIS,)),
    Reply("mistral", '[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Lyon"}', None,
          (("get_weather", {"city": "Lyon"}),)),
    text("mistral", "Arrays like [1, 2] and [TOOLS] or [b]x[/b] are text."),
    text("mistral", '[TOOL_CALLS]send_email[ARGS]{"to": "x"}'),
    text("mistral", '[TOOL_CALLS][{"name": ["get_weather"], "arguments": {}}]'),
    # DeepSeek
    Reply("deepseek_v3", f'I will check.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris"}}'
          f'\n```{DS_CALL_END}\n{DS_CALL}function{DS_SEP}book_table\n```json\n{{"people": 2}}\n```{DS_CALL_END}'
          f"{DS_END}", "I will check.", (PARIS, ("book_table", {"people": 2}))),
    Reply("deepseek_v31", f'{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}{DS_CALL_END}{DS_END}', None,
          (PARIS,)),
    text("deepseek_v3", 'Use this:\n```json\n{"city": "Paris"}\n```'),
    text("deepseek_v3", f"{DS_BEGIN}{DS_CALL}function{DS_SEP}send_email\n```json\n{{}}\n```{DS_CALL_END}{DS_END}"),
    # gpt-oss (harmony): raw, and as the gpt-oss reasoning parser leaves it
    Reply("openai", '<|channel|>analysis<|message|>User wants the weather.<|end|>' + HARMONY_CALL + '{"city":"Paris"}'
          "<|call|>", "<|channel|>analysis<|message|>User wants the weather.<|end|>", (PARIS,)),
    Reply("openai", "Checking now." + HARMONY_CALL + '{"city": "Paris"}<|call|>', "Checking now.", (PARIS,)),
    Reply("openai", ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>', None,
          (PARIS,)),
    text("openai", "Tokens look like <|this|> and <b>."),
    text("openai", "<|channel|>final<|message|>It is sunny.<|return|>"),
    text("openai", "<|channel|>commentary to=functions.send_email <|constrain|>json<|message|>{}<|call|>"),
    text("openai", '<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>'),
]


def read(calls: object) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]  # type: ignore[attr-defined]


def streamed(parser: ToolFormat, pieces: list[str]) -> tuple[str | None, list[tuple[str, dict]]]:
    """parse()'s answer, from a stream fed `pieces`: content as parse() gives it (around calls, stripped)."""
    stream = parser.stream(TOOLS)
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    calls = [call for d in deltas for call in d.calls]
    return (content.strip() or None) if calls else content, read(calls)


@pytest.mark.parametrize("reply", REPLIES, ids=str)
def test_each_reply_reads_the_same_whole_and_streamed_at_every_split(reply: Reply) -> None:
    parser = tool_parser(reply.parser)
    content, calls = parser.parse(reply.text, TOOLS)
    assert (content, read(calls)) == (reply.content, list(reply.calls))
    assert all(len(call.id) == 9 for call in calls) if reply.parser == "mistral" else True
    whole = (reply.content, list(reply.calls))
    assert streamed(parser, list(reply.text)) == whole, "one character at a time"
    for cut in range(len(reply.text) + 1):
        assert streamed(parser, [reply.text[:cut], reply.text[cut:]]) == whole, f"split at {cut}"


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(REPLIES), st.lists(st.floats(0, 1), max_size=8))
def test_a_reply_in_any_pieces_reads_as_it_does_whole(reply: Reply, cuts: list[float]) -> None:
    points = sorted({0, len(reply.text), *(int(c * len(reply.text)) for c in cuts)})
    pieces = [reply.text[a:b] for a, b in itertools.pairwise(points)]
    assert streamed(tool_parser(reply.parser), pieces) == (reply.content, list(reply.calls))


@pytest.mark.parametrize("reply", [r for r in REPLIES if r.calls and r.content], ids=str)
def test_prose_before_a_call_is_sent_before_the_call_is_complete(reply: Reply) -> None:
    """Fed one character at a time, all the text before the call has come out by the feed of the call's first
    character, and no call yet."""
    assert reply.content is not None
    same = next(i for i, (a, b) in enumerate(zip(reply.text, reply.content + "\0", strict=False)) if a != b)
    call = same + len(reply.text[same:]) - len(reply.text[same:].lstrip())
    stream = tool_parser(reply.parser).stream(TOOLS)
    deltas = [stream.feed(char) for char in reply.text[:call + 1]]
    assert "".join(d.content for d in deltas) == reply.text[:call]
    assert not any(d.calls for d in deltas)


@pytest.mark.parametrize(("parser", "fed", "sent"), [
    ("hermes", "See <tool_c", "See "), ("hermes", "See <b>", "See <b>"), ("hermes", 'Data {"a": 1} [x]', None),
    ("qwen3_coder", "See <tool_call", "See "), ("qwen3_coder", "<function=get_weather>", None),
    ("mistral", "See [TOOL_CA", "See "), ("mistral", "See [b] and [T", "See [b] and "), ("mistral", "[ARGS] {}", None),
    ("deepseek_v3", "See <｜tool▁calls", "See "), ("deepseek_v3", "See <｜User｜>", None),
    ("openai", "See <|chan", "See "), ("openai", "See <|channel|>final<|mess", "See "), ("openai", "See <b>", None),
    ("openai", "See <|channel|>final<|message|>Hi", None),
    ("llama3_json", '{"name": "get_w', ""), ("llama3_json", " <|python", ""), ("llama3_json", '{"a": 1}', None),
    ("llama3_json", 'Hi {"name": "get_weather"', None), ("llama3_json", '{"name": "send_', None),
    ("llama3_json", '{"name": "get_weather", "parameters": {', ""),
    ("hermes_or_llama3_json", '{"name": "get_w', ""), ("hermes_or_llama3_json", "Hi <tool_c", "Hi "),
])
def test_a_stream_holds_back_only_what_may_open_a_call(parser: str, fed: str, sent: str | None) -> None:
    """sent: what a stream fed `fed` sends at once (None: all of it)."""
    format_ = DEFAULT_TOOL_PARSER if parser == DEFAULT_TOOL_PARSER.name else tool_parser(parser)
    assert format_.stream(TOOLS).feed(fed).content == (fed if sent is None else sent)


def test_a_reply_without_calls_streams_as_it_comes_in_every_format() -> None:
    reply = 'Here is code: `if a < b: print({"x": [1]})` and <i>more</i>.'
    for parser in [*TOOL_PARSERS.values(), DEFAULT_TOOL_PARSER]:
        stream = parser.stream(TOOLS)
        sent = "".join(stream.feed(char).content for char in reply)
        assert sent == reply, parser.name
        assert stream.finish().content == ""


def test_unknown_parsers_are_named() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope': one of deepseek_v3, deepseek_v31, hermes"):
        tool_parser("nope")
    assert choose_tool_parser("{{ messages }}") is DEFAULT_TOOL_PARSER


# ---- forced calls: each format's grammar writes what its parser reads ---------------------------------------------

ORACLE = bytes_oracle()
OSLO = '{"city": "Oslo"}'
FORCED = {  # parser -> (one call of get_weather, Oslo; the same call twice, as `parallel` writes it)
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": ' + OSLO + "}\n</tool_call>", "\n"],
    "qwen3_coder": ["<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
                    "</tool_call>", "\n"],
    "llama3_json": ['{"name": "get_weather", "parameters": ' + OSLO + "}", "; "],
    "mistral": ["[TOOL_CALLS]get_weather[ARGS]" + OSLO, ""],
    "deepseek_v3": [f"{DS_CALL}function{DS_SEP}get_weather\n```json\n{OSLO}\n```{DS_CALL_END}", "\n"],
    "deepseek_v31": [f"{DS_CALL}get_weather{DS_SEP}{OSLO}{DS_CALL_END}", "\n"],
    "openai": ["<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + OSLO, None],
}
AROUND = {"deepseek_v3": (DS_BEGIN, DS_END), "deepseek_v31": (DS_BEGIN, DS_END)}


def forced(parser: str, calls: int) -> str:
    call, separator = FORCED[parser]
    before, after = AROUND.get(parser, ("", ""))
    return before + (separator or "").join([call] * calls) + after


@pytest.mark.parametrize("parser", sorted(FORCED))
def test_a_forced_call_is_written_in_the_parsers_own_format(parser: str) -> None:
    format_ = tool_parser(parser)
    functions = [("get_weather", WEATHER), ("book_table", None)]
    one = format_.forced_call_grammar(functions, parallel=False)
    assert ORACLE.allows(one, forced(parser, 1))
    assert not ORACLE.allows(one, forced(parser, 1).replace("get_weather", "get_wether"))
    assert not ORACLE.allows(one, forced(parser, 1).replace("city", "town"))  # not in the schema
    assert read(format_.parse(forced(parser, 1), TOOLS)[1]) == [("get_weather", {"city": "Oslo"})]
    if FORCED[parser][1] is None:
        return  # gpt-oss ends its turn with each call: one a reply
    parallel = format_.forced_call_grammar(functions, parallel=True)
    assert ORACLE.allows(parallel, forced(parser, 2)) and not ORACLE.allows(one, forced(parser, 2))
    assert read(format_.parse(forced(parser, 2), TOOLS)[1]) == [("get_weather", {"city": "Oslo"})] * 2


def test_mistral_before_v11_is_forced_as_one_json_list() -> None:
    legacy = choose_tool_parser("{{ '[TOOL_CALLS]' }}{{ tool_calls | tojson }}")
    assert isinstance(legacy, Mistral) and not legacy.named
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + OSLO + "}]"
    assert ORACLE.allows(legacy.forced_call_grammar([("get_weather", WEATHER)], parallel=False), text)
    assert read(legacy.parse(text, TOOLS)[1]) == [("get_weather", {"city": "Oslo"})]


def test_qwen3_coder_forces_string_values_as_text_and_others_as_json() -> None:
    grammar = tool_parser("qwen3_coder").forced_call_grammar([("book_table", BOOK)], parallel=False)

    def call(parameters: str) -> str:
        return f"<tool_call>\n<function=book_table>\n{parameters}</function>\n</tool_call>"

    allowed = [call(""), call("<parameter=vegan>\nfalse\n</parameter>\n"),
               call("<parameter=people>\n4\n</parameter>\n<parameter=when>\nFri <b>8</b>\npm\n</parameter>\n")]
    assert all(ORACLE.allows(grammar, text) for text in allowed)
    refused = [call("<parameter=people>\nfour\n</parameter>\n"), call("<parameter=other>\nx\n</parameter>\n"),
               call("<parameter=vegan>\nfalse\n</parameter>\n<parameter=people>\n4\n</parameter>\n")]
    assert not any(ORACLE.allows(grammar, text) for text in refused)
