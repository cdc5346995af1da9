"""The ingress's routing hint for one generating request: its prompt's tokens as the replica will make them.

The body is parsed as the replica's route parses it, the chat (Anthropic's Messages and the Responses API become
one, as on the replica) rendered through the same template and tokenized by the same vocabulary, loaded
vocabulary-only in the ingress (cobali.ray.serve); the tokens are hashed in blocks under the request's cache
salt (the API key's, as the replica salts it, cobali.http.auth) and LoRA adapter, as the replicas hash what they
hold (cobali.engine.prefix_digest.prompt_blocks). The work is the replica's own (O(body), bounded by the body
limit, the template's limits and the prompt's length) and runs on the ingress's worker pool. A body that does not
parse, or a prompt the replica will refuse, routes with no hint: the replica answers its 400 itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from cobali.engine.prefix_digest import prompt_blocks
from cobali.frontend.errors import APIError
from cobali.frontend.inputs import InputProcessor
from cobali.frontend.interface import SamplingParams
from cobali.http.auth import KEY_ID, keyed_choices
from cobali.http.config import ServerConfig
from cobali.http.parse import validated
from cobali.http.protocol.chat import ChatCompletionRequest
from cobali.http.protocol.completions import CompletionRequest, GenerationRequest
from cobali.http.protocol.messages import MessagesRequest
from cobali.http.protocol.responses import ResponsesRequest
from cobali.http.routes.chat import chat_prompt
from cobali.http.state import LoraNames
from cobali.ray.asgi import HTTPRequest
from cobali.ray.policy import RoutingHint

# The generating routes, by the body each parses.
GENERATING: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                          "/v1/chat/completions": ChatCompletionRequest,
                                          "/v1/messages": MessagesRequest, "/v1/responses": ResponsesRequest}
SESSION_HEADER = b"x-session-id"


def header(request: HTTPRequest, name: bytes) -> str | None:
    """The first header of that (lower-case) name."""
    return next((value.decode("latin-1") for key, value in request.headers if key == name), None)


def generating(request: HTTPRequest) -> bool:
    return request.method == "POST" and request.path in GENERATING


@dataclass(frozen=True)
class Hinter:
    """Hints for one model's requests. inputs: the model's text side (None: none loaded, hints carry the session
    alone); policy: what the router reads (kv: block hashes, text: the prompt's text)."""

    inputs: InputProcessor | None
    config: ServerConfig
    policy: str
    block_tokens: int

    def hint(self, request: HTTPRequest, key_id: str | None) -> RoutingHint:
        """The request's hint; runs on a worker (O(body))."""
        session = header(request, SESSION_HEADER)
        try:
            body = self._body(request)
        except (APIError, ValueError):  # the replica answers it (its 400)
            return RoutingHint(session=session)
        session = session or body.user
        if self.inputs is None or self.policy not in ("kv", "text"):
            return RoutingHint(session=session)
        try:
            tokens, text = self._prompt(self.inputs, body)
        except (APIError, ValueError):
            return RoutingHint(session=session)
        if self.policy == "text":
            return RoutingHint(n_tokens=len(tokens), text=text, session=session)
        return RoutingHint(tuple(self._blocks(tokens, body, key_id)), len(tokens), session=session)

    def _body(self, request: HTTPRequest) -> GenerationRequest:
        """The body as the route's generation request (ValueError: Messages or Responses that fit no chat)."""
        body = validated(GENERATING[request.path], request.body, header(request, b"content-type"))
        if isinstance(body, MessagesRequest | ResponsesRequest):
            return body.as_chat()
        assert isinstance(body, GenerationRequest)
        return body

    def _prompt(self, inputs: InputProcessor, body: GenerationRequest) -> tuple[list[int], str]:
        """The (first) prompt's tokens, and its text as rendered."""
        if isinstance(body, ChatCompletionRequest):
            text = chat_prompt(inputs, body, self.config.limits)
            return inputs.prompt_tokens(text, "messages", body.truncate_prompt_tokens), text
        assert isinstance(body, CompletionRequest)
        prompt = body.prompts()[0]
        tokens = inputs.prompt_tokens(prompt, "prompt", body.truncate_prompt_tokens)
        return tokens, prompt if isinstance(prompt, str) else ""

    def _blocks(self, tokens: list[int], body: GenerationRequest, key_id: str | None) -> list[int]:
        """The prompt's block hashes under the salt and adapter the replica will key its cache by."""
        scope = {"state": {KEY_ID: key_id}} if key_id is not None else {}
        ((_, params),) = keyed_choices(scope, [(tokens, SamplingParams(cache_salt=body.cache_salt))],
                                       self.config.shared_prefix_cache)
        loras = LoraNames(tuple(name for name, _ in self.config.lora_modules))
        lora = loras.index.get(body.model, 0) if body.model is not None else 0
        return prompt_blocks(tokens, self.block_tokens, params.cache_salt, lora)
