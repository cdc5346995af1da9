"""llama.cpp's own sampler chains, one per request that is not plain greedy."""

from __future__ import annotations

import llama_cpp as ll

from cobali.backends.base import SamplingParams


class LlamaCppSampler:
    """One llama.cpp sampler chain per request: logit bias, penalties, top-k, top-p, min-p, temperature, then a
    draw. A constrained request's row reaches the chain already masked to what its grammar allows
    (cobali.structured.guide), so the chain draws from the allowed tokens only."""

    def __init__(self, ctx, vocab, params: SamplingParams) -> None:
        self.ctx = ctx  # the context whose logits rows it samples
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        self._fill_chain(params, ll.llama_vocab_n_tokens(vocab))

    def _fill_chain(self, params: SamplingParams, n_vocab: int) -> None:
        add = lambda s: ll.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if params.logit_bias:
            biases = (ll.llama_logit_bias * len(params.logit_bias))(
                *(ll.llama_logit_bias(token, bias) for token, bias in params.logit_bias))
            add(ll.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        if (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) != (1.0, 0.0, 0.0):
            add(ll.llama_sampler_init_penalties(n_vocab, 64, params.repetition_penalty,
                                                params.frequency_penalty, params.presence_penalty))
        if params.temperature == 0:
            add(ll.llama_sampler_init_greedy())
            return
        if 0 < params.top_k < n_vocab:
            add(ll.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(ll.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(ll.llama_sampler_init_min_p(params.min_p, 1))
        add(ll.llama_sampler_init_temp(params.temperature))
        seed = params.seed if params.seed is not None else ll.LLAMA_DEFAULT_SEED
        add(ll.llama_sampler_init_dist(seed))

    def sample(self, row: int) -> int:
        # llama_sampler_sample also accepts the token into the chain (penalty history, RNG).
        return int(ll.llama_sampler_sample(self.chain, self.ctx, row))

    def close(self) -> None:
        if self.chain:
            ll.llama_sampler_free(self.chain)
            self.chain = None
