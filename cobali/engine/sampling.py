"""Sampling parameters, and sampling every request of a batch at its row."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from cobali.backends.base import Backend, TokenSampler

MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default max_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping. Validated on construction: bad values raise ValueError."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None
    logprobs: int | None = None  # report each sampled token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # also each prompt token's logprob (after the first), with alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias added to its logit before sampling)

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
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
               f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        _check(all(math.isfinite(bias) for _, bias in self.logit_bias), "logit_bias values must be finite")

    @property
    def is_greedy(self) -> bool:
        """Greedy rows are sampled by one vectorized argmax; anything that reshapes logits needs a chain."""
        return (
            (self.temperature == 0 or self.top_k == 1)
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.grammar is None
            and not self.logit_bias
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens and their logprobs, most likely first


def token_logprob(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """Logprobs under the model's own distribution (before penalties, temperature and truncation), which is
    what vLLM reports by default."""
    shifted = logits.astype(np.float64) - float(logits.max())
    logprobs = shifted - np.log(np.exp(shifted).sum())
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        best = np.argpartition(-logprobs, k - 1)[:k]
        best = best[np.argsort(-logprobs[best], kind="stable")]
        top = tuple((int(t), float(logprobs[t])) for t in best)
    return TokenLogprob(token, float(logprobs[token]), top)


class RowSampler:
    """Samples every request that reached a sampling point in the last decode.

    Greedy rows share one vectorized argmax over the logits; other rows use the request's own
    backend sampler (a llama.cpp chain), created on first use and kept for the request's life so
    penalties and RNG state follow the request.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._samplers: dict[int, TokenSampler] = {}

    def sample(self, logits: np.ndarray, picks: list[tuple[int, SamplingParams, int, int]]
               ) -> tuple[list[int | None], dict[int, str]]:
        """picks: (request_id, params, batch_row, output_row) in output order. Returns one token per pick,
        None where that request's sampler failed, and the failures' messages by request id: one request's
        sampler must not take the engine (and every other request) down with it."""
        greedy = logits.argmax(axis=1) if any(p.is_greedy for _, p, _, _ in picks) else None
        tokens: list[int | None] = []
        failures: dict[int, str] = {}
        for request_id, params, row, out_row in picks:
            if params.is_greedy:
                tokens.append(int(greedy[out_row]))
                continue
            try:
                tokens.append(self._sampler_for(request_id, params).sample(row))
            except Exception as err:  # a backend's sampler is third-party code: contain its failure
                failures[request_id] = f"{type(err).__name__}: {err}"
                tokens.append(None)
        return tokens, failures

    def _sampler_for(self, request_id: int, params: SamplingParams) -> TokenSampler:
        sampler = self._samplers.get(request_id)
        if sampler is None:
            sampler = self._samplers[request_id] = self.backend.new_sampler(params)
        return sampler

    def forget(self, request_id: int) -> None:
        sampler = self._samplers.pop(request_id, None)
        if sampler is not None:
            sampler.close()
