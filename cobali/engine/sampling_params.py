"""A request's sampling and stopping: the engine's vocabulary. The backend seam takes only its sampler chain."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from cobali.backends.base import SamplerChain


@dataclass(frozen=True, kw_only=True)
class SamplingParams(SamplerChain):
    """Per-request sampling and stopping: the sampler chain's settings (the backend's part) and the engine's.
    Validated on construction: bad values raise ValueError."""

    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None  # an llguidance grammar (cobali.structured.grammars): the output must follow it
    logprobs: int | None = None  # report each sampled token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # also each prompt token's logprob (after the first), with alternatives
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output as an end-of-generation token does
    min_tokens: int = 0  # until this many are out, end tokens and stop_token_ids are never sampled, stop strings unseen
    include_stop_str: bool = False  # the stop string that ended the output ends its text too
    # vLLM's: cached prompt KV is shared only among requests with the same salt (None: among unsalted ones), so one
    # tenant cannot learn another's prompts from its cache hits. The engine's prefix cache reads it, no sampler.
    cache_salt: str | None = None
    # Control tokens whose text the output keeps (llama-server's preserved tokens): the tags a reply parser reads,
    # which llama.cpp renders as no text. Made by the server from its parsers, never from a request: its size is
    # the parsers' tags, not the client's.
    preserved_tokens: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _check(math.isfinite(getattr(self, name)), f"{name} must be a finite number")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(self.seed is None or self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        # The server holds k to its --max-logprobs; the engine needs only a count.
        _check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0,
               f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        _check(all(math.isfinite(bias) for _, bias in self.logit_bias), "logit_bias values must be finite")
        _check(0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids (>= 0)")
        _check(isinstance(self.preserved_tokens, frozenset) and all(t >= 0 for t in self.preserved_tokens),
               "preserved_tokens must be a frozenset of token ids (>= 0)")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
               "cache_salt must be a non-empty string")
        # A finished grammar allows nothing but an end token: banning it would leave no token to sample.
        _check(not (self.min_tokens and self.grammar), "min_tokens cannot be combined with a grammar "
               "(response_format json_object or json_schema, or a forced tool call)")
        # Past the grammar's end only an end token is allowed: an output that may not end has nowhere to go.
        _check(not (self.ignore_eos and self.grammar), "ignore_eos cannot be combined with a grammar "
               "(response_format json_object or json_schema, structured outputs, or a forced tool call)")

    @cached_property  # read for every sampled token
    def is_greedy(self) -> bool:
        """Greedy rows are sampled by one vectorized argmax; anything that reshapes logits needs a chain."""
        return self.picks_the_likeliest and self.grammar is None

    @cached_property
    def picks_the_likeliest(self) -> bool:
        """The token is the argmax of the row as the host holds it (a constrained row: once masked)."""
        return (
            (self.temperature == 0 or self.top_k == 1)
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and not self.logit_bias
        )

    @cached_property
    def needs_only_argmax(self) -> bool:
        """A generated token's logits are read for nothing but their argmax (no logprobs to report), so the
        backend may pick it without handing the logits over. Prompt logprobs read only prefill rows."""
        return self.is_greedy and self.logprobs is None and self.min_tokens == 0  # a ban is applied on the host


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
