"""A GGUF model's memory before it loads, from its files' sizes and its metadata alone (the `gguf` package reads
the header; llama.cpp is not loaded): what a server of many models weighs a model by before it makes room for it.

    weights   the file's size (a split model's: all its shards'), as llama.cpp maps or copies it whole
    KV        cells x the K and V rows of every attention layer, in the cache types (as kv_size.kv_cell_bytes
              computes it once loaded; a layer with heads of its own in a per-layer head_count_kv is counted
              with its own), plus a recurrent layer's state per sequence (Mamba's conv and SSM states, RWKV's
              token shift and WKV states, LFM2's short convolution: llama.cpp's n_embd_r and n_embd_s, in f32)
    output    the logits buffer: n_vocab floats for each output a decode may have (one per sequence, more with
              speculative decoding), 4 rows per output with backend sampling (its probabilities and candidates)
    compute   llama.cpp's compute buffers: a decode's graph at its peak, for n_batch rows (see compute_bytes)

A sliding-window layer is counted at the whole context, as a plain one: an upper bound for such models (Gemma's).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp.config import LlamaCppConfig

# llama.cpp's gguf-split names its shards NAME-00001-of-00003.gguf; the first holds the metadata.
SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
GGUF_MAGIC = b"GGUF"
F32 = 4


@dataclass(frozen=True)
class GgufShape:
    """What the estimate needs of a model's metadata."""

    n_vocab: int
    n_embd: int
    n_head: int  # the most query heads of a layer
    n_ctx_train: int | None
    head_count_kv: tuple[int, ...]  # per layer; 0 for a recurrent layer
    key_length: int
    value_length: int
    recurrent_floats: int  # a recurrent layer's state per sequence (n_embd_r + n_embd_s); 0 for none
    recurrent_layers: int


@dataclass(frozen=True)
class ModelBytes:
    weights: int
    kv: int
    output: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.output + self.compute


def estimate_model_bytes(config: LlamaCppConfig) -> int:
    """The bytes the model of `config` will take once loaded with its context (see the module's doc).
    ValueError naming the file if it, or one of its shards, is missing or no GGUF."""
    return model_bytes(config).total


def model_bytes(config: LlamaCppConfig) -> ModelBytes:
    """The estimate, part by part."""
    path = config.model_path or embedded_model_path()
    weights = sum(os.path.getsize(shard) for shard in shard_paths(path))
    shape = read_shape(path)
    cells = config.total_cells(shape.n_ctx_train)
    kv = cells * sum(config.kv_row_bytes(1, n * shape.key_length, n * shape.value_length) for n in shape.head_count_kv)
    kv += config.n_seq_max * shape.recurrent_layers * shape.recurrent_floats * F32
    rows_per_output = 4 if config.backend_sampling else 1
    output = shape.n_vocab * config.n_seq_max * config.max_outputs_per_seq * rows_per_output * F32
    return ModelBytes(weights, kv, output, compute_bytes(shape, config, cells))


def compute_bytes(shape: GgufShape, config: LlamaCppConfig, cells: int) -> int:
    """llama.cpp's compute buffer, as it reserves it for a decode of n_batch rows. Its peak is the graph's output,
    a logits row for each row of the batch, with a few n_embd-wide rows beside it; without flash attention, the
    attention's scores when they are larger: each head's row over a sequence's cells, and the mask's. Measured on
    the embedded SmolLM2-135M and synth-model's tiny and 6-layer qwen2.5-0.5b shapes (--n-batch 128 to 2048, 1 to
    16 slots, up to 65536 cells, unified or not, flash attention on and off): within 4% of what llama.cpp logs
    ("CPU compute buffer size"). "auto" is counted as on, as llama.cpp makes it on a CPU and most GPUs."""
    row = shape.n_vocab + 4 * shape.n_embd
    if config.flash_attn == "off":
        row = max(row, (shape.n_head + 1) * (cells if config.kv_unified else cells // config.n_seq_max))
    return config.n_batch * row * F32


def shard_paths(path: str) -> list[str]:
    """The model's files: `path` alone, or every shard of the split whose first shard it is."""
    check_gguf(path)
    split = SPLIT_NAME.search(path)
    if split is None:
        return [path]
    if int(split[1]) != 1:
        raise ValueError(f"{path} is shard {int(split[1])} of a split model: name its first shard (-00001-of-)")
    stem, count = path[:split.start()], int(split[2])
    shards = [f"{stem}-{index:05d}-of-{split[2]}.gguf" for index in range(1, count + 1)]
    if missing := [shard for shard in shards if not os.path.isfile(shard)]:
        raise ValueError(f"{path}: split model of {count} shards, missing {', '.join(missing)}")
    return shards


def check_gguf(path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"model file not found: {path}")
    with open(path, "rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


def read_shape(path: str) -> GgufShape:
    """The shape from the header of `path` (a split model's first shard); ValueError naming it if unreadable."""
    import gguf  # numpy and the reader: only where a model is weighed

    try:
        fields = gguf.GGUFReader(path).fields
        arch = str(fields["general.architecture"].contents())

        def value(key: str, default: Any = None) -> Any:
            field = fields.get(f"{arch}.{key}")
            return default if field is None else field.contents()

        n_layer, n_embd = int(value("block_count")), int(value("embedding_length"))
        head_count = _per_layer(value("attention.head_count", 0), n_layer)
        head_count_kv = _per_layer(value("attention.head_count_kv", head_count), n_layer)
        key_length = int(value("attention.key_length", n_embd // max(1, head_count[0])))
        tokens = fields.get("tokenizer.ggml.tokens")
        n_vocab = int(value("vocab_size", len(tokens.data) if tokens is not None else 0))
        recurrent = _recurrent_floats(value, n_embd)
        n_ctx_train = value("context_length")
        return GgufShape(n_vocab=n_vocab, n_embd=n_embd, n_head=max(head_count),
                         n_ctx_train=None if n_ctx_train is None else int(n_ctx_train), head_count_kv=head_count_kv,
                         key_length=key_length, value_length=int(value("attention.value_length", key_length)),
                         recurrent_floats=recurrent,
                         # A hybrid's recurrent layers have no KV heads; Falcon-H1's every layer has both.
                         recurrent_layers=0 if not recurrent else head_count_kv.count(0) or n_layer)
    except (KeyError, ValueError, TypeError, IndexError, OSError) as err:  # a damaged or cut-short header
        raise ValueError(f"{path}: cannot read its GGUF header ({type(err).__name__}: {err})") from None


def _per_layer(raw: Any, n_layer: int) -> tuple[int, ...]:
    """A hyperparameter given once for every layer, or as an array of one a layer (OpenELM's, hybrids')."""
    values = tuple(int(v) for v in raw) if isinstance(raw, list) else (int(raw),) * n_layer
    if len(values) != n_layer:
        raise ValueError(f"a per-layer array of {len(values)} values for {n_layer} layers")
    return values


def _recurrent_floats(value: Callable[..., Any], n_embd: int) -> int:
    """A recurrent layer's state per sequence in floats, as llama.cpp's n_embd_r() + n_embd_s(); 0 for none."""
    if wkv_head_size := int(value("wkv.head_size", 0)):  # RWKV
        return int(value("token_shift_count", 2)) * n_embd + n_embd * wkv_head_size
    d_state, d_inner = int(value("ssm.state_size", 0)), int(value("ssm.inner_size", 0))
    if l_cache := int(value("shortconv.l_cache", 0)):  # LFM2
        return n_embd * (l_cache - 1) + d_state * d_inner
    d_conv, n_group = int(value("ssm.conv_kernel", 0)), int(value("ssm.group_count", 0))  # Mamba 1 and 2
    return max(0, d_conv - 1) * (d_inner + 2 * n_group * d_state) + d_state * d_inner
