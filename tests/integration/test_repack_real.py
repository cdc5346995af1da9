"""Weight repacking on a real Q4_0 model: by default it repacks where the CPU allows, the backend reads that from
llama.cpp's own load lines, --no-repack keeps the layout, and the logits agree either way."""

from __future__ import annotations

import numpy as np
import pytest

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.loading import repack_choice
from cobali.faces.synth_model import SHAPES, synth_model


def prompt_logits(backend: LlamaCppBackend, n: int = 80) -> np.ndarray:
    pos = np.arange(n, dtype=np.int32)
    want = np.ones(n, dtype=np.int8)
    return backend.decode((100 + pos).astype(np.int32), pos, np.zeros(n, np.int32), want).copy()


def test_a_q4_0_model_repacks_by_default_and_not_when_told(tmp_path, model_path: str) -> None:
    path = str(synth_model(SHAPES["tiny"], "Q4_0", str(tmp_path / "tiny-q4_0.gguf"), model_path, seed=1))
    if not repack_choice(None, path).on:
        pytest.skip(f"no repacking on this machine by default: {repack_choice(None, path).why}")
    logits = {}
    for repack in (None, False):
        backend = LlamaCppBackend(LlamaCppConfig(path, n_ctx=256, n_seq_max=1, n_batch=128, n_threads=1,
                                                 repack=repack))
        try:
            assert backend.weights_repacked is (repack is None)
            assert ("weights repacked" in backend.info.description) is (repack is None)
            logits[repack] = prompt_logits(backend)
        finally:
            backend.close()
    # The same weights in another layout: the sums differ in order and rounding (the worst logit ~0.05 of the
    # logits' spread here), where a wrong layout would give unrelated logits (~1.4 of it).
    spread = float(np.std(logits[False]))
    assert np.max(np.abs(logits[None] - logits[False])) < 0.3 * spread
