"""llama.cpp's own sampler chains, one per request that is not plain greedy."""

from __future__ import annotations

import ctypes

import llama_cpp as ll
import numpy as np

from cobali.backends.base import SamplingParams

# Draws a grammar may refuse before all tokens go through it: each refused one is masked and the chain draws
# again (~0.4 ms: a draw softmaxes the whole vocabulary), against ~4 ms for the whole vocabulary through the
# grammar on this CPU.
REDRAWS = 4


class LlamaCppSampler:
    """One llama.cpp sampler chain per request: penalties, top-k, top-p, min-p, temperature, then a draw.

    A grammar stands beside the chain, as llama-server's sampler has it: the chain picks from the whole
    vocabulary and the grammar checks that one token. A refused token is masked and the chain draws again; only
    after REDRAWS refusals are all tokens run through the grammar before the chain picks. Checking every token
    each time costs ~7 ms a token on this CPU (49k tokens); one check costs microseconds. Greedy picks are the
    grammar-first ones exactly; with temperature alone so is the distribution (drawing, and drawing again without
    the refused tokens, samples the allowed tokens renormalised); top-k/p/min-p truncate the vocabulary before the
    grammar's refusals rather than after, as llama-server's sampler does.
    """

    def __init__(self, ctx, vocab, params: SamplingParams, candidates: Candidates | None = None) -> None:
        """candidates: the buffer a grammar's sampler picks from, shared by the samplers of one thread (so it
        stays in cache)."""
        self.ctx = ctx  # the context whose logits rows it samples
        n_vocab = ll.llama_vocab_n_tokens(vocab)
        self.grammar = None
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        add = lambda s: ll.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if params.grammar is not None:
            self.grammar = ll.llama_sampler_init_grammar(vocab, params.grammar.encode(), b"root")
            if not self.grammar:
                self.close()
                raise ValueError("invalid grammar")
            assert candidates is not None, "a grammar's sampler picks from a candidates buffer"
            self.candidates = candidates
        if params.logit_bias:
            biases = (ll.llama_logit_bias * len(params.logit_bias))(*params.logit_bias)
            add(ll.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        if (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) != (1.0, 0.0, 0.0):
            add(ll.llama_sampler_init_penalties(n_vocab, 64, params.repetition_penalty,
                                                params.frequency_penalty, params.presence_penalty))
        if params.temperature == 0:
            add(ll.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            add(ll.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(ll.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(ll.llama_sampler_init_min_p(params.min_p, 1))
        add(ll.llama_sampler_init_temp(params.temperature))
        seed = params.seed if params.seed is not None else ll.LLAMA_DEFAULT_SEED
        add(ll.llama_sampler_init_dist(seed))

    def sample(self, row: int) -> int:
        if self.grammar is None:
            # llama_sampler_sample also accepts the token into the chain (penalty history, RNG).
            return int(ll.llama_sampler_sample(self.chain, self.ctx, row))
        logits = ll.llama_get_logits_ith(self.ctx, row)
        refused: list[int] = []
        while True:
            self.candidates.refill(logits, refused)
            token = self.candidates.pick(self.chain)
            if self.candidates.allows(self.grammar, token):
                break
            refused.append(token)
            if len(refused) == REDRAWS:
                self.candidates.refill(logits)
                ll.llama_sampler_apply(self.grammar, self.candidates.ref)
                token = self.candidates.pick(self.chain)
                break
        ll.llama_sampler_accept(self.grammar, token)
        ll.llama_sampler_accept(self.chain, token)
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
        self._rows: dict[int, np.ndarray] = {}  # logits rows viewed, by address: making a view costs ~20 us

    def refill(self, logits, refused: list[int] | None = None) -> None:
        """Every token with its logit, the `refused` ones at -inf (the chain's truncations sort and shrink the
        array in place)."""
        address = ctypes.addressof(logits.contents)
        row = self._rows.get(address)
        if row is None:
            if len(self._rows) > 4096:  # rows of buffers llama.cpp has since reallocated
                self._rows.clear()
            row = self._rows[address] = np.ctypeslib.as_array(logits, shape=(len(self.data),))
        self._words[:] = self._fresh
        self.data["logit"] = row
        if refused:
            self.data["logit"][refused] = -np.inf
        self.array.data, self.array.size = self._pointer, len(self.data)
        self.array.selected, self.array.sorted = -1, False

    def pick(self, chain) -> int:
        """The chain's pick from the candidates as they are."""
        ll.llama_sampler_apply(chain, self.ref)
        assert 0 <= self.array.selected < self.array.size, "the chain ends in a pick"
        return int(self.array.data[self.array.selected].id)  # a sampler may point the array elsewhere (refill resets)

    def allows(self, grammar, token: int) -> bool:
        self.one[0] = (token, 0.0, 0.0)
        self.one_array.size, self.one_array.selected = 1, -1
        ll.llama_sampler_apply(grammar, ctypes.byref(self.one_array))
        return bool(np.isfinite(self.one["logit"][0]))
