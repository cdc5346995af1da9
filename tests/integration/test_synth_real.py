"""`cobali synth-model` end to end: a random-weight GGUF that llama.cpp loads, quantised by llama.cpp,
whose logits stay finite over a long greedy decode."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp_config import LlamaCppConfig
from cobali.synth import SHAPES, synth_model

N_DECODE = 256


@pytest.mark.parametrize(("arch", "quant", "described"),
                         [("llama", "Q8_0", "Q8_0"), ("qwen2", "Q4_K_M", "Q4_K - Medium")])
def test_a_synthesized_model_decodes_with_finite_logits(tmp_path, model_path: str, arch: str, quant: str,
                                                       described: str) -> None:
    # A vocabulary beyond the embedded tokenizer's 49152: the tokenizer is padded to it.
    shape = replace(SHAPES["tiny"], arch=arch, n_vocab=50000)
    path = synth_model(shape, quant, str(tmp_path / f"tiny-{arch}.gguf"), model_path, seed=1)
    backend = LlamaCppBackend(LlamaCppConfig(str(path), n_seq_max=1, n_batch=64))
    try:
        assert backend.info.n_vocab == 50000
        assert backend.info.description.startswith(f"{arch} ") and described in backend.info.description
        prompt = backend.tokenize("The capital of France is")
        logits = backend.decode(np.array(prompt, np.int32), np.arange(len(prompt), dtype=np.int32),
                                np.zeros(len(prompt), np.int32), np.eye(1, len(prompt), len(prompt) - 1, np.int8)[0])
        bad, spread = 0, []
        for pos in range(len(prompt), len(prompt) + N_DECODE):
            row = logits[-1]
            bad += int(not np.isfinite(row).all())
            spread.append(float(row.std()))
            token = int(np.argmax(row))
            logits = backend.decode(np.array([token], np.int32), np.array([pos], np.int32), np.zeros(1, np.int32),
                                    np.ones(1, np.int8))
        assert bad == 0
        assert min(spread) > 0  # not a constant: the random weights reach the logits
    finally:
        backend.close()
