"""Pooled embeddings from a llama.cpp embeddings context of their own."""

from __future__ import annotations

import os

import llama_cpp as ll
import numpy as np

from cobali.backends.llama_cpp.batch import OwnedBatch, decode_batch
from cobali.backends.llama_cpp.config import LlamaCppConfig

# The embeddings context: tokens one input may have (and one decode may carry), inputs per decode.
EMBEDDING_CTX = 2048
EMBEDDING_SEQS = 16


class Embedder:
    """An embeddings context: the inputs of one call share decodes (up to EMBEDDING_SEQS sequences and
    EMBEDDING_CTX tokens each), pooled the model's way, or by mean for a generative model that has none."""

    def __init__(self, model, options: LlamaCppConfig) -> None:
        self.ctx = self._context(model, options, ll.LLAMA_POOLING_TYPE_UNSPECIFIED)
        if ll.llama_pooling_type(self.ctx) == ll.LLAMA_POOLING_TYPE_NONE:
            ll.llama_free(self.ctx)
            self.ctx = self._context(model, options, ll.LLAMA_POOLING_TYPE_MEAN)
        self.n_embd = ll.llama_model_n_embd(model)
        self.batch = OwnedBatch(EMBEDDING_CTX)

    @staticmethod
    def _context(model, options: LlamaCppConfig, pooling: int):
        params = ll.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = EMBEDDING_CTX  # pooling needs a sequence in one ubatch
        params.n_seq_max = EMBEDDING_SEQS
        params.kv_unified = True
        params.embeddings = True
        params.pooling_type = pooling
        params.n_threads = params.n_threads_batch = options.n_threads or os.cpu_count() or 1
        ctx = ll.llama_init_from_model(model, params)
        if not ctx:
            raise ValueError("could not create a llama.cpp embeddings context")
        return ctx

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        out = np.zeros((len(inputs), self.n_embd), dtype=np.float32)
        group: list[int] = []
        for index, tokens in enumerate(inputs):
            assert 0 < len(tokens) <= EMBEDDING_CTX, "inputs are checked against embedding_limits"
            if group and (len(group) == EMBEDDING_SEQS
                          or sum(len(inputs[i]) for i in group) + len(tokens) > EMBEDDING_CTX):
                self._decode(inputs, group, out)
                group = []
            group.append(index)
        self._decode(inputs, group, out)
        return out

    def _decode(self, inputs: list[list[int]], group: list[int], out: np.ndarray) -> None:
        tokens = np.concatenate([inputs[i] for i in group]).astype(np.int32)
        positions = np.concatenate([np.arange(len(inputs[i])) for i in group])
        seqs = np.concatenate([np.full(len(inputs[i]), seq) for seq, i in enumerate(group)])
        self.batch.fill(tokens, positions, seqs, np.ones(len(tokens), dtype=np.int8))
        memory = ll.llama_get_memory(self.ctx)
        try:
            decode_batch(self.ctx, self.batch)
            for seq, index in enumerate(group):
                out[index] = np.ctypeslib.as_array(ll.llama_get_embeddings_seq(self.ctx, seq), shape=(self.n_embd,))
        finally:
            ll.llama_memory_clear(memory, True)

    def close(self) -> None:
        ll.llama_free(self.ctx)
