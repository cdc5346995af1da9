"""The backend's estimate of one token's KV (it sizes the host-memory KV tier) against the bytes llama.cpp's
state_seq API really saves, on a synthesized model whose attention heads are not n_embd / n_head wide
(as Qwen3's and Gemma's are not): the K and V sizes must come from the model's metadata."""

from __future__ import annotations

import numpy as np
import pytest

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.kv_size import head_sizes
from cobali.faces.synth_model import ModelShape, check_decode, synth_model

# 4 heads of 32 over a hidden size of 64, where n_embd / n_head would say 16.
SHAPE = ModelShape("llama", 2, 64, 4, 2, 128, 49152, tied_embeddings=True, context_length=1024, head_size=32)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory, model_path: str) -> str:
    return str(synth_model(SHAPE, "F16", str(tmp_path_factory.mktemp("kv") / "wide-heads.gguf"), model_path, seed=1))


def test_llama_cpp_runs_a_model_whose_heads_are_not_n_embd_over_n_head_wide(wide_heads: str) -> None:
    check = check_decode(wide_heads, 32)
    assert check.description.startswith("llama ") and check.non_finite == 0 and check.min_std > 0


def test_the_kv_estimate_matches_what_a_sequence_saves_when_heads_have_a_size_of_their_own(wide_heads: str) -> None:
    backend = LlamaCppBackend(LlamaCppConfig(wide_heads, n_ctx=256, n_seq_max=2, n_batch=64))
    try:
        assert head_sizes(backend.model) == (32, 32)
        n, seq = 48, 1
        tokens = np.arange(100, 100 + n, dtype=np.int32)
        prompt = n - 8
        backend.decode(tokens[:prompt], np.arange(prompt, dtype=np.int32), np.full(prompt, seq, dtype=np.int32),
                       np.zeros(prompt, dtype=np.int8))
        for pos in range(prompt, n):  # and some tokens one at a time, as decoding does
            backend.decode(tokens[pos:pos + 1], np.array([pos], dtype=np.int32), np.array([seq], dtype=np.int32),
                           np.ones(1, dtype=np.int8))
        data = backend.save_seq(seq)
        # As the real-model test in test_engine_real.py: only per-layer headers beyond the per-token estimate.
        per_token = backend.info.kv_bytes_per_token
        assert abs(data.nbytes - n * per_token) < 1024, f"{n} tokens saved in {data.nbytes} bytes, not {per_token} each"
    finally:
        backend.close()
