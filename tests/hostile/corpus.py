"""The hostile corpus of issue 36: one or more bodies for every class of unbounded work it names.

Each Case is sent to a real `cobali serve` (--api-key set, --allow-runtime-lora-updating) by harness.py while a
normal 2-token request runs beside it every 0.5 s. What a case must get back (`expect`):
- BOUNDED: a 4xx, or a 200 whose work is bounded (it comes back within the time limit);
- "4xx": a client error (unencodable text, a priority out of range);
- "401": the route follows the API key;
- "same": the two bodies of a pair get the same answer (the LoRA load oracle);
- "dropped": a client that stops reading, or disconnects, stops costing the server (streams.py).

/health's text after an engine failure is not here: nothing a client sends makes the engine fail (a crashed fake
engine's /health is tests/unit/http/test_reliability.py's).
Bodies are serialized with ASCII escapes, so a lone surrogate travels as the JSON escape "\\ud800".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cobali.http.config import DEFAULT_MAX_BODY_BYTES

BOUNDED = "4xx or bounded 200"
BODY_LIMIT = DEFAULT_MAX_BODY_BYTES  # cobali serve's --max-body-bytes: the largest bodies come near it
SCALE = BODY_LIMIT / (4 * 1024 * 1024)  # the sizes below were written for a 4 MiB limit


def n(count: int) -> int:
    """A count written for a 4 MiB body, for the body limit in force."""
    return max(1, int(count * SCALE))


def mb(count: int, unit: int = 1) -> str:
    return f"{n(count) * unit / 1e6:.1f} MB"
PROMPT_TOKENS_NEAR_CTX = 950  # "hello world " repeated: ~1900 of the 2048 tokens a request may use


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # the class of issue 36 it belongs to
    body: bytes | None = None  # None: a GET
    path: str = "/v1/completions"
    expect: str = BOUNDED
    auth: bool = True
    special: str | None = None  # "lora_oracle", "stalled_sse", "disconnect_decode", "disconnect_prefill"


def encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def completion(**fields: Any) -> bytes:
    return encode({"prompt": "x", "max_tokens": 4, "temperature": 0, **fields})


def chat(**fields: Any) -> bytes:
    return encode({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0, **fields})


def schema_format(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def nested_parens_grammar(depth: int) -> str:
    """GBNF with `depth` nested groups: llama.cpp's parser recurses once per group (upstream issue #26600)."""
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def rule_chain_grammar(length: int, cycle: bool = False) -> str:
    """Rules each naming the next (the left-recursion check walks the whole chain); `cycle`: the last names root
    again, so the chain is left-recursive."""
    last = 'root "a" | "b"' if cycle else '"a"'
    return "root ::= r1\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(1, length)) + f"r{length} ::= {last}\n"


def alternation_grammar(width: int) -> str:
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(width))


def ambiguous_grammar(width: int) -> str:
    """Every character matched `width`² ways: each sampled token costs O(stacks × vocabulary)."""
    return ("root ::= x+\nx ::= " + " | ".join(["y"] * width) + "\ny ::= " + " | ".join(["[a-z]"] * width) + "\n")


def backtracking_schema(chars: int, pattern: str = "^(a|a)*$") -> dict:
    """An enum value checked against its own backtracking pattern: 2^chars steps of Python's re."""
    return {"type": "string", "pattern": pattern, "enum": ["a" * chars + "!"]}


def backtracking_body(chars: int = 26) -> bytes:
    """Issue 36's 150-byte body that held everyone for 9 s."""
    return completion(max_tokens=2, response_format=schema_format(backtracking_schema(chars)))


def ref_sibling_schema(depth: int) -> dict:
    """Each level refers twice to the one below with a keyword beside the $ref: inlined on every branch, the
    grammar doubles with each level."""
    defs: dict[str, Any] = {"d0": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    for k in range(1, depth + 1):
        below = f"#/$defs/d{k - 1}"
        defs[f"d{k}"] = {"type": "object", "properties": {"a": {"$ref": below, "type": "object"},
                                                          "b": {"$ref": below, "minProperties": 0}}}
    return {"$ref": f"#/$defs/d{depth}", "type": "object", "$defs": defs}


def merged_enums_schema(members: int, width: int) -> dict:
    return {"allOf": [{"enum": [f"v{j}" for j in range(i, width + i)]} for i in range(members)]}


def tool_parameters(properties: int) -> dict:
    return {"type": "object", "properties": {f"p{j}": {"type": "string", "description": "d" * 20}
                                             for j in range(properties)}, "required": [f"p{j}" for j in range(4)]}


def big_tools(count: int, properties: int) -> list[dict]:
    params = tool_parameters(properties)
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": "t" * 40, "parameters": params}}
            for i in range(count)]


def _grammar_cases() -> list[Case]:
    return [
        Case("grammar: 100k nested parens", "grammar parser", completion(grammar=nested_parens_grammar(100_000))),
        Case(f"guided_grammar: {mb(500_000, 2)} of nesting", "grammar parser",
             completion(guided_grammar=nested_parens_grammar(n(500_000)))),
        Case(f"grammar: {n(100_000)}-rule chain", "grammar parser",
             completion(structured_outputs={"grammar": rule_chain_grammar(n(100_000))})),
        Case(f"grammar: {n(50_000)}-rule left-recursive cycle", "grammar parser",
             completion(grammar=rule_chain_grammar(n(50_000), cycle=True))),
        Case(f"grammar: {n(200_000)}-way alternation", "alternation",
             completion(grammar=alternation_grammar(n(200_000)))),
        Case("grammar: 300x300 ambiguous stacks", "alternation",
             completion(grammar=ambiguous_grammar(300), max_tokens=16)),
    ]


def _schema_cases() -> list[Case]:
    return [
        Case("json_schema: enum vs ^(a|a)*$, 26 chars", "backtracking", backtracking_body(26)),
        Case("guided_json: const vs ^(a+)+$, 28 chars", "backtracking", completion(guided_json={
            "type": "string", "pattern": "^(a+)+$", "const": "a" * 28 + "!"})),
        Case("json_schema: $ref + siblings, 2^24", "schema blow-up",
             completion(response_format=schema_format(ref_sibling_schema(24)))),
        Case(f"guided_json: {n(100_000)}-value enum", "huge enum",
             completion(guided_json={"enum": [f"value-{i}" for i in range(n(100_000))]})),
        Case(f"json_schema: allOf of 6 x {n(30_000)} enums", "huge enum",
             completion(json_schema=merged_enums_schema(6, n(30_000)))),
        Case("json_schema: 20k required properties", "schema blow-up", completion(response_format=schema_format({
            "type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(20_000)},
            "required": [f"k{i}" for i in range(20_000)]}))),
    ]


def _regex_cases() -> list[Case]:
    return [
        Case(f"guided_regex: {n(200_000)}-way alternation", "alternation",
             completion(guided_regex="(" + "|".join(f"w{i}" for i in range(n(200_000))) + ")")),
        Case("regex: ((a{1,99}){1,99}){1,99}", "alternation",
             completion(structured_outputs={"regex": "((a{1,99}){1,99}){1,99}"})),
        Case(f"guided_choice: {n(200_000)} choices", "alternation",
             completion(guided_choice=[f"choice-{i}" for i in range(n(200_000))])),
    ]


def _stop_and_logprob_cases() -> list[Case]:
    long_prompt = "hello world " * PROMPT_TOKENS_NEAR_CTX
    return [
        Case(f"stop: 16 x {mb(240_000)}", "stop strings",
             completion(stop=["s" * n(240_000) + str(i) for i in range(16)], max_tokens=128, ignore_eos=True)),
        Case(f"stop: one of {mb(3_900_000)}", "stop strings",
             completion(stop="z" * n(3_900_000), max_tokens=128, ignore_eos=True)),
        Case("stop: 1000 strings", "stop strings", completion(stop=[f"stop-{i}" for i in range(1000)])),
        Case("n=16 x prompt_logprobs=20 x 1.9k tokens", "logprobs",
             completion(prompt=long_prompt, n=16, prompt_logprobs=20, max_tokens=1)),
        Case("n=16 x echo logprobs=20 x 1.9k tokens", "logprobs",
             completion(prompt=long_prompt, n=16, echo=True, logprobs=20, max_tokens=1)),
    ]


def _loop_work_cases() -> list[Case]:
    chat_path = "/v1/chat/completions"
    return [
        Case(f"prompt: {mb(1_950_000, 2)} of text", "tokenization", completion(prompt="a " * n(1_950_000))),
        Case(f"prompt: 16 x {mb(120_000, 2)}", "tokenization", completion(prompt=["b " * n(120_000)] * 16)),
        Case(f"chat: {n(100_000)} messages", "template",
             encode({"messages": [{"role": "user", "content": "hi"}] * n(100_000), "max_tokens": 4}), chat_path),
        Case(f"chat: one {mb(1_950_000, 2)} message", "template",
             chat(messages=[{"role": "user", "content": "c " * n(1_950_000)}]), chat_path),
        Case(f"chat: {n(400)} tools x 60 properties, required", "template",
             chat(tools=big_tools(n(400), 60), tool_choice="required", max_tokens=16), chat_path),
        Case("logit_bias: the whole vocabulary", "tokenization",
             completion(logit_bias={str(i): 1.0 for i in range(49_152)})),
    ]


def _contract_cases() -> list[Case]:
    return [
        Case("lone surrogate in model", "unencodable", completion(model="\ud800"), expect="4xx"),
        Case("lone surrogate in an echoed prompt", "unencodable", completion(prompt="hi \ud800", echo=True,
                                                                             max_tokens=16), expect="4xx"),
        Case("lone surrogate in a chat message", "unencodable",
             chat(messages=[{"role": "user", "content": "\udfff"}]), "/v1/chat/completions", expect="4xx"),
        Case("lone surrogate in a stop string", "unencodable", completion(stop=["\ud800"]), expect="4xx"),
        Case("/docs without the key", "auth", None, "/docs", expect="401", auth=False),
        Case("/redoc without the key", "auth", None, "/redoc", expect="401", auth=False),
        Case("/openapi.json without the key", "auth", None, "/openapi.json", expect="401", auth=False),
        *_template_cases(),
        Case("priority 2^31", "priority", completion(priority=2**31), expect="4xx"),
        Case("priority -2^63", "priority", completion(priority=-(2**63)), expect="4xx"),
        Case("LoRA load: missing path vs not an adapter", "oracle", None, "/v1/load_lora_adapter", expect="same",
             special="lora_oracle"),
    ]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _template_cases() -> list[Case]:
    """Issue 44: what a chat template renders (tools, earlier calls' arguments, chat_template_kwargs)."""
    user = {"role": "user", "content": "hi"}
    deep_call = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[" * 200_000}}]}
    deep_tools = [{"type": "function", "function": {"name": "f", "parameters": _nested(400)}}]
    return [
        # too deep to read as JSON: rendered as the text it is, never a RecursionError
        Case("tool-call arguments [[[ 200k deep", "template", chat(messages=[user, deep_call, user], max_tokens=2),
             "/v1/chat/completions"),
        Case("tools nested 800 deep", "template", chat(messages=[user], tools=deep_tools), "/v1/chat/completions",
             expect="4xx"),
        Case("tools nested 800 deep on /tokenize", "template", chat(messages=[user], tools=deep_tools),
             "/tokenize", expect="4xx"),
        Case("chat_template_kwargs 60k names", "template",
             chat(messages=[user], max_tokens=2, chat_template_kwargs={f"k{i}": i for i in range(n(60_000))}),
             "/v1/chat/completions"),
    ]


def _stream_cases() -> list[Case]:
    stream = {"stream": True, "ignore_eos": True, "max_tokens": 1900}
    return [
        Case("SSE client stops reading", "slow client", completion(n=4, logprobs=20, **stream),
             expect="dropped", special="stalled_sse"),
        Case("disconnect while decoding", "disconnect", completion(**stream), expect="dropped",
             special="disconnect_decode"),
        Case("disconnect while prefilling 16 x 1.9k", "disconnect", completion(
            prompt=[f"{i} " + "hello world " * PROMPT_TOKENS_NEAR_CTX for i in range(16)], max_tokens=100,
            ignore_eos=True), expect="dropped", special="disconnect_prefill"),
    ]


def corpus() -> list[Case]:
    """The OpenAI-shaped cases (anthropic.py has the Anthropic routes')."""
    return within_body_limit([*_grammar_cases(), *_schema_cases(), *_regex_cases(), *_stop_and_logprob_cases(),
                              *_loop_work_cases(), *_contract_cases(), *_stream_cases()])


def within_body_limit(cases: list[Case]) -> list[Case]:
    too_big = [(c.name, len(c.body)) for c in cases if c.body is not None and len(c.body) > BODY_LIMIT]
    assert not too_big, f"cases over the body limit: {too_big}"
    return cases
