"""llama.cpp's own sampler chains, one per request that is not plain greedy."""

from __future__ import annotations

import llama_cpp as ll

from cobali.backends.base import SamplerChain


class LlamaCppSampler:
    """One llama.cpp sampler chain per request: logit bias, penalties, top-k, top-p, min-p, temperature, then a
    draw. A constrained request's row reaches the chain already masked to what its grammar allows
    (cobali.structured.guide), so the chain draws from the allowed tokens only."""

    def __init__(self, ctx, vocab, spec: SamplerChain) -> None:
        self.ctx = ctx  # the context whose logits rows it samples
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        self._fill_chain(spec, ll.llama_vocab_n_tokens(vocab))

    def _fill_chain(self, spec: SamplerChain, n_vocab: int) -> None:
        add = lambda s: ll.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if spec.logit_bias:
            biases = (ll.llama_logit_bias * len(spec.logit_bias))(
                *(ll.llama_logit_bias(token, bias) for token, bias in spec.logit_bias))
            add(ll.llama_sampler_init_logit_bias(n_vocab, len(spec.logit_bias), biases))
        if (spec.repetition_penalty, spec.frequency_penalty, spec.presence_penalty) != (1.0, 0.0, 0.0):
            add(ll.llama_sampler_init_penalties(n_vocab, 64, spec.repetition_penalty,
                                                spec.frequency_penalty, spec.presence_penalty))
        if spec.temperature == 0:
            add(ll.llama_sampler_init_greedy())
            return
        if 0 < spec.top_k < n_vocab:
            add(ll.llama_sampler_init_top_k(spec.top_k))
        if spec.top_p < 1.0:
            add(ll.llama_sampler_init_top_p(spec.top_p, 1))
        if spec.min_p > 0.0:
            add(ll.llama_sampler_init_min_p(spec.min_p, 1))
        add(ll.llama_sampler_init_temp(spec.temperature))
        seed = spec.seed if spec.seed is not None else ll.LLAMA_DEFAULT_SEED
        add(ll.llama_sampler_init_dist(seed))

    def sample(self, row: int) -> int:
        # llama_sampler_sample also accepts the token into the chain (penalty history, RNG).
        return int(ll.llama_sampler_sample(self.chain, self.ctx, row))

    def close(self) -> None:
        if self.chain:
            ll.llama_sampler_free(self.chain)
            self.chain = None
