"""Chat prompts from the model's own Jinja chat template, rendered the way Hugging Face transformers does.

The template comes from `--chat-template FILE`, else the GGUF's `tokenizer.chat_template`. It runs in
jinja2's immutable sandbox (a template is model data, not trusted code) with the variables HF templates
expect: messages, tools, add_generation_prompt, bos_token, eos_token, and the raise_exception and
strftime_now functions, beside a request's own variables (vLLM's chat_template_kwargs, e.g. Qwen3's
enable_thinking). llama.cpp's built-in template matcher is the fallback when there is no template or it does not
compile; it cannot render tools, nor read those variables.

A render costs at most what the context can hold: the template renders as a stream, counted as it comes, and
stops once past `max_chars` (PromptTooLong); so does `tojson`, whose text grows with the value's depth in every
indented line. The values a request gives a template are bounded before it runs (request_limits.py): their
depth, and the bytes of the chat_template_kwargs it reads (`reads`: a kwarg it never reads is dropped).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cobali.backends.base import TemplateSource

log = logging.getLogger("cobali.http")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class PromptTooLong(ValueError):
    """The prompt passed `max_chars` characters, more than the context can hold: the render stopped there."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(f"the chat template's prompt passed {max_chars} characters")
        self.max_chars = max_chars


def _tojson_within(max_chars: int) -> Callable[..., str]:
    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # HF's tojson (json.dumps): jinja2's own escapes HTML characters (<, >, &), wrong for prompts.
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                   sort_keys=sort_keys)
        # Unindented, the C encoder writes at most a few characters per one of the value's (which the body's
        # limit bounds); indented, every line repeats its depth, so the text is made in pieces and stopped
        # once past what a prompt can hold.
        pieces = [encoder.encode(value)] if indent is None else encoder.iterencode(value)
        return "".join(_within(pieces, max_chars))

    return tojson


def _within(pieces: Iterable[str], max_chars: int) -> Iterator[str]:
    """The pieces, until they pass max_chars characters in all: PromptTooLong then."""
    size = 0
    for piece in pieces:
        size += len(piece)
        if size > max_chars:
            raise PromptTooLong(max_chars)
        yield piece


def _strftime_now(format_: str) -> str:
    return datetime.datetime.now().strftime(format_)


def _environment(max_chars: int) -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson_within(max_chars)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class JinjaChatTemplate:
    def __init__(self, text: str, bos_token: str = "", eos_token: str = "", adds_bos: bool = False,
                 max_chars: int = sys.maxsize) -> None:
        """max_chars: the most a render may write (the context's characters), else PromptTooLong. Raises
        ValueError if the template does not compile."""
        env = _environment(max_chars)
        try:
            parsed = env.parse(text)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not compile: {err.message} (line {err.lineno})") from None
        self.template = env.from_string(parsed)
        # The names it reads from its context (a template has no other way to reach a variable): only these
        # of a request's variables are passed, and bounded.
        self.reads = frozenset(jinja2.meta.find_undeclared_variables(parsed))
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.adds_bos = adds_bos
        self.max_chars = max_chars

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt, ending where the assistant's reply starts; variables: the request's own (the server's
        win). ValueError when the template refuses the conversation (raise_exception) or fails on it;
        PromptTooLong, as soon as the prompt passes max_chars."""
        ours = {"messages": messages, "tools": tools or None, "add_generation_prompt": True,
                "bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            text = "".join(_within(self.template.generate({**(variables or {}), **ours}), self.max_chars))
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat template refused the messages: {err}") from None
        except (TypeError, KeyError, AttributeError, IndexError) as err:
            raise ValueError(f"the chat template failed on the messages: {type(err).__name__}: {err}") from None
        except RecursionError:  # a template recursing over a value past Python's stack
            raise ValueError("the chat template failed on the messages: they nest too deep") from None
        # A tokenizer that adds the BOS itself would put it there twice.
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


class ChatPrompter:
    """Messages -> prompt text for one model: its Jinja template, or llama.cpp's matcher as the fallback."""

    def __init__(self, source: TemplateSource, fallback: Callable[[list[dict[str, str]]], str],
                 max_chars: int = sys.maxsize) -> None:
        """max_chars: the most characters the template may write (JinjaChatTemplate)."""
        self.fallback = fallback
        self.jinja: JinjaChatTemplate | None = None
        if source.text:
            try:
                self.jinja = JinjaChatTemplate(source.text, source.bos_token, source.eos_token, source.adds_bos,
                                               max_chars)
            except ValueError as err:
                log.warning("%s; falling back to llama.cpp's built-in templates", err)

    def variables_read(self, variables: Mapping[str, Any] | None) -> dict[str, Any]:
        """Those of a request's variables (chat_template_kwargs) that the template reads: the fallback reads
        none."""
        reads = self.jinja.reads if self.jinja is not None else frozenset()
        return {name: value for name, value in (variables or {}).items() if name in reads}

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """variables: the request's own template variables (chat_template_kwargs); the fallback has none."""
        if self.jinja is not None:
            return self.jinja.render(messages, tools, variables)
        if tools:
            raise ValueError("tools need a Jinja chat template: this model has none (see --chat-template)")
        return self.fallback([{"role": m["role"], "content": m.get("content") or ""} for m in messages])
