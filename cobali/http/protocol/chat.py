"""The body of /v1/chat/completions: messages (tool calls and results among them), tools and tool_choice."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from cobali.frontend.parsers.calls import ToolSchemas
from cobali.frontend.parsers.tools import ToolFormat
from cobali.http.protocol.bodies import Body, one_of
from cobali.http.protocol.completions import GenerationRequest
from cobali.http.protocol.structured import check_json_schema

ROLES = ("system", "developer", "user", "assistant", "tool")
# What the server passes every chat template (cobali/frontend/chat_template.py): a request may not override it.
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception", "strftime_now", "documents", "tool_choice"})


class TextPart(Body):
    type: Literal["text"]
    text: str


class CalledFunction(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Annotated[str | list[TextPart] | None, one_of("a string or a list of text parts")] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier assistant turn's reasoning (vLLM's field), for the template

    def as_template_input(self) -> dict[str, Any]:
        """The message as HF chat templates read it; a call's arguments become an object where they parse
        (templates print them with tojson)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _parsed(c.function.arguments)}} for c in self.tool_calls]
        return message


def _parsed(arguments: str) -> Any:
    """The arguments as JSON where they parse, else the text sent: also where they nest past what json reads
    (RecursionError; a shallower value past the server's depth is refused by name: request_limits.py)."""
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice,
                       one_of("'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")]


class ChatCompletionRequest(GenerationRequest):
    default_max_tokens: ClassVar[int | None] = None
    unsupported: ClassVar[tuple[str, ...]] = ("functions", "function_call", "audio", "prediction",
                                              "web_search_options")

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None  # the deprecated predecessors of tools
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None  # OpenAI features this server has not: named, so they are refused
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = None
    # vLLM's: extra variables for the chat template (Qwen3's enable_thinking); never the ones the server sets.
    chat_template_kwargs: dict[str, Any] | None = None
    _call_format: ToolFormat | None = PrivateAttr(default=None)  # the served model's (for_model_writing)

    @model_validator(mode="after")
    def _check_template_kwargs(self) -> ChatCompletionRequest:
        taken = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_VARIABLES)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the server sets them")
        return self

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function '{self.tool_choice.function.name}', "
                             f"which is not among the tools ({', '.join(names) or 'none given'})")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.forced_tools() and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format cannot be combined with a forced tool call (tool_choice)")
        return self

    @property
    def active_tools(self) -> list[Tool]:
        """The tools the model is told about and whose calls are parsed from its output."""
        return [] if self.tool_choice == "none" else list(self.tools or ())

    def tool_schemas(self) -> ToolSchemas:
        """The active tools as the reply's tool-call parser reads them: name -> parameters schema."""
        return {t.function.name: t.function.parameters or {} for t in self.active_tools}

    def for_model_writing(self, calls: ToolFormat) -> ChatCompletionRequest:
        """This request for a model that writes tool calls in `calls`' format: a forced call is held to it."""
        copy = self.model_copy()
        copy._call_format = calls  # noqa: SLF001 (a copy of its own class)
        return copy

    def asks_grammar(self) -> bool:
        """Tools count: each one's schema is checked, and a forced call is a grammar."""
        return super().asks_grammar() or bool(self.tools)

    def forced_tools(self) -> list[Tool]:
        """The tools one of which the output must call (by grammar): [] when the model may answer in text."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.active_tools if t.function.name == self.tool_choice.function.name]
        return self.active_tools if self.tool_choice == "required" else []

    def sampling_grammar(self) -> str | None:
        """Checked here, on the server's workers, not while the body is read on the event loop: every tool's
        schema (a bad one is the client's 400 even unforced), then the grammar."""
        for tool in self.active_tools:
            if tool.function.parameters is not None:
                check_json_schema(tool.function.parameters, f"the parameters of tool '{tool.function.name}'")
        forced = self.forced_tools()
        if not forced:
            return super().sampling_grammar()
        assert self._call_format is not None, "a forced call's format is the model's: see for_model_writing"
        return self._call_format.forced_call_grammar([(t.function.name, t.function.parameters) for t in forced],
                                                     self.parallel_tool_calls)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or super().requested_max_tokens()


def translated_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """Another API's request (Responses, Anthropic Messages) as a chat request; a ValueError names what does not
    fit, with its place in the chat body."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}: {message}" if where else message) from None
