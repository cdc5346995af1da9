"""`cobali synth-model` end to end: a random-weight GGUF that llama.cpp loads, quantised by llama.cpp,
whose logits stay finite over a long greedy decode."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.faces import cli
from cobali.faces.synth_model import SHAPES, check_decode, synth_model, write_tokenizer


@pytest.mark.parametrize(("arch", "quant", "described"),
                         [("llama", "Q8_0", "Q8_0"), ("qwen2", "Q4_K_M", "Q4_K - Medium")])
def test_a_synthesized_model_decodes_with_finite_logits(tmp_path, model_path: str, arch: str, quant: str,
                                                       described: str) -> None:
    # A vocabulary beyond the embedded tokenizer's 49152: the tokenizer is padded to it.
    shape = replace(SHAPES["tiny"], arch=arch, n_vocab=50000)
    path = synth_model(shape, quant, str(tmp_path / f"tiny-{arch}.gguf"), model_path, seed=1)
    check = check_decode(str(path), 256)
    assert check.n_vocab == 50000
    assert check.description.startswith(f"{arch} ") and described in check.description
    assert check.non_finite == 0
    assert check.min_std > 0  # not a constant: the random weights reach the logits


def test_synth_model_checks_what_it_wrote(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.gguf"
    assert cli.main(["synth-model", "--like", "tiny", "--quant", "Q8_0", "--out", str(out), "--check", "8"]) == 0
    assert "8 greedy tokens" in capsys.readouterr().out and out.stat().st_size > 0


@pytest.mark.parametrize(("flags", "n_vocab"), [
    (["--like", "tiny", "--vocab-size", "50000"], 50000),
    # The GPU kit's default shape keeps its real vocabulary (here with small layers, to write it quickly).
    (["--like", "qwen2.5-0.5b", "--n-layer", "1", "--n-embd", "64", "--n-head", "2", "--n-head-kv", "1",
      "--n-ff", "64"], 151936),
], ids=["--vocab-size", "qwen2.5-0.5b"])
def test_the_kits_tokenizer_is_padded_to_the_vocabulary_size(tmp_path, model_path: str, flags: list[str],
                                                             n_vocab: int) -> None:
    """As the GPU kit makes its model: from the bundle's tokenizer-only GGUF (the embedded model's 49152 tokens)."""
    tokenizer, out = tmp_path / "tokenizer.gguf", tmp_path / "model.gguf"
    write_tokenizer(model_path, str(tokenizer))
    assert cli.main(["synth-model", *flags, "--quant", "F16", "--tokenizer", str(tokenizer), "--out", str(out)]) == 0
    backend = LlamaCppBackend(LlamaCppConfig(str(out), n_ctx=256, n_seq_max=1, n_batch=64, n_threads=1))
    try:
        assert backend.info.n_vocab == n_vocab
        assert max(backend.tokenize("The capital of France is")) < 49152  # the padding is never produced
    finally:
        backend.close()
