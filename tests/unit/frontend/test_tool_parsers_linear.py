"""Model output is hostile: every tool-call parser costs time linear in the reply, whole or streamed in small
pieces, even over a reply made of its own tags (openers repeated, a run of spaces after one, a block that never
closes, `<parameter=` after `<parameter=`, markers back to back), and JSON a model writes that cannot be read (too
deep, invalid) stays text, never an exception.

Linearity is asserted by a ratio, not a time: a reply 8× as long must cost less than 22× as much (linear work
gives 8×, quadratic 64×: 22 is their geometric mean, as far from one as from the other). Each cost is the best of 5
batches of runs sized to take some milliseconds, the two lengths taking turns, in this thread's CPU time: a
machine busy with other work (CI beside a CPU hog) preempts the thread, and wall time would count that."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Iterator

import pytest

from cobali.frontend.parsers.calls import MAX_JSON_DEPTH
from cobali.frontend.parsers.tools import DEFAULT_TOOL_PARSER, ToolFormat, tool_parser

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
HARMONY_CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
SMALL, LARGE = 4096, 8 * 4096  # characters
PIECE = 4  # characters a streamed feed


def repeated(head: str, unit: str, tail: str = "") -> Callable[[int], str]:
    """A reply of about `size` characters: `head`, `unit` as often as fits, `tail`."""
    return lambda size: head + unit * max(1, (size - len(head) - len(tail)) // len(unit)) + tail


ATTACKS = {  # parser -> case -> reply of a size
    "hermes": {"openers": repeated("", "<tool_call>"), "spaces": repeated("<tool_call>", " "),
               "open block": repeated("<tool_call>", "abcd"),
               "calls": repeated("", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')},
    "qwen3_coder": {"parameters": repeated("<tool_call>\n<function=get_weather>\n", "<parameter=", "</tool_call>"),
                    "values": repeated("<tool_call>\n<function=get_weather>\n", "<parameter=a>x", "</tool_call>")},
    "llama3_json": {"spaces": repeated("{", " "), "list spaces": repeated("[", " "),
                    "deep": repeated('{"parameters": ', "[")},
    "mistral": {"spaces": repeated("[TOOL_CALLS]", " "), "name": repeated("[TOOL_CALLS]", "a"),
                "arguments' spaces": repeated("[TOOL_CALLS]get_weather[ARGS]", " "),
                "deep": repeated("[TOOL_CALLS]", "["), "openers": repeated("", "[TOOL_CALLS]")},
    "deepseek_v3": {"spaces": repeated(DS_BEGIN + DS_CALL, " ", DS_END), "openers": repeated("", DS_BEGIN),
                    "code spaces": repeated(f"{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n", " ",
                                            DS_CALL_END + DS_END)},
    "deepseek_v31": {"spaces": repeated(DS_BEGIN + DS_CALL, " ", DS_END), "calls": repeated(DS_BEGIN, DS_CALL)},
    "openai": {"starts": repeated("", "<|start|>"), "channels": repeated("", "<|channel|>"),
               "markers": repeated("", "<|start|>assistant<|channel|>"), "body": repeated(HARMONY_CALL, " ")},
    "hermes_or_llama3_json": {"spaces": repeated("{", " "), "open block": repeated("<tool_call>", "abcd")},
}


def format_named(name: str) -> ToolFormat:
    return DEFAULT_TOOL_PARSER if name == DEFAULT_TOOL_PARSER.name else tool_parser(name)


def parse(parser: ToolFormat, text: str, streamed: bool) -> None:
    stream = parser.stream(TOOLS)
    for at in range(0, len(text), PIECE if streamed else len(text)):
        stream.feed(text[at:at + (PIECE if streamed else len(text))])
    stream.finish()


def costs(parser: ToolFormat, texts: list[str], streamed: bool, runs: int, batches: int = 5) -> list[float]:
    """Each text's best of `batches` batches of `runs` parses, the texts taking turns, in CPU seconds."""
    best = [float("inf")] * len(texts)
    for _ in range(batches):
        for i, text in enumerate(texts):
            started = time.thread_time()
            for _ in range(runs):
                parse(parser, text, streamed)
            best[i] = min(best[i], time.thread_time() - started)
    return best


@pytest.fixture
def no_gc() -> Iterator[None]:
    """No garbage collection while timing: its pauses fall where they will."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_gc")
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("name", "case"), [(name, case) for name, cases in ATTACKS.items() for case in cases])
def test_a_reply_made_of_the_parsers_own_tags_costs_time_linear_in_its_length(name: str, case: str,
                                                                                streamed: bool) -> None:
    parser, reply = format_named(name), ATTACKS[name][case]
    small, large = reply(SMALL), reply(LARGE)
    runs = 1  # as many runs a batch as make the small reply's take milliseconds: a ratio of microseconds is noise
    while runs < 256 and costs(parser, [small], streamed, runs, batches=1)[0] < 0.002:
        runs *= 4
    small_cost, large_cost = costs(parser, [small, large], streamed, runs)
    ratio = large_cost / small_cost
    assert ratio < 22, f"8× the reply cost {ratio:.1f}× the time (linear: 8×, quadratic: 64×)"


# ---- JSON a model writes that cannot be read stays text -----------------------------------------------------------

DEEP = "[" * 100_000  # Python's json gives up (RecursionError) a thousand deep
UNREADABLE = {  # parser -> (a reply whose call's arguments are `{}` where the JSON goes)
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {}}',
    "mistral": "[TOOL_CALLS]get_weather[ARGS]{}",
    "deepseek_v3": f"{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{}}\n```{DS_CALL_END}{DS_END}",
    "deepseek_v31": f"{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{}}{DS_CALL_END}{DS_END}",
    "openai": HARMONY_CALL + "{}<|call|>",
    "hermes_or_llama3_json": '{"name": "get_weather", "parameters": {}}',
}


def read(parser: ToolFormat, text: str, streamed: bool) -> tuple[str, list[tuple[str, dict]]]:
    stream = parser.stream(TOOLS)
    pieces = [text[at:at + 997] for at in range(0, len(text), 997)] if streamed else [text]
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(d.content for d in deltas), [(c.name, json.loads(c.arguments)) for d in deltas for c in d.calls]


def nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("arguments", [DEEP, DEEP + "]" * len(DEEP), '{"days": "', '{"days": 1]', '{"city": x}',
                                       nested(600)], ids=["deep", "deep closed", "open string", "mismatched",
                                                          "invalid", "600 deep"])
@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_json_a_model_writes_that_does_not_read_is_text(name: str, arguments: str, streamed: bool) -> None:
    """600 deep reads in Python's json at a shallow stack, but not wherever a call's arguments are read again
    (rendering an Anthropic tool_use, deeper in a request's stack): past MAX_JSON_DEPTH, JSON is no call."""
    reply = UNREADABLE[name].replace("{}", arguments, 1)
    assert read(format_named(name), reply, streamed) == (reply, [])


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_qwen3_coder_keeps_a_value_that_does_not_read_as_its_text(streamed: bool) -> None:
    reply = f"<tool_call>\n<function=get_weather>\n<parameter=days>\n{DEEP}\n</parameter>\n</function>\n</tool_call>"
    assert read(tool_parser("qwen3_coder"), reply, streamed) == ("", [("get_weather", {"days": DEEP})])


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_json_up_to_the_depth_limit_reads(name: str) -> None:
    arguments = nested(MAX_JSON_DEPTH - 2)  # within the call's own object and list, where a format has them
    reply = UNREADABLE[name].replace("{}", arguments, 1)
    assert read(format_named(name), reply, streamed=True)[1] == [("get_weather", json.loads(arguments))]
