"""llama.cpp's own sampler chains, one per request that is not plain greedy."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import llama_cpp as ll
import numpy as np

from cobali.backends.base import SamplingParams

# Draws a grammar may refuse, under a chain that truncates nothing, before all tokens go through it: each refused
# one is masked and the chain draws again (~0.4 ms: a draw softmaxes the whole vocabulary), against ~4 ms for the
# whole vocabulary through the grammar on this CPU.
REDRAWS = 4


class LlamaCppSampler:
    """One llama.cpp sampler chain per request: penalties, top-k, top-p, min-p, temperature, then a draw.

    A grammar stands beside the chain, as in llama-server's sampler: the chain picks from the whole vocabulary
    and the grammar checks that one token (microseconds; all 49k tokens through it cost ~7 ms on this CPU). A
    chain that truncates nothing (greedy, or temperature without top-k/top-p/min-p) masks a refused token and
    draws again, up to REDRAWS draws: that samples the allowed tokens renormalised, the grammar-first
    distribution exactly. A truncating chain draws once, as llama-server does: masking and drawing again would
    re-truncate around each refusal, a distribution that is neither. After the last refused draw all tokens go
    through the grammar and the chain picks from those it allows.
    """

    def __init__(self, ctx, vocab, params: SamplingParams, candidates: Candidates,
                 logits_row: Callable[[int], np.ndarray]) -> None:
        """candidates: the buffer a grammar's sampler picks from, shared by the samplers of one thread (so it
        stays in cache); logits_row: a batch row's logits in the last decode."""
        self.ctx = ctx  # the context whose logits rows it samples
        self.candidates, self.logits_row = candidates, logits_row
        self.grammar = None
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if params.grammar is not None:
            self.grammar = ll.llama_sampler_init_grammar(vocab, params.grammar.encode(), b"root")
            if not self.grammar:
                self.close()
                raise ValueError("invalid grammar")
        truncates = self._fill_chain(params, ll.llama_vocab_n_tokens(vocab))
        self.draws = 1 if truncates else REDRAWS

    def _fill_chain(self, params: SamplingParams, n_vocab: int) -> bool:
        """The chain's samplers; True when one of them truncates the vocabulary."""
        add = lambda s: ll.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if params.logit_bias:
            biases = (ll.llama_logit_bias * len(params.logit_bias))(*params.logit_bias)
            add(ll.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        if (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) != (1.0, 0.0, 0.0):
            add(ll.llama_sampler_init_penalties(n_vocab, 64, params.repetition_penalty,
                                                params.frequency_penalty, params.presence_penalty))
        if params.temperature == 0:
            add(ll.llama_sampler_init_greedy())
            return False
        truncates = False
        if 0 < params.top_k < n_vocab:
            add(ll.llama_sampler_init_top_k(params.top_k))
            truncates = True
        if params.top_p < 1.0:
            add(ll.llama_sampler_init_top_p(params.top_p, 1))
            truncates = True
        if params.min_p > 0.0:
            add(ll.llama_sampler_init_min_p(params.min_p, 1))
            truncates = True
        add(ll.llama_sampler_init_temp(params.temperature))
        seed = params.seed if params.seed is not None else ll.LLAMA_DEFAULT_SEED
        add(ll.llama_sampler_init_dist(seed))
        return truncates

    def sample(self, row: int) -> int:
        if self.grammar is None:
            # llama_sampler_sample also accepts the token into the chain (penalty history, RNG).
            return int(ll.llama_sampler_sample(self.chain, self.ctx, row))
        token = self._draw(self.logits_row(row))
        ll.llama_sampler_accept(self.grammar, token)  # llama.cpp aborts the process on a token the grammar refuses
        ll.llama_sampler_accept(self.chain, token)
        return token

    def _draw(self, logits: np.ndarray) -> int:
        """The chain's pick among the tokens the grammar allows: drawn (each refused draw masked), or after
        `draws` refusals picked with every token through the grammar. ValueError when the grammar allows none
        (a grammar that dead-ends: the request cannot go on)."""
        candidates, refused = self.candidates, []
        while len(refused) < self.draws:
            candidates.refill(logits, refused)
            token = candidates.pick(self.chain)
            if candidates.allows(self.grammar, token):
                return token
            refused.append(token)
        candidates.refill(logits)
        candidates.narrow(self.grammar)
        token = candidates.pick(self.chain)  # the chain picks even when every logit is -inf
        if not candidates.allows(self.grammar, token):
            raise ValueError("the grammar allows no token after the text written so far")
        return token

    def close(self) -> None:
        for sampler in ("grammar", "chain"):
            if getattr(self, sampler):
                ll.llama_sampler_free(getattr(self, sampler))
                setattr(self, sampler, None)


class Candidates:
    """A llama_token_data_array over the whole vocabulary, in memory numpy fills; and a one-token array."""

    _DTYPE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])

    def __init__(self, n_vocab: int) -> None:
        assert self._DTYPE.itemsize == ctypes.sizeof(ll.llama_token_data)
        self.data = np.zeros(n_vocab, dtype=self._DTYPE)
        self._words = self.data.view(np.int32).reshape(n_vocab, 3)
        self._fresh = self._words.copy()  # every id, logits and p zero: copied whole, faster than field by field
        self._fresh[:, 0] = np.arange(n_vocab, dtype=np.int32)
        self._pointer = self.data.ctypes.data_as(ctypes.POINTER(ll.llama_token_data))
        self.array = ll.llama_token_data_array(data=self._pointer, size=n_vocab, selected=-1, sorted=False)
        self.ref = ctypes.byref(self.array)
        self.one = np.zeros(1, dtype=self._DTYPE)
        self.one_array = ll.llama_token_data_array(data=self.one.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
                                                   size=1, selected=-1, sorted=False)

    def refill(self, logits: np.ndarray, refused: list[int] | None = None) -> None:
        """Every token with its logit (a row over the vocabulary), the `refused` ones at -inf (the chain's
        truncations sort and shrink the array in place)."""
        self._words[:] = self._fresh
        self.data["logit"] = logits
        if refused:
            self.data["logit"][refused] = -np.inf
        self.array.data, self.array.size = self._pointer, len(self.data)
        self.array.selected, self.array.sorted = -1, False

    def narrow(self, grammar) -> None:
        """Every token the grammar refuses at -inf (llama.cpp's grammar sampler over the whole array)."""
        ll.llama_sampler_apply(grammar, self.ref)

    def pick(self, chain) -> int:
        """The chain's pick from the candidates as they are."""
        ll.llama_sampler_apply(chain, self.ref)
        assert 0 <= self.array.selected < self.array.size, "the chain ends in a pick"
        return int(self.array.data[self.array.selected].id)  # a sampler may point the array elsewhere (refill resets)

    def allows(self, grammar, token: int) -> bool:
        """Whether the grammar's sampler, in its state, lets `token` come next."""
        self.one[0] = (token, 0.0, 0.0)
        self.one_array.size, self.one_array.selected = 1, -1
        ll.llama_sampler_apply(grammar, ctypes.byref(self.one_array))
        return bool(np.isfinite(self.one["logit"][0]))
