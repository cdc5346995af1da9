"""`cobali synth-model` end to end: a random-weight GGUF that llama.cpp loads, quantised by llama.cpp,
whose logits stay finite over a long greedy decode."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cobali import cli
from cobali.synth import SHAPES, check_decode, synth_model


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
