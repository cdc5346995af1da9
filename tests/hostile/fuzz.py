"""A derandomized fuzzer over the corpus's classes: each body mixes nesting depths, repetition counts,
alternation widths, random regexes, schemas and grammars, drawn from random.Random seeded by FUZZ_SEED and the
case's index, so every run sends the same bodies. A body over the limit is drawn again at half the scale.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from tests.hostile.corpus import (
    BODY_LIMIT,
    Case,
    alternation_grammar,
    ambiguous_grammar,
    backtracking_schema,
    chat,
    completion,
    nested_parens_grammar,
    ref_sibling_schema,
    rule_chain_grammar,
    schema_format,
)

FUZZ_SEED = 36
EVIL_PATTERNS = ("^(a|a)*$", "^(a+)+$", "^(a|aa)+$", "^([a-z]+)*$", "^(a*)*b$", "^(\\w+\\s?)*$")
ATOMS = ("a", "b", "[a-z]", "\\d", ".", "(a|a)", "a?", "[^x]")


def random_regex(rng: random.Random, depth: int, width: int) -> str:
    if depth == 0:
        return rng.choice(ATOMS)
    inner = [random_regex(rng, depth - 1, width) for _ in range(rng.randint(2, width))]
    kind = rng.choice(("alt", "seq", "star", "repeat"))
    if kind == "alt":
        return "(" + "|".join(inner) + ")"
    if kind == "seq":
        return "".join(inner)
    if kind == "star":
        return "(" + inner[0] + ")" + rng.choice("*+?")
    low = rng.randint(0, 60)
    return "(" + inner[0] + "){" + f"{low},{low + rng.randint(0, 60)}" + "}"


def random_schema(rng: random.Random, depth: int, width: int) -> Any:
    if depth == 0:
        return rng.choice([{"type": "integer"}, {"type": "string", "maxLength": rng.randint(0, 500)},
                           {"enum": [f"e{i}" for i in range(width * 50)]}, backtracking_schema(rng.randint(12, 30),
                                                                                                rng.choice(EVIL_PATTERNS)),
                           {"type": "string", "pattern": random_regex(rng, 3, 4)}])
    children = [random_schema(rng, depth - 1, width) for _ in range(rng.randint(1, width))]
    kind = rng.choice(("object", "array", "anyOf", "allOf"))
    if kind == "object":
        props = {f"p{i}": c for i, c in enumerate(children)}
        return {"type": "object", "properties": props, "required": list(props)}
    if kind == "array":
        return {"type": "array", "items": children[0], "maxItems": rng.randint(1, 1000)}
    return {kind: children}


def _grammar_body(rng: random.Random, scale: int) -> bytes:
    rules = {"nest": nested_parens_grammar(rng.randint(scale // 4, scale)),
             "chain": rule_chain_grammar(rng.randint(scale // 20, scale // 4), cycle=rng.random() < 0.5),
             "alt": alternation_grammar(rng.randint(scale // 4, scale)),
             "ambiguous": ambiguous_grammar(rng.randint(10, 400))}
    field = rng.choice(["grammar", "guided_grammar"])
    return completion(**{field: rules[rng.choice(list(rules))]}, max_tokens=rng.randint(1, 16))


def _regex_body(rng: random.Random, scale: int) -> bytes:
    if rng.random() < 0.5:
        pattern = "(" + "|".join(f"x{rng.randint(0, 10**6)}" for _ in range(rng.randint(scale // 8, scale // 2))) + ")"
    else:
        pattern = random_regex(rng, rng.randint(2, 5), rng.randint(2, 8))
    return completion(guided_regex=pattern, max_tokens=rng.randint(1, 16))


def _schema_body(rng: random.Random, scale: int) -> bytes:
    schema = (ref_sibling_schema(rng.randint(8, 30)) if rng.random() < 0.3
              else random_schema(rng, rng.randint(1, 4), rng.randint(1, max(1, min(12, scale // 20_000)))))
    field = rng.choice(["response_format", "guided_json", "json_schema"])
    return completion(**{field: schema_format(schema) if field == "response_format" else schema}, max_tokens=8)


def _stop_body(rng: random.Random, scale: int) -> bytes:
    count = rng.randint(1, 20)
    length = max(1, rng.randint(scale // 8, scale) // count)
    return completion(stop=[rng.choice("abs") * length + str(i) for i in range(count)],
                      max_tokens=rng.randint(1, 48), ignore_eos=True)


def _logprobs_body(rng: random.Random, _scale: int) -> bytes:
    return completion(prompt="hello world " * rng.randint(10, 950), n=rng.randint(1, 16),
                      prompt_logprobs=rng.randint(0, 20), echo=rng.random() < 0.5, logprobs=rng.randint(0, 20),
                      max_tokens=1)


def _chat_body(rng: random.Random, scale: int) -> bytes:
    messages = [{"role": rng.choice(["user", "assistant", "system"]), "content": "m " * rng.randint(0, 50)}
                for _ in range(rng.randint(1, scale // 20))]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": random_schema(rng, 2, 3)}}
             for i in range(rng.randint(0, 50))]
    extra: dict[str, Any] = {"tools": tools, "tool_choice": "required"} if tools else {}
    return chat(messages=messages, **extra)


MAKERS: tuple[tuple[str, str, Callable[[random.Random, int], bytes]], ...] = (
    ("grammar", "/v1/completions", _grammar_body), ("regex", "/v1/completions", _regex_body),
    ("schema", "/v1/completions", _schema_body), ("stop", "/v1/completions", _stop_body),
    ("logprobs", "/v1/completions", _logprobs_body), ("chat", "/v1/chat/completions", _chat_body),
)


def fuzz_cases(count: int = 12, seed: int = FUZZ_SEED, limit: int = BODY_LIMIT) -> list[Case]:
    """`count` bodies, each within `limit`, the same on every run."""
    cases = []
    for index in range(count):
        name, path, make = MAKERS[index % len(MAKERS)]
        scale = random.Random(f"{seed}/{index}").choice([20_000, 100_000, 400_000, 1_500_000])
        while True:
            body = make(random.Random(f"{seed}/{index}/{scale}"), scale)
            if len(body) <= limit - 1024 or scale < 100:
                break
            scale //= 2
        cases.append(Case(f"fuzz {index:02d} {name} ({len(body) // 1024} KB)", f"fuzz: {name}", body, path))
    return cases
