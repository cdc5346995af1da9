"""Chat prompts from the model's own Jinja chat template, rendered the way Hugging Face transformers does.

The template comes from `--chat-template FILE`, else the GGUF's `tokenizer.chat_template`. It runs in
jinja2's immutable sandbox (a template is model data, not trusted code) with the variables HF templates
expect: messages, tools, add_generation_prompt, bos_token, eos_token, and the raise_exception and
strftime_now functions, beside a request's own variables (vLLM's chat_template_kwargs, e.g. Qwen3's
enable_thinking). llama.cpp's built-in template matcher is the fallback when there is no template or it does not
compile; it cannot render tools, nor read those variables.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cobali.backends.base import TemplateSource

log = logging.getLogger("cobali.http")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters (<, >, &): wrong for prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    return datetime.datetime.now().strftime(format_)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class JinjaChatTemplate:
    def __init__(self, text: str, bos_token: str = "", eos_token: str = "", adds_bos: bool = False) -> None:
        """Raises ValueError if the template does not compile."""
        try:
            self.template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"the chat template does not compile: {err.message} (line {err.lineno})") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.adds_bos = adds_bos

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt, ending where the assistant's reply starts; variables: the request's own (the server's
        win). ValueError when the template refuses the conversation (raise_exception) or fails on it."""
        ours = {"messages": messages, "tools": tools or None, "add_generation_prompt": True,
                "bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            text = self.template.render({**(variables or {}), **ours})
        except jinja2.TemplateError as err:
            raise ValueError(f"the chat template refused the messages: {err}") from None
        except (TypeError, KeyError, AttributeError, IndexError) as err:
            raise ValueError(f"the chat template failed on the messages: {type(err).__name__}: {err}") from None
        # A tokenizer that adds the BOS itself would put it there twice.
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text


class ChatPrompter:
    """Messages -> prompt text for one model: its Jinja template, or llama.cpp's matcher as the fallback."""

    def __init__(self, source: TemplateSource, fallback: Callable[[list[dict[str, str]]], str]) -> None:
        self.fallback = fallback
        self.jinja: JinjaChatTemplate | None = None
        if source.text:
            try:
                self.jinja = JinjaChatTemplate(source.text, source.bos_token, source.eos_token, source.adds_bos)
            except ValueError as err:
                log.warning("%s; falling back to llama.cpp's built-in templates", err)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """variables: the request's own template variables (chat_template_kwargs); the fallback has none."""
        if self.jinja is not None:
            return self.jinja.render(messages, tools, variables)
        if tools:
            raise ValueError("tools need a Jinja chat template: this model has none (see --chat-template)")
        return self.fallback([{"role": m["role"], "content": m.get("content") or ""} for m in messages])
