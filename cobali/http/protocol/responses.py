"""The body of /v1/responses, and its translation into a chat request (one prompt and sampling path for both).

Stateless: nothing is stored, so `previous_response_id` is refused; a conversation is sent whole in `input`
(messages, the model's function_call items and the client's function_call_output items).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from cobali.http.protocol.bodies import Body, RequestBody, one_of
from cobali.http.protocol.chat import ROLES, ChatCompletionRequest, translated_chat_request


class InputText(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal[ROLES]  # type: ignore[valid-type]  # a tuple of literals: valid at runtime, not to mypy
    content: Annotated[str | list[InputText], one_of("a string or a list of input_text parts")]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem,
                      one_of("a message, function_call or function_call_output item")]


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    model_config = Body.model_config | {"populate_by_name": True}
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: Annotated[str | list[InputItem], one_of("a string or a list of input items")]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # accepted, but nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: this server stores no responses; "
                             "send the whole conversation in `input`")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        return self

    def as_chat(self) -> ChatCompletionRequest:
        """The same request for the chat route; raises ValueError naming what does not fit."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "temperature": self.temperature,
                                "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format.type != "text":
            fmt = self.text.format
            body["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
                "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.json_schema
                                                       if fmt.json_schema is not None else True}}
        return translated_chat_request(body)

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return messages
