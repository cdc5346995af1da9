"""Dummy-weight model shapes and the synth-model command line (no llama.cpp needed)."""

from __future__ import annotations

import pytest

from cobali.faces import cli
from cobali.faces.synth_model import SHAPES, ModelShape, tensor_shapes


@pytest.mark.parametrize(("name", "params"), [
    # Parameter counts of the published models (embeddings included, tied ones counted once).
    ("qwen2.5-0.5b", 494_032_768),
    ("qwen2.5-7b", 7_615_616_512),
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3.1-8b", 8_030_261_248),
])
def test_named_shapes_have_the_real_models_parameter_counts(name: str, params: int) -> None:
    assert SHAPES[name].n_params == params


def test_the_paper_model_shape() -> None:
    shape = SHAPES["qwen2.5-0.5b"]
    assert (shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv, shape.n_ff, shape.n_vocab) == (
        24, 896, 14, 2, 4864, 151936)
    names = [name for name, _ in tensor_shapes(shape)]
    assert "output.weight" not in names  # tied embeddings
    assert "blk.23.attn_q.bias" in names  # qwen2 has q/k/v biases


def test_a_head_size_of_its_own_shapes_the_attention_projections() -> None:
    shape = ModelShape("llama", 2, 64, 4, 2, 128, 49152, tied_embeddings=True, head_size=32)  # not 64 / 4
    dims = dict(tensor_shapes(shape))
    assert shape.head_dim == 32
    assert dims["blk.0.attn_q.weight"] == (128, 64) and dims["blk.0.attn_output.weight"] == (64, 128)
    assert dims["blk.0.attn_k.weight"] == dims["blk.0.attn_v.weight"] == (64, 64)
    assert ModelShape("llama", 2, 100, 4, 2, 128, 49152, tied_embeddings=True, head_size=32).head_dim == 32


def test_impossible_head_splits_are_rejected() -> None:
    with pytest.raises(ValueError, match="heads"):
        ModelShape("llama", 2, 100, 3, 1, 256, 49152, tied_embeddings=True)
    with pytest.raises(ValueError, match="architecture"):
        ModelShape("gpt9", 2, 256, 4, 2, 512, 49152, tied_embeddings=True)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["synth-model", "--out", "x.gguf", "--n-layer", "2"], "without --like, give every dimension"),
    (["synth-model", "--like", "gpt-5", "--out", "x.gguf"], "invalid choice: 'gpt-5'"),
    (["synth-model", "--like", "tiny", "--quant", "Q9_X", "--out", "x.gguf"], "invalid choice: 'Q9_X'"),
    (["synth-model", "--like", "tiny", "--n-vocab", "1000", "--out", "x.gguf"], "smaller than the embedded"),
    (["synth-model", "--like", "tiny", "--vocab-size", "1000", "--out", "x.gguf"], "smaller than the embedded"),
    (["synth-model", "--like", "tiny", "--n-head", "3", "--out", "x.gguf"], "must split into 3 heads"),
    (["synth-model", "--like", "tiny", "--head-dim", "0", "--out", "x.gguf"],
     "--head-dim: expected a positive integer, got 0"),
    (["synth-model", "--like", "tiny", "--head-dim", "33", "--out", "x.gguf"], "head size 33: must be even"),
    (["synth-model", "--like", "qwen2.5-0.5b", "--head-dim", "64", "--out", "x.gguf"],
     "head size 64: must be even, on the llama architecture"),
])
def test_bad_synth_flags_name_the_value(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err
