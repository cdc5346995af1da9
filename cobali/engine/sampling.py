"""Sampling every request of a batch at its row, and the logprobs of what was sampled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from cobali.structured.guide import Guide

if TYPE_CHECKING:
    from cobali.backends.base import Backend, TokenSampler
    from cobali.engine.sampling_params import SamplingParams

@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens and their logprobs, most likely first
    rank: int = 1  # 1 + how many tokens are more likely than it (vLLM's prompt_logprobs report it)


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
    return TokenLogprob(token, float(logprobs[token]), top, int((logprobs > logprobs[token]).sum()) + 1)


class Sampling(Protocol):
    """What the sampler reads of a request (cobali.engine.request.Request, which imports this module)."""

    id: int
    params: SamplingParams

    @property
    def n_sampled(self) -> int: ...


class RowSampler:
    """Samples every request that reached a sampling point in the last decode.

    Greedy rows share one argmax over the logits, the backend's (a GPU one computes it on the device); other
    rows use the request's own backend sampler (a llama.cpp chain), created on first use and kept for the
    request's life so penalties and RNG state follow the request. A constrained request's row is masked to what
    its grammar allows (the guide) before its sampler reads it.
    """

    def __init__(self, backend: Backend, eog_ids: np.ndarray, guide: Guide) -> None:
        self.backend = backend
        self.eog_ids = eog_ids  # what min_tokens bans, with the request's stop_token_ids
        self.guide = guide
        self._samplers: dict[int, TokenSampler] = {}

    def sample(self, logits: np.ndarray, requests: Sequence[Sampling], rows: list[int], out_rows: list[int]
               ) -> tuple[list[int | None], dict[int, Exception]]:
        """requests: those that sample, in output order; rows: their batch rows; out_rows: their rows of
        `logits` (more rows than requests when some asked for prompt logprobs). Returns one token per
        request, None where that request's sampler failed, and the failures by request id: one request's
        sampler must not take the engine (and every other request) down with it."""
        banned = self._ban_end_tokens(logits, requests, out_rows)
        guided = [(r.id, o, r.params.grammar) for r, o in zip(requests, out_rows, strict=True)
                  if r.params.grammar is not None]
        masked, failures = self.guide.constrain(logits, guided) if guided else ([], {})
        try:
            tokens = self._sample(logits, requests, rows, out_rows, failures)
        finally:  # logprobs are read from the model's own logits
            self.guide.restore(logits, masked)
            for out_row, ids, values in banned:
                logits[out_row, ids] = values
        if guided:
            self._feed_guide(requests, tokens, failures)
        return tokens, failures

    def _feed_guide(self, requests: Sequence[Sampling], tokens: list[int | None],
                    failures: dict[int, Exception]) -> None:
        """Each constrained request's token to its grammar; one the grammar refuses fails its request."""
        for i, (request, token) in enumerate(zip(requests, tokens, strict=True)):
            if token is not None and request.params.grammar is not None:
                error = self.guide.accept(request.id, token, request.params.grammar)
                if error is not None:
                    failures[request.id], tokens[i] = error, None

    def _ban_end_tokens(self, logits: np.ndarray, requests: Sequence[Sampling], out_rows: list[int]
                        ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """min_tokens: in the rows of requests short of it, end tokens and stop_token_ids get -inf, in place (a
        llama.cpp chain reads the same buffer). Returns each changed row's ids and old values."""
        banned = []
        for request, out_row in zip(requests, out_rows, strict=True):
            if request.params.min_tokens and request.n_sampled < request.params.min_tokens:
                ids = np.union1d(self.eog_ids, request.params.stop_token_ids).astype(np.int64)
                banned.append((out_row, ids, logits[out_row, ids].copy()))
                logits[out_row, ids] = -np.inf
        return banned

    def _sample(self, logits: np.ndarray, requests: Sequence[Sampling], rows: list[int], out_rows: list[int],
                failures: dict[int, Exception]) -> list[int | None]:
        """One token per request, None for those in `failures` already or whose sampler fails (added there)."""
        greedy = [r.params.is_greedy for r in requests]
        best = self.backend.argmax(logits).tolist() if any(greedy) else []
        if all(greedy):
            # One logits row per request (the common case) means out_rows is 0..n-1.
            return best if len(best) == len(requests) else [best[o] for o in out_rows]
        tokens: list[int | None] = []
        for request, row, out_row, is_greedy in zip(requests, rows, out_rows, greedy, strict=True):
            if is_greedy:
                tokens.append(best[out_row])
                continue
            if request.id in failures:
                tokens.append(None)
                continue
            if request.params.picks_the_likeliest:  # constrained and greedy: its masked row's argmax, on the host
                tokens.append(int(logits[out_row].argmax()))
                continue
            try:
                tokens.append(self._sampler_for(request.id, request.params).sample(row))
            except Exception as err:  # a backend's sampler is third-party code: contain its failure
                failures[request.id] = err
                tokens.append(None)
        return tokens

    def _sampler_for(self, request_id: int, params: SamplingParams) -> TokenSampler:
        sampler = self._samplers.get(request_id)
        if sampler is None:
            sampler = self._samplers[request_id] = self.backend.new_sampler(params)
        return sampler

    def forget(self, request_id: int) -> None:
        self.guide.forget(request_id)
        sampler = self._samplers.pop(request_id, None)
        if sampler is not None:
            sampler.close()
