"""Request bodies of the OpenAI-compatible routes.

Strict mode: a wrong JSON type is a 400, never silently coerced ("5" is not an integer). Fields we cannot
honour (suffix, functions, ...) are rejected. Unknown top-level fields are accepted, since clients and SDKs
send extras for other servers, but never silently: the response names them in an `X-Cobali-Ignored-Fields`
header and the server logs a warning (cobali.http.ignored).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from cobali.frontend.interface import ModelInfo, SamplingParams
from cobali.http.protocol.bodies import Body, one_of, text_batch
from cobali.http.protocol.structured import StructuredRequest, schema_grammar
from cobali.structured.grammars import JSON_OBJECT_GRAMMAR

# How many choices, logprobs, stop strings, ... a request may ask for is the operator's (request_limits.py): the
# routes check it, since a body's validation cannot see the server's flags.
C_INT_MAX = 2**31 - 1  # top_k reaches llama.cpp as a C int: a larger value would crash the engine thread
MAX_PRIORITY = 1000  # `priority` in [-MAX_PRIORITY, MAX_PRIORITY] (docs/serving.md): vLLM documents no range
MAX_CACHE_SALT = 256  # characters: a salt names a tenant, it is no place for data


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class JsonSchemaFormat(Body):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str = "response"
    json_schema: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self

    def grammar(self) -> str | None:
        """Built (and the schema checked) on the server's workers, not while the body is read."""
        if self.type == "json_object":
            return JSON_OBJECT_GRAMMAR
        if self.type == "json_schema" and self.json_schema is not None:
            return schema_grammar(self.json_schema.json_schema, "response_format.json_schema.schema")
        return None


class GenerationRequest(StructuredRequest):
    """Fields shared by /v1/completions and /v1/chat/completions (with StructuredRequest's)."""

    default_max_tokens: ClassVar[int | None] = 16  # None: up to the end of the context
    unsupported: ClassVar[tuple[str, ...]] = ()  # fields that must stay unset (None or False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, le=C_INT_MAX)  # -1 or 0: disabled
    min_p: float = Field(default=0.0, ge=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    stop: Annotated[str | list[str] | None, one_of("a string or a list of strings")] = None
    n: int = Field(default=1, ge=1)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extras
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0)  # vLLM: each prompt token's, top k
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # the last k prompt tokens (-1: all that fit)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # lower runs first (--queue priority)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)  # vLLM's: see SamplingParams
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> GenerationRequest:
        for name in self.unsupported:
            if getattr(self, name, None) not in (None, False):  # {} asks for the feature too
                raise ValueError(f"{name} is not supported by this server")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1, or -1 for as many as the context holds")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream (as vLLM's chat)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream set to true")
        for key in self.logit_bias or {}:
            if not key.isdecimal():
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key!r}")
        if not all(self.stop_strings()):
            raise ValueError("stop must be non-empty strings")
        return self

    def asks_grammar(self) -> bool:
        return super().asks_grammar() or (self.response_format is not None and self.response_format.type != "text")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.default_max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, prompt_tokens: int, model: ModelInfo, copy: int) -> SamplingParams:
        """Engine parameters for one choice. Seeded copies get seed+copy: distinct yet reproducible.

        A max_tokens that cannot fit beside the prompt is refused (as OpenAI and vLLM do), naming the
        context length; left out, it means the room left.
        """
        room = max(1, model.max_model_len - prompt_tokens)
        max_tokens = self.requested_max_tokens() or room
        if max_tokens > room:
            raise ValueError(
                f"this model's context length is {model.max_model_len} tokens per request, but {prompt_tokens} "
                f"prompt tokens + max_tokens {max_tokens} = {prompt_tokens + max_tokens} tokens"
                + (f" ({model.context_hint})" if model.context_hint else ""))
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0), top_p=self.top_p,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=None if self.seed is None else (self.seed + copy) % 2**32, stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
            grammar=self.sampling_grammar(),
            logprobs=self.logprob_count(), prompt_logprobs=self.prompt_logprob_count(),
            logit_bias=self.token_biases(model.n_vocab), stop_token_ids=self.stop_tokens(model.n_vocab),
            min_tokens=self.min_tokens, include_stop_str=self.include_stop_str_in_output, cache_salt=self.cache_salt,
        )

    def sampling_grammar(self) -> str | None:
        return self.structured_grammar(self.response_format.grammar() if self.response_format else None)

    def token_biases(self, n_vocab: int) -> tuple[tuple[int, float], ...]:
        biases = tuple((int(key), value) for key, value in (self.logit_bias or {}).items())
        for token, _ in biases:
            if token >= n_vocab:
                raise ValueError(f"logit_bias: token id {token} is not in the vocabulary [0, {n_vocab})")
        return biases

    def stop_tokens(self, n_vocab: int) -> tuple[int, ...]:
        tokens = tuple(self.stop_token_ids or ())
        if any(not 0 <= t < n_vocab for t in tokens):
            raise ValueError(f"stop_token_ids must be token ids in [0, {n_vocab})")
        return tokens

    def prompt_logprob_count(self) -> int | None:
        return self.prompt_logprobs

    def logprob_count(self) -> int | None:
        """Top alternatives to report per token; None: no logprobs at all."""
        return None


class CompletionRequest(GenerationRequest):
    unsupported: ClassVar[tuple[str, ...]] = ("suffix",)

    prompt: Annotated[str | list[str] | list[int] | list[list[int]],
                      one_of("a string, a list of strings, token ids, or a list of token id lists")]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_batch(self) -> CompletionRequest:
        n_prompts = len(self.prompts())
        if n_prompts == 0:
            raise ValueError("prompt must not be empty")
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported by this server (other than best_of = n)")
        return self

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        """Eval harnesses score a text's log-likelihood with echo and logprobs: the prompt's own logprobs."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        return text_batch(self.prompt)
