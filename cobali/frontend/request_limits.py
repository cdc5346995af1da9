"""What one request may ask of the server, as the operator set it (`cobali serve`'s flags), and the checks that
hold a request to it before any costly work: tokenizing, rendering the chat template, building or compiling a
grammar. Built once at the CLI edge and passed whole.

Only dataclasses and plain functions here: the flags module imports this, and `cobali run` must not pay for
FastAPI. A request over a limit raises OverLimit, which the app answers with a 400 naming the limit's flag.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from cobali.backends.base import MAX_LOGPROBS
from cobali.structured.limits import GrammarLimits

# Deeper, pydantic's JSON writer (255 levels) and Python's stack give out before the limit does.
MAX_TEMPLATE_DEPTH = 200


@dataclass(frozen=True)
class RequestLimits:
    max_choices: int = 16  # prompts x n: each choice is an engine request holding a slot
    max_logprobs: int = MAX_LOGPROBS  # vLLM's: alternatives per token (logprobs, top_logprobs, prompt_logprobs)
    # prompt tokens x choices whose logprobs a request asks: each position is a logits row over the vocabulary,
    # and such a prompt is prefilled once per choice (the prefix cache is skipped)
    max_prompt_logprobs: int = 1024
    max_stop_strings: int = 16  # each is searched for in every token's text
    max_stop_string_chars: int = 256  # each stop string's length: the text held back and searched per token
    max_tools: int = 128  # OpenAI's cap
    max_tools_bytes: int = 512 * 1024  # the tools' JSON: rendered into the prompt, forced ones into a grammar
    max_logit_bias: int = 1024  # entries, each applied to every sampled token's row
    max_stop_token_ids: int = 64
    # A JSON value a chat template is given (a tool's parameters, a call's arguments, a chat_template_kwargs
    # value): how deep it nests. Indented, each of its lines repeats its depth; and each level is stack.
    max_template_depth: int = 64
    max_template_kwargs_bytes: int = 64 * 1024  # the chat_template_kwargs a template reads, as JSON

    def __post_init__(self) -> None:
        for item in fields(self):
            if getattr(self, item.name) < 1:
                raise ValueError(f"{LIMIT_FLAGS[item.name]} must be at least 1, got {getattr(self, item.name)}")
        if self.max_template_depth > MAX_TEMPLATE_DEPTH:
            raise ValueError(f"--max-chat-template-depth must be at most {MAX_TEMPLATE_DEPTH}, "
                             f"got {self.max_template_depth}")


@dataclass(frozen=True)
class PreprocessLimits:
    """The worker pool that tokenizes, renders templates and compiles grammars (work_pool.py)."""

    workers: int = 2
    timeout_s: float = 10.0  # a request's preparation must start, and then finish, within this
    client_queue: int | None = 256  # one client's requests being prepared or waiting to be (None: no bound)

    def __post_init__(self) -> None:
        if self.workers < 1 or not self.timeout_s > 0 or (self.client_queue is not None and self.client_queue < 1):
            raise ValueError(f"bad preprocessing limits: {self}")


# Each limit's flag, named in the 400 that refuses a request over it.
LIMIT_FLAGS = {
    "max_choices": "--max-choices",
    "max_logprobs": "--max-logprobs",
    "max_prompt_logprobs": "--max-prompt-logprobs",
    "max_stop_strings": "--max-stop-strings",
    "max_stop_string_chars": "--max-stop-string-chars",
    "max_tools": "--max-tools",
    "max_tools_bytes": "--max-tools-bytes",
    "max_logit_bias": "--max-logit-bias",
    "max_stop_token_ids": "--max-stop-token-ids",
    "max_template_depth": "--max-chat-template-depth",
    "max_template_kwargs_bytes": "--max-chat-template-kwargs-bytes",
}
GRAMMAR_FLAGS = {
    "max_bytes": "--max-grammar-bytes",
    "max_gbnf_rules": "--max-gbnf-rules",
    "max_grammar_size": "--grammar-max-size",
    "max_lexer_states": "--grammar-max-lexer-states",
    "initial_lexer_fuel": "--grammar-lexer-fuel",
    "step_lexer_fuel": "--grammar-step-fuel",
    "step_max_items": "--grammar-step-max-items",
}


class OverLimit(Exception):
    """A request over one of the operator's limits: the client's 400, naming the limit's flag. Not a ValueError,
    so no handler of bad values can swallow the field it names."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def _at_most(param: str | None, what: str, value: int, limit: int, flag: str) -> None:
    if value > limit:
        raise OverLimit(param, f"{what} must be less than or equal to {limit} (this server's {flag}), got {value}")


def check_request(body: Any, limits: RequestLimits, grammar: GrammarLimits, n_vocab: int | None = None) -> None:
    """A generation body (completions, chat, or responses made chat) against the limits: O(body), before the
    server tokenizes, renders or compiles anything for it. Fields a body lacks are skipped."""
    prompts = getattr(body, "prompts", None)
    n_prompts, n = len(prompts()) if prompts is not None else 1, body.n
    _at_most("n", "n", n, limits.max_choices, "--max-choices")
    if n_prompts * n > limits.max_choices:
        raise OverLimit("n", f"prompts x n must be at most {limits.max_choices} (this server's --max-choices), "
                        f"got {n_prompts} x {n}")
    max_k = limits.max_logprobs if n_vocab is None else min(limits.max_logprobs, n_vocab)
    for param in ("logprobs", "top_logprobs", "prompt_logprobs"):
        if isinstance(k := getattr(body, param, None), int) and not isinstance(k, bool):
            _at_most(param, param, k, max_k, "--max-logprobs")
    stops = body.stop_strings()
    _at_most("stop", "the number of stop strings", len(stops), limits.max_stop_strings, "--max-stop-strings")
    _at_most("stop", "a stop string's length", max(map(len, stops), default=0), limits.max_stop_string_chars,
             "--max-stop-string-chars")
    _at_most("logit_bias", "logit_bias entries", len(body.logit_bias or ()), limits.max_logit_bias,
             "--max-logit-bias")
    _at_most("stop_token_ids", "stop_token_ids", len(body.stop_token_ids or ()), limits.max_stop_token_ids,
             "--max-stop-token-ids")
    check_tools(getattr(body, "tools", None), limits)
    check_constraints(body, grammar)


def check_tools(tools: list[Any] | None, limits: RequestLimits) -> None:
    """Tools' count, depth and JSON size: every tool is rendered into the prompt, the forced ones into a
    grammar."""
    if not tools:
        return
    _at_most("tools", "the number of tools", len(tools), limits.max_tools, "--max-tools")
    for tool in tools:  # before their JSON is written: pydantic's fails on a deep value
        parameters = tool.function.parameters if hasattr(tool, "function") else tool  # else plain JSON
        _at_most_deep("tools", "a tool's parameters", parameters, limits)
    size = sum(len(tool.model_dump_json(exclude_none=True).encode()) if hasattr(tool, "model_dump_json")
               else _size(tool) for tool in tools)  # a tool a client sent as plain JSON
    _at_most("tools", "the tools' JSON bytes", size, limits.max_tools_bytes, "--max-tools-bytes")


def check_template_inputs(messages: list[dict[str, Any]], variables: dict[str, Any], limits: RequestLimits) -> None:
    """What a chat template is given beside the tools (check_tools): the messages as it reads them (a call's
    arguments are JSON), and the chat_template_kwargs it reads. O(their size), before it renders."""
    for message in messages:
        for call in message.get("tool_calls") or ():
            _at_most_deep("messages", "a tool call's arguments", call["function"]["arguments"], limits)
    for name, value in variables.items():
        _at_most_deep("chat_template_kwargs", f"chat_template_kwargs.{name}", value, limits)
    _at_most("chat_template_kwargs", "the chat_template_kwargs the chat template reads (bytes of their JSON)",
             _size(variables), limits.max_template_kwargs_bytes, "--max-chat-template-kwargs-bytes")


def check_prompt_logprobs(positions: int, param: str, limits: RequestLimits) -> None:
    """Once the prompts are tokens: the prompt positions whose logprobs the request asks (prompt tokens x choices)."""
    _at_most(param, "prompt tokens x choices of prompt logprobs", positions, limits.max_prompt_logprobs,
             "--max-prompt-logprobs")


def check_constraints(body: Any, grammar: GrammarLimits) -> None:
    """Every schema, regex, grammar or choice list the body names, by the bytes of its text as sent."""
    for param, value in constraint_texts(body):
        _at_most(param, f"{param} (bytes of its text)", _size(value), grammar.max_bytes, "--max-grammar-bytes")
        if param.endswith("grammar") and isinstance(value, str):  # GBNF (or Lark): rules named with ::=
            _at_most(param, f"{param} (GBNF rules)", value.count("::="), grammar.max_gbnf_rules, "--max-gbnf-rules")


def constraint_texts(body: Any) -> list[tuple[str, Any]]:
    """(field path, value) of each constraint a body names: response_format's schema, structured_outputs'
    member, vLLM's guided_*, llama-server's grammar and json_schema, and the forced tools' parameters (one
    grammar from all of them)."""
    found: list[tuple[str, Any]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None and getattr(response_format, "json_schema", None) is not None:
        found.append(("response_format.json_schema.schema", response_format.json_schema.json_schema))
    structured = getattr(body, "structured_outputs", None)
    for name, alias in (("choice", "choice"), ("json_schema", "json"), ("grammar", "grammar"), ("regex", "regex")):
        if structured is not None and getattr(structured, name, None) is not None:
            found.append((f"structured_outputs.{alias}", getattr(structured, name)))
    for name in ("guided_choice", "guided_json", "guided_grammar", "guided_regex", "grammar", "json_schema"):
        if getattr(body, name, None) is not None:
            found.append((name, getattr(body, name)))
    forced = body.forced_tools() if hasattr(body, "forced_tools") else []
    if forced:
        found.append(("tools", [tool.function.parameters for tool in forced]))
    return found


def _at_most_deep(param: str, what: str, value: Any, limits: RequestLimits) -> None:
    if nests_deeper(value, limits.max_template_depth):
        raise OverLimit(param, f"{what} must nest at most {limits.max_template_depth} levels deep (this server's "
                               "--max-chat-template-depth)")


def nests_deeper(value: Any, depth: int) -> bool:
    """Whether a JSON value's objects and arrays nest more than `depth` levels (a scalar: 0, [] and {}: 1).
    Without recursion, so any depth is measured; O(the value), stopping at the first too deep."""
    stack = [(value, 0)]  # each container with the levels around it
    while stack:
        item, around = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if around >= depth:
            return True
        stack.extend((child, around + 1) for child in children)
    return False


def _size(value: Any) -> int:
    """A string's bytes, or the bytes of a value's compact JSON text (a schema sent as an object)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", errors="replace"))
    try:
        return len(json.dumps(value, separators=(",", ":")).encode())
    except (RecursionError, ValueError):  # nested past what json can write: no grammar could be smaller
        return 1 << 62
