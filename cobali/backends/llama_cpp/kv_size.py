"""What one token's KV costs in a loaded model, read from its shapes and its GGUF metadata."""

from __future__ import annotations

import ctypes

import llama_cpp as ll

from cobali.backends.llama_cpp.config import LlamaCppConfig

# What llama.cpp's state format writes per cell beside its K and V rows: its position and one sequence id.
STATE_CELL_HEADER = 12


def meta_str(model, key: str) -> str | None:
    """A GGUF metadata value as llama.cpp prints it, or None where the model has no such key."""
    buf = ctypes.create_string_buffer(128)
    n = ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        n = ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.raw[:n].decode(errors="replace")


def head_sizes(model) -> tuple[int, int]:
    """The attention heads' K and V sizes: `{arch}.attention.key_length` / `value_length` where the model gives
    them (Qwen3-0.6B: 128, where n_embd / n_head would say 64), else n_embd / n_head, as llama.cpp defaults."""
    default = ll.llama_model_n_embd(model) // max(1, ll.llama_model_n_head(model))
    arch = meta_str(model, "general.architecture")
    if arch is None:
        return default, default
    k = meta_str(model, f"{arch}.attention.key_length")
    v = meta_str(model, f"{arch}.attention.value_length")
    k_size = int(k) if k else default
    return k_size, int(v) if v else k_size  # llama.cpp's value length defaults to the key length


def kv_cell_bytes(model, options: LlamaCppConfig) -> int:
    """One KV cell's K and V rows over every layer, in the context's cache types (f16: 23040 bytes for
    SmolLM2-135M, as llama.cpp's KV buffer size says)."""
    k_size, v_size = head_sizes(model)
    n_head_kv = ll.llama_model_n_head_kv(model)
    return options.kv_row_bytes(ll.llama_model_n_layer(model), n_head_kv * k_size, n_head_kv * v_size)


def kv_bytes_per_token(model, options: LlamaCppConfig) -> int:
    """What one token of a sequence takes when it is saved: its cell's rows, position and sequence id (SmolLM2-135M
    in f16: 23052 bytes, as llama_state_seq_get_size reports)."""
    return kv_cell_bytes(model, options) + STATE_CELL_HEADER
