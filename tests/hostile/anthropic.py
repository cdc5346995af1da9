"""The hostile corpus on Anthropic's routes, /v1/messages and /v1/messages/count_tokens (corpus.py has the
OpenAI-shaped ones): what both read (tools' input_schema, content blocks, the system prompt, the conversation;
some nested past what Python's json recurses through, some just under it, for the stages after the parser), and
what only /v1/messages reads (the thinking switch, max_tokens, stop_sequences, its structured output). Besides
what its `expect` says, an error there must come in Anthropic's shape (harness.py).
"""

from __future__ import annotations

from typing import Any

from tests.hostile.corpus import (
    BOUNDED,
    PROMPT_TOKENS_NEAR_CTX,
    Case,
    backtracking_schema,
    encode,
    mb,
    n,
    tool_parameters,
    within_body_limit,
)

MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
ANTHROPIC_PATHS = (MESSAGES, COUNT_TOKENS)
JUST_UNDER_RECURSION = 900  # Python's default recursion limit is 1000 frames


def nested(opening: str, leaf: str, closing: str, depth: int) -> str:
    """JSON text `depth` levels deep, written out: json.dumps recurses once per level and gives up near 1000."""
    return opening * depth + leaf + closing * depth


def messages(path: str = MESSAGES, raw: tuple[str, str] | None = None, **fields: Any) -> bytes:
    """An Anthropic body (count_tokens takes no generation fields); raw: a field's name and its JSON text, for
    one too deep for json.dumps."""
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    if path == MESSAGES:
        body = {"max_tokens": 4, "temperature": 0, **body}
    if raw is None:
        return encode(body)
    body.pop(raw[0], None)
    return encode(body)[:-1] + b"," * bool(body) + f'"{raw[0]}":{raw[1]}}}'.encode()


def deep_schema_tools(depth: int) -> tuple[str, str]:
    schema = nested('{"type":"object","properties":{"a":', '{"type":"string"}', "}}", depth)
    return "tools", '[{"name":"deep","input_schema":' + schema + "}]"


def deep_tool_use_turns(depth: int) -> tuple[str, str]:
    """An assistant's tool_use whose input nests `depth` levels, and its result."""
    tool_use = '{"type":"tool_use","id":"t1","name":"f","input":' + nested('{"a":', "1", "}", depth) + "}"
    return "messages", ('[{"role":"user","content":"x"},{"role":"assistant","content":[' + tool_use + ']},'
                        '{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"ok"}]}]')


def _input_cases(path: str) -> list[Case]:
    """What both routes read."""
    tag = "messages" if path == MESSAGES else "count_tokens"
    tools = [{"name": f"tool_{i}", "description": "t" * 40, "input_schema": tool_parameters(60)} for i in range(n(400))]
    return [
        Case(f"{tag}: {n(400)} tools x 60 properties, any", "template",
             messages(path, tools=tools, tool_choice={"type": "any"}), path),
        Case(f"{tag}: input_schema {n(100_000)} levels deep", "nesting",
             messages(path, deep_schema_tools(n(100_000))), path),
        Case(f"{tag}: input_schema {JUST_UNDER_RECURSION // 2} levels deep", "nesting",
             messages(path, deep_schema_tools(JUST_UNDER_RECURSION // 2), tool_choice={"type": "any"}), path),
        Case(f"{tag}: tool_use input {n(400_000)} levels deep", "nesting",
             messages(path, deep_tool_use_turns(n(400_000))), path),
        Case(f"{tag}: tool_use input {JUST_UNDER_RECURSION} levels deep", "nesting",
             messages(path, deep_tool_use_turns(JUST_UNDER_RECURSION)), path),
        Case(f"{tag}: {n(120_000)} content blocks", "template",
             messages(path, messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * n(120_000)}]),
             path),
        Case(f"{tag}: system of {mb(1_950_000, 2)}", "template", messages(path, system="s " * n(1_950_000)), path),
        Case(f"{tag}: system as {n(100_000)} blocks", "template",
             messages(path, system=[{"type": "text", "text": "s"}] * n(100_000)), path),
        Case(f"{tag}: {n(100_000)} messages", "template", messages(path, messages=[
            {"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(n(100_000))]), path),
        Case(f"{tag}: lone surrogate in system", "unencodable", messages(path, system="\udfff"), path, expect="4xx"),
        Case(f"{tag} without the key", "auth", messages(path), path, expect="401", auth=False),
    ]


def _generation_cases() -> list[Case]:
    """What only /v1/messages reads."""
    def case(name: str, kind: str, expect: str = BOUNDED, **fields: Any) -> Case:
        return Case(f"messages: {name}", kind, messages(**fields), MESSAGES, expect)

    return [
        case("thinking budget_tokens 0", "range", "4xx", thinking={"type": "enabled", "budget_tokens": 0}),
        case("thinking budget_tokens 2^64", "range", thinking={"type": "enabled", "budget_tokens": 2**64}),
        case("max_tokens 2^31", "range", max_tokens=2**31),
        case("max_tokens 10^30", "range", max_tokens=10**30),
        case("stop_sequences: 1000 strings", "stop strings", stop_sequences=[f"stop-{i}" for i in range(1000)]),
        case(f"stop_sequences: 16 x {mb(240_000)}", "stop strings", max_tokens=128,
             stop_sequences=["s" * n(240_000) + str(i) for i in range(16)]),
        case("output_config: enum vs ^(a|a)*$, 26 chars", "backtracking", max_tokens=2, output_config={
            "format": {"type": "json_schema", "schema": backtracking_schema(26)}}),
        Case("messages: disconnect while prefilling 1.9k", "disconnect", messages(
            messages=[{"role": "user", "content": "hello world " * PROMPT_TOKENS_NEAR_CTX}], max_tokens=100),
            MESSAGES, "dropped", special="disconnect_prefill"),
    ]


def anthropic_cases() -> list[Case]:
    return within_body_limit([*_input_cases(MESSAGES), *_input_cases(COUNT_TOKENS), *_generation_cases()])
