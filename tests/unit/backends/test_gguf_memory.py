"""A model's memory estimated before it loads, from its GGUF metadata: the KV as the loaded path computes it (per
layer where heads differ, with a recurrent layer's state), the output and compute buffers, split files, and the
embedded model's parts against what llama.cpp logged when it loaded it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from cobali.backends.gguf_memory import estimate_model_bytes, model_bytes, read_shape, shard_paths
from cobali.backends.llama_cpp.config import DEFAULT_CTX_PER_SEQ, LlamaCppConfig

MiB = 2**20


def write_gguf(path: Path, arch: str = "llama", n_layer: int = 4, n_embd: int = 64, head_count: Any = 4,
               head_count_kv: Any = 2, n_vocab: int | None = 1000, tokens: int = 0, context_length: int = 4096,
               **metadata: int) -> str:
    """A GGUF holding metadata only (no tensor): all the estimate reads besides the file's size. `metadata`'s
    keys are the architecture's, __ for . (ssm__state_size: the file's {arch}.ssm.state_size)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(n_layer)
    writer.add_embedding_length(n_embd)
    writer.add_context_length(context_length)
    writer.add_head_count(head_count)
    writer.add_head_count_kv(head_count_kv)
    if n_vocab is not None:
        writer.add_vocab_size(n_vocab)
    if tokens:
        writer.add_token_list([f"t{i}" for i in range(tokens)])
    for key, value in metadata.items():
        writer.add_uint32(f"{arch}.{key.replace('__', '.')}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize(("cache_k", "cache_v"), [("f16", "f16"), ("q8_0", "q4_0"), ("f32", "q5_1")])
def test_the_kv_is_what_the_loaded_path_computes(tmp_path: Path, cache_k: str, cache_v: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", n_layer=6, n_embd=256, head_count=8, head_count_kv=2)
    config = LlamaCppConfig(path, n_seq_max=4, cache_type_k=cache_k, cache_type_v=cache_v)
    # kv_size.kv_cell_bytes: n_layer rows of n_head_kv x head size, K and V, in the cache types.
    cell = config.kv_row_bytes(6, 2 * 32, 2 * 32)
    assert model_bytes(config).kv == 4 * DEFAULT_CTX_PER_SEQ * cell
    assert model_bytes(LlamaCppConfig(path, n_ctx=1000, cache_type_k=cache_k, cache_type_v=cache_v)).kv == 1000 * cell


def test_head_sizes_come_from_the_metadata_where_it_gives_them(tmp_path: Path) -> None:
    wide = write_gguf(tmp_path / "w.gguf", n_embd=64, head_count=4, head_count_kv=2, attention__key_length=32)
    shape = read_shape(wide)
    assert (shape.key_length, shape.value_length) == (32, 32)  # the value length defaults to the key length
    own = read_shape(write_gguf(tmp_path / "o.gguf", attention__key_length=32, attention__value_length=16))
    assert (own.key_length, own.value_length) == (32, 16)


def test_a_per_layer_head_count_kv_counts_each_layer_and_a_hybrids_recurrent_state(tmp_path: Path) -> None:
    plain = write_gguf(tmp_path / "p.gguf", arch="jamba", n_layer=4, head_count_kv=[2, 0, 2, 0])
    config = LlamaCppConfig(plain, n_ctx=512, n_seq_max=2, n_batch=64)
    assert model_bytes(config).kv == 512 * config.kv_row_bytes(2, 2 * 16, 2 * 16)  # the two attention layers
    ssm = {"ssm__conv_kernel": 4, "ssm__inner_size": 128, "ssm__state_size": 16, "ssm__group_count": 1}
    hybrid = write_gguf(tmp_path / "h.gguf", arch="jamba", n_layer=4, head_count_kv=[2, 0, 2, 0], **ssm)
    # llama.cpp's n_embd_r + n_embd_s: (d_conv - 1) x (d_inner + 2 x groups x d_state) + d_state x d_inner, in f32,
    # for each of the 2 recurrent layers and each of the 2 sequences.
    state = ((4 - 1) * (128 + 2 * 16) + 16 * 128) * 4
    hybrid_config = LlamaCppConfig(hybrid, n_ctx=512, n_seq_max=2, n_batch=64)
    assert model_bytes(hybrid_config).kv == model_bytes(config).kv + 2 * 2 * state
    rwkv = write_gguf(tmp_path / "r.gguf", arch="rwkv6", n_layer=3, head_count=0, head_count_kv=0,
                      wkv__head_size=64, token_shift_count=2)
    assert model_bytes(LlamaCppConfig(rwkv, n_seq_max=2)).kv == 3 * 2 * (2 * 64 + 64 * 64) * 4


def test_the_vocabulary_is_counted_from_the_tokens_where_no_vocab_size_is_given(tmp_path: Path) -> None:
    assert read_shape(write_gguf(tmp_path / "t.gguf", n_vocab=None, tokens=777)).n_vocab == 777


def test_the_output_buffer_holds_a_logits_row_for_each_output_a_decode_may_have(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", n_vocab=1000)
    assert model_bytes(LlamaCppConfig(path, n_seq_max=8)).output == 1000 * 8 * 4
    assert model_bytes(LlamaCppConfig(path, n_seq_max=8, max_outputs_per_seq=3)).output == 1000 * 8 * 3 * 4
    assert model_bytes(LlamaCppConfig(path, n_seq_max=8, backend_sampling=True)).output == 4 * 1000 * 8 * 4


def test_the_compute_buffer_grows_with_the_batch_and_without_flash_attention_with_the_context(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", n_embd=64, head_count=4, n_vocab=1000)
    small, large = (model_bytes(LlamaCppConfig(path, n_batch=n, n_seq_max=1, n_ctx=256)).compute for n in (64, 256))
    assert small == 64 * (1000 + 4 * 64) * 4 and large == 4 * small
    on, off = (model_bytes(LlamaCppConfig(path, n_batch=64, n_seq_max=1, n_ctx=65536, flash_attn=mode)).compute
               for mode in ("on", "off"))
    assert on == small and off == 64 * 65536 * (4 + 1) * 4  # each head's scores over the cells, and the mask's


def test_a_split_model_weighs_all_its_shards(tmp_path: Path) -> None:
    first = write_gguf(tmp_path / "big-00001-of-00003.gguf")
    for index in (2, 3):
        (tmp_path / f"big-0000{index}-of-00003.gguf").write_bytes(b"GGUF" + bytes(1000 * index))
    assert shard_paths(first) == [str(tmp_path / f"big-0000{i}-of-00003.gguf") for i in (1, 2, 3)]
    whole = model_bytes(LlamaCppConfig(first))
    assert whole.weights == os.path.getsize(first) + 2004 + 3004
    (tmp_path / "big-00003-of-00003.gguf").unlink()
    with pytest.raises(ValueError, match=r"missing .*big-00003-of-00003\.gguf"):
        estimate_model_bytes(LlamaCppConfig(first))
    with pytest.raises(ValueError, match="shard 2 of a split model"):
        estimate_model_bytes(LlamaCppConfig(str(tmp_path / "big-00002-of-00003.gguf")))


def test_a_file_that_is_no_gguf_is_named(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=r"weights\.bin is not a GGUF file"):
        estimate_model_bytes(LlamaCppConfig(str(tmp_path / "weights.bin")))
    with pytest.raises(ValueError, match=r"model file not found: .*nowhere\.gguf"):
        estimate_model_bytes(LlamaCppConfig(str(tmp_path / "nowhere.gguf")))
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match=r"cut\.gguf: cannot read its GGUF header"):
        estimate_model_bytes(LlamaCppConfig(str(tmp_path / "cut.gguf")))


def test_the_embedded_model_weighs_what_llama_cpp_logged_at_its_load(model_path: str) -> None:
    """llama.cpp's log at `cobali run` with the defaults (16 slots, --n-batch 512): KV buffer 720.00 MiB (32768
    cells x 23040 B), output buffer 3.00 MiB, compute buffer 102.51 MiB, model buffer 92.10 MiB."""
    parts = model_bytes(LlamaCppConfig(model_path))
    assert parts.kv == 720 * MiB and parts.output == 3 * MiB
    assert parts.weights == os.path.getsize(model_path)
    assert 0.95 < parts.compute / (102.51 * MiB) < 1.05
    assert 0.95 < parts.total / ((92.10 + 720 + 3 + 102.51) * MiB) < 1.05
