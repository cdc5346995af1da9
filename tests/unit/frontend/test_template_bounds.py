"""A chat template's render costs at most what the context holds (issue 44): it stops once past its bound, and so
does tojson, whose indented text repeats the value's depth in every line; what the template is given is bounded
before it runs (its depth, and only the request's variables it reads, by bytes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cobali.backends.base import TemplateSource
from cobali.frontend.chat_template import ChatPrompter, JinjaChatTemplate, PromptTooLong
from cobali.frontend.request_limits import nests_deeper

LLAMA3 = (Path(__file__).resolve().parents[3] / "cobali" / "templates" / "llama3.jinja").read_text()
USER = [{"role": "user", "content": "hi"}]
BOUND = 50_000


def nested(depth: int) -> list:
    """[[[...]]], `depth` levels (built without recursion, as any depth may be)."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


class CountingTemplate:
    """A compiled template whose stream counts the characters it wrote: what a render drew from it."""

    def __init__(self, template: Any) -> None:
        self.template = template
        self.chars = 0

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        for piece in self.template.generate(*args, **kwargs):
            self.chars += len(piece)
            yield piece


def counted(template: JinjaChatTemplate) -> CountingTemplate:
    counting = CountingTemplate(template.template)
    template.template = counting
    return counting


@pytest.mark.parametrize("options", [{}, {"indent": 4}, {"indent": 2, "sort_keys": True},
                                     {"separators": (",", ":")}, {"ensure_ascii": True}])
def test_tojson_writes_what_hugging_faces_writes(options: dict) -> None:
    """json.dumps with the template's arguments (transformers' tojson): not HTML-escaped, not ASCII unless asked."""
    value = {"b": ["<é>", 1.5, None, True], "a": {"x": [{}, []]}}
    rendered = JinjaChatTemplate("{{ value | tojson(**options) }}").render(USER, None, {"value": value,
                                                                                      "options": options})
    assert rendered == json.dumps(value, **{"ensure_ascii": False, **options})


def test_a_render_stops_once_past_its_bound() -> None:
    """Llama 3.1's custom_tools, many shallow values each indented: written whole, 80 times the bound."""
    tools = [nested(60)] * 300
    assert len(json.dumps(nested(60), indent=4)) * len(tools) > 80 * BOUND
    template = JinjaChatTemplate(LLAMA3, max_chars=BOUND)
    stream = counted(template)
    with pytest.raises(PromptTooLong) as refused:
        template.render(USER, None, {"custom_tools": tools})
    assert refused.value.max_chars == BOUND
    one_tool = len(json.dumps(nested(60), indent=4))
    assert BOUND < stream.chars <= BOUND + one_tool  # stopped at the first piece past it


def test_one_tojson_past_the_bound_stops_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """One value whose indented text is 80 times the bound: it is never written whole."""
    drawn = []
    encode = json.JSONEncoder.iterencode

    def counting(self: json.JSONEncoder, value: Any, _one_shot: bool = False) -> Iterator[str]:
        for piece in encode(self, value, _one_shot):
            drawn.append(len(piece))
            yield piece

    monkeypatch.setattr(json.JSONEncoder, "iterencode", counting)
    template = JinjaChatTemplate(LLAMA3, max_chars=BOUND)
    stream = counted(template)
    with pytest.raises(PromptTooLong):
        template.render(USER, [[nested(60)] * 300])
    assert BOUND < sum(drawn) <= BOUND + max(drawn)
    assert stream.chars < BOUND  # the template wrote nothing of it


def test_within_its_bound_a_render_is_whole() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": nested(10)}}}]
    whole = JinjaChatTemplate(LLAMA3).render(USER, tools)
    assert JinjaChatTemplate(LLAMA3, max_chars=len(whole)).render(USER, tools) == whole
    with pytest.raises(PromptTooLong):
        JinjaChatTemplate(LLAMA3, max_chars=len(whole) - 1).render(USER, tools)


def test_depth_is_measured_at_any_depth_without_recursion() -> None:
    assert not nests_deeper("text", 0) and nests_deeper([], 0)
    assert not nests_deeper(nested(64), 64) and nests_deeper(nested(65), 64)
    assert not nests_deeper({"a": nested(63), "b": 1}, 64) and nests_deeper({"a": [nested(64)]}, 64)
    assert nests_deeper(nested(200_000), 64)  # json's own reader gives out at ~1000


def test_a_template_recursing_past_the_stack_is_a_value_error() -> None:
    """What the limits let through can still recurse too deep in a template of its own: a 400, not a 500."""
    recursing = "{% macro walk(v) %}[{% for x in v %}{{ walk(x) }}{% endfor %}]{% endmacro %}{{ walk(deep) }}"
    with pytest.raises(ValueError, match="nest too deep"):
        JinjaChatTemplate(recursing).render(USER, None, {"deep": nested(5000)})


def test_only_the_variables_a_template_reads_are_passed() -> None:
    prompter = ChatPrompter(TemplateSource(LLAMA3), lambda messages: "")
    assert {"custom_tools", "tools", "messages"} <= prompter.jinja.reads if prompter.jinja else False
    assert prompter.variables_read({"custom_tools": [], "unread": "x" * 100}) == {"custom_tools": []}
    assert ChatPrompter(TemplateSource(None), lambda messages: "").variables_read({"custom_tools": []}) == {}
