"""The body of Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), and its translation
into a chat request: one prompt, sampling and tool path for every API face.

Stateless like the rest of the server. Text, tool_use and tool_result blocks are read; a thinking block in an
earlier assistant turn is passed to the template as that turn's reasoning; images and documents are refused.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from cobali.http.protocol.bodies import Body, RequestBody, one_of
from cobali.http.protocol.chat import ChatCompletionRequest, translated_chat_request
from cobali.http.protocol.completions import C_INT_MAX


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here: accepted, not needed
    citations: list[dict[str, Any]] | None = None


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[str | list[TextBlock] | None, one_of("a string or a list of text blocks")] = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


ContentBlock = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
                         one_of("a text, thinking, tool_use or tool_result block (images and documents are not "
                                "supported)")]


def _as_blocks(content: Any) -> Any:
    """A string is one text block: then a bad block is named by its own place (messages.0.content.1)."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


class Message(Body):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_as_blocks, json_schema_input_type=str | list[ContentBlock])]


class ToolDefinition(Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice.name is required with type 'tool', and only then")
        return self


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)  # not held: a model thinks as its template lets it


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # a hint this server has no use for
    format: OutputFormat | None = None


class Metadata(Body):
    user_id: str | None = None


class MessagesInput(RequestBody):
    """What both routes read: the conversation, its system prompt and its tools."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: Annotated[str | list[TextBlock] | None, one_of("a string or a list of text blocks")] = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here: accepted, not needed

    @model_validator(mode="after")
    def _check_tool_choice(self) -> MessagesInput:
        names = [tool.name for tool in self.tools or ()]
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice '{choice.type}' needs tools")
        if choice is not None and choice.name is not None and choice.name not in names:
            raise ValueError(f"tool_choice names the tool '{choice.name}', which is not among the tools "
                             f"({', '.join(names)})")
        return self

    def as_chat(self) -> ChatCompletionRequest:
        """The same request for the chat route; raises ValueError naming what does not fit."""
        return translated_chat_request(self.chat_fields() | self.generation_fields())

    def generation_fields(self) -> dict[str, Any]:
        """The chat body's sampling fields: here none but the one token a prompt's reply must have room for."""
        return {"max_tokens": 1}

    def system_text(self) -> str:
        if self.system is None:
            return ""
        return self.system if isinstance(self.system, str) else "\n\n".join(b.text for b in self.system)

    def chat_fields(self) -> dict[str, Any]:
        """The chat body's messages, tools, tool choice and template arguments."""
        body: dict[str, Any] = {"model": self.model, "messages": self._chat_messages()}
        choice = self.tool_choice
        if self.tools and not (choice is not None and choice.type == "none"):
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description else {})}} for t in self.tools]
            if choice is not None:
                body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                       if choice.type == "tool" else "required" if choice.type == "any" else "auto")
                body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None:  # Qwen3's and others' switch; a template without it ignores it
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        return body

    def _chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if system := self.system_text():
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages += _user_turn(message.content) if message.role == "user" else [_assistant_turn(message.content)]
        return messages


def _user_turn(blocks: list[Any]) -> list[dict[str, Any]]:
    """Tool results become tool messages (in their order), the text one user message after them."""
    turn: list[dict[str, Any]] = []
    text: list[str] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            content = block.text()
            turn.append({"role": "tool", "tool_call_id": block.tool_use_id,
                         "content": f"Error: {content}" if block.is_error else content})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            raise ValueError(f"messages: a user turn cannot hold a {block.type} block")
    if text or not turn:
        turn.append({"role": "user", "content": "\n\n".join(text)})
    return turn


def _assistant_turn(blocks: list[Any]) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for block in blocks:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, ToolResultBlock):
            raise ValueError("messages: an assistant turn cannot hold a tool_result block")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    return turn


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=C_INT_MAX)
    metadata: Metadata | None = None
    service_tier: str | None = None  # one tier here: accepted
    output_config: OutputConfig | None = None

    def generation_fields(self) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.top_k is not None:
            body["top_k"] = self.top_k
        if self.metadata is not None and self.metadata.user_id is not None:
            body["user"] = self.metadata.user_id
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        return body


class CountTokensRequest(MessagesInput):
    """POST /v1/messages/count_tokens: the prompt's tokens, rendered as /v1/messages would render it."""
