"""A request's inputs as the engine takes them: prompts tokenized under the context's limits, messages through
the chat template, and every choice's sampling params with its grammar compiled. Run on the worker pool, never on
the event loop (each costs O(text)); what the client got wrong is a 400 naming its field."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from cobali.frontend.chat_template import ChatPrompter, PromptTooLong
from cobali.frontend.errors import APIError, bad_request
from cobali.frontend.interface import ModelInfo, SamplingParams, Tokenizer
from cobali.frontend.parsers.calls import ToolSchemas
from cobali.frontend.parsers.reply import AUTO, ReplyDelta, ReplyParsers, ReplyStream
from cobali.frontend.request_limits import RequestLimits, check_prompt_logprobs, check_template_inputs
from cobali.structured.compiler import GrammarCompiler

Choices = list[tuple[list[int], SamplingParams]]  # one (prompt tokens, params) per engine request
# Characters a token may hold where the backend does not say (the fake's): generous, as no real vocabulary's
# longest token is longer.
UNKNOWN_TOKEN_CHARS = 256


class ChoiceRequest(Protocol):
    """A generation request's body, as choices are made from it (cobali.http.protocol.completions)."""

    n: int
    prompt_logprobs: int | None

    def prompt_logprob_count(self) -> int | None: ...

    def sampling_params(self, prompt_tokens: int, model: ModelInfo, copy: int) -> SamplingParams: ...


@dataclass(frozen=True)
class ReplyReader:
    """How one chat request's replies are read: its model's parsers, the prompt as the template rendered it (its
    end says whether the template opened a think block) and the request's active tools (none: no calls read)."""

    parsers: ReplyParsers
    prompt: str
    tools: ToolSchemas

    def stream(self) -> ReplyStream:
        """A stream for one choice's reply."""
        return self.parsers.stream(self.prompt, self.tools)

    def whole(self, text: str) -> ReplyDelta:
        """A whole reply; beside calls, its content without the whitespace around them. O(text): the routes run
        it on the worker pool (cobali.http.generation.read_off_loop)."""
        read = self.parsers.parse(text, self.prompt, self.tools)
        return read._replace(content=read.content.strip()) if read.calls else read


class ChatChoices(NamedTuple):
    """A chat request made ready: its choices for the engine, and how their replies are read."""

    choices: Choices
    replies: ReplyReader


class InputProcessor:
    """One loaded model's inputs: its tokenizer, its chat template (or the operator's), its grammar compiler."""

    def __init__(self, model: ModelInfo, tokenizer: Tokenizer, grammars: GrammarCompiler,
                 chat_template: str | None = None, reasoning_parser: str = AUTO, tool_call_parser: str = AUTO) -> None:
        """chat_template: Jinja text used instead of the model's own (--chat-template); the parsers: names, or
        auto (those the template calls for), or none (reasoning: none read)."""
        self.model = model
        self.tokenizer = tokenizer
        self.grammars = grammars
        self._chat_template = chat_template
        self._parser_names = reasoning_parser, tool_call_parser

    @functools.cached_property  # on the first chat request's worker, not the event loop: a template compiles slowly
    def prompter(self) -> ChatPrompter:
        source = self.model.chat_template
        if self._chat_template is not None:
            source = dataclasses.replace(source, text=self._chat_template)
        return ChatPrompter(source, self.tokenizer.apply_chat_template, self.max_prompt_chars)

    @property
    def chat_ready(self) -> bool:
        """Whether what a chat request needs first is built: the template, the reply parsers and their control
        tokens (functools.cached_property keeps each in the instance's dict once built). Till then a chat request
        is prepared on a worker, where they are built (cobali.http.routes.chat)."""
        return {"prompter", "parsers", "_preserved"} <= vars(self).keys()

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Characters past which no prompt fits the context: a chat template stops writing there."""
        return self.tokenizer.max_prompt_chars or self.model.max_model_len * UNKNOWN_TOKEN_CHARS

    @functools.cached_property
    def parsers(self) -> ReplyParsers:
        """How replies are read: their reasoning apart, and their tool calls in the format the template writes."""
        template = self._chat_template if self._chat_template is not None else self.model.chat_template.text
        return ReplyParsers.for_template(template or "", *self._parser_names)

    @functools.cached_property
    def _preserved(self) -> tuple[frozenset[int], frozenset[int]]:
        """The tags the parsers read that are control tokens in this vocabulary: (the reasoning parser's, the
        tool-call parser's). Resolved once: a few tags, each tokenized."""
        reasoning = self.parsers.reasoning
        return (self._control_tokens(reasoning.special_tags if reasoning is not None else ()),
                self._control_tokens(self.parsers.tools.special_tags))

    def _control_tokens(self, tags: tuple[str, ...]) -> frozenset[int]:
        return frozenset(token for token in map(self.tokenizer.control_token, tags) if token is not None)

    def chat_choices(self, choices: Choices, replies: ReplyReader) -> ChatChoices:
        """A chat request made ready: each choice keeps the text of the control tokens its reply's parsers read
        (llama-server's preserved tokens; the tool-call parser's only where the request has active tools)."""
        reasoning, tools = self._preserved
        preserved = reasoning | tools if replies.tools else reasoning
        if preserved:
            choices = [(tokens, dataclasses.replace(params, preserved_tokens=preserved)) for tokens, params in choices]
        return ChatChoices(choices, replies)

    def prompt_tokens(self, prompt: str | list[int], param: str, keep: int | None = None) -> list[int]:
        """The prompt's tokens; keep (vLLM's truncate_prompt_tokens): only its last `keep`, -1 as many as the
        context holds beside one output token. A `keep` past the context is vLLM's 400, whatever the prompt's
        length."""
        limit = self.model.max_model_len
        if keep is not None and keep > limit:
            raise bad_request(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({limit}). "
                              "Please, select a smaller truncation size.", "truncate_prompt_tokens")
        try:
            return self.tokenizer.prompt_tokens(prompt, None if keep is None else limit - 1 if keep == -1 else keep)
        except ValueError as err:
            raise bad_request(str(err), param) from None

    def chat_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  variables: Mapping[str, Any] | None, limits: RequestLimits) -> str:
        """The messages and tools through the chat template, with those of the request's own template variables
        (chat_template_kwargs) that it reads, all within the limits; a template that refuses them is a 400, and
        so is a prompt longer than the context, refused as soon as the template has written that much."""
        read = self.prompter.variables_read(variables)
        if self.prompter.jinja is not None:  # llama.cpp's matcher reads the messages' text alone
            check_template_inputs(messages, read, limits)
        try:
            return self.prompter.prompt(messages, tools, read)
        except PromptTooLong as err:
            raise self.too_long(f"over {err.max_chars}", "messages") from None
        except ValueError as err:
            raise bad_request(str(err), "messages") from None

    def check_length(self, text: str, param: str) -> None:
        """A 400 if the text cannot fit the context, before it is tokenized (the cost grows with the text)."""
        if len(text) > self.max_prompt_chars:
            raise self.too_long(str(len(text)), param)

    def too_long(self, chars: str, param: str) -> APIError:
        """The context's refusal of a prompt of `chars` characters, as prompt_tokens words it."""
        return bad_request(str(self.tokenizer.too_long(chars)), param)

    def check_token_ids(self, tokens: list[int], what: str, param: str) -> None:
        """A 400 naming `what` unless every id is in the vocabulary."""
        try:
            self.tokenizer.check_ids(tokens, what)
        except ValueError as err:
            raise bad_request(str(err), param) from None

    def choices(self, body: ChoiceRequest, prompts: list[list[int]], limits: RequestLimits) -> Choices:
        """Every choice's params (prompts x n), its grammar compiled once here: a bad grammar must not reach the
        engine."""
        if body.prompt_logprob_count() is not None:  # vLLM's, or echo's with logprobs
            check_prompt_logprobs(sum(map(len, prompts)) * body.n,
                                  "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs", limits)
        try:
            choices = [(tokens, body.sampling_params(len(tokens), self.model, copy))
                       for tokens in prompts for copy in range(body.n)]
            if choices[0][1].grammar is not None:
                self.grammars.check(choices[0][1].grammar)
        except ValueError as err:
            raise bad_request(str(err)) from None
        return choices
