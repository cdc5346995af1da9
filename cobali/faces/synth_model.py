"""`cobali synth-model`: a GGUF with random weights of a real architecture's exact shapes.

Like vLLM's `--load-format dummy`: the speed of a model at any scale can be measured without its weights.
The text such a model writes is noise; its speed is real, as long as benchmarks set ignore_eos (random
logits pick an end token early, at random). The tokenizer is the embedded SmolLM2's, padded with unused
tokens to the target vocabulary, so that the embedding lookup and the output projection cost what they
cost in the real model. Weights are drawn with std 1/sqrt(fan_in), and the projections writing into the
residual stream are scaled down by 1/sqrt(2 * layers), so activations stay O(1) at any depth.
The file is written as F16 with the `gguf` package, then quantised by llama.cpp's own llama_model_quantize.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from cobali.config.flags import positive_int

F16 = "F16"
# llama.cpp file types that need no importance matrix (llama_ftype in llama.h, without LLAMA_FTYPE_MOSTLY_).
QUANT_TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_0", "Q3_K_M", "Q2_K")


@dataclass(frozen=True)
class ModelShape:
    arch: str  # a llama.cpp architecture: "llama" or "qwen2" (q/k/v biases)
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    tied_embeddings: bool
    context_length: int = 32768
    rope_theta: float = 1e6
    head_size: int | None = None  # attention head size, where it is not n_embd / n_head (llama only, as Qwen3's)

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"architecture {self.arch!r}: expected llama or qwen2")
        if min(self.n_layer, self.n_embd, self.n_head, self.n_head_kv, self.n_ff, self.n_vocab) < 1:
            raise ValueError(f"every dimension must be >= 1: {self}")
        if self.head_size is not None and (self.arch != "llama" or self.head_size < 2 or self.head_size % 2):
            raise ValueError(f"head size {self.head_size}: must be even, on the llama architecture (qwen2 reads none)")
        if (self.head_size is None and self.n_embd % self.n_head) or self.n_head % self.n_head_kv:
            raise ValueError(f"hidden size {self.n_embd} must split into {self.n_head} heads, "
                             f"and {self.n_head} heads into {self.n_head_kv} KV heads")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def n_params(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in tensor_shapes(self))


# Shapes from the models' published config.json files.
SHAPES = {
    "qwen2.5-0.5b": ModelShape("qwen2", 24, 896, 14, 2, 4864, 151936, tied_embeddings=True),
    "qwen2.5-7b": ModelShape("qwen2", 28, 3584, 28, 4, 18944, 152064, tied_embeddings=False),
    "llama-3.2-1b": ModelShape("llama", 16, 2048, 32, 8, 8192, 128256, tied_embeddings=True,
                               context_length=131072, rope_theta=5e5),
    "llama-3.1-8b": ModelShape("llama", 32, 4096, 32, 8, 14336, 128256, tied_embeddings=False,
                               context_length=131072, rope_theta=5e5),
    # For tests: the smallest shape whose rows K-quants can still quantise (256-wide blocks).
    "tiny": ModelShape("llama", 2, 256, 4, 2, 512, 49152, tied_embeddings=True, context_length=4096),
}


def _name(tensor: gguf.MODEL_TENSOR, bid: int | None = None, suffix: str = "weight") -> str:
    return f"{gguf.TENSOR_NAMES[tensor].format(bid=bid)}.{suffix}"


def tensor_shapes(shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and numpy shape (rows = outputs), in file order."""
    t = gguf.MODEL_TENSOR
    d, q, kv = shape.n_embd, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    yield _name(t.TOKEN_EMBD), (shape.n_vocab, d)
    for i in range(shape.n_layer):
        yield _name(t.ATTN_NORM, i), (d,)
        yield _name(t.ATTN_Q, i), (q, d)
        yield _name(t.ATTN_K, i), (kv, d)
        yield _name(t.ATTN_V, i), (kv, d)
        if shape.arch == "qwen2":
            yield from ((_name(n, i, "bias"), (size,)) for n, size in ((t.ATTN_Q, d), (t.ATTN_K, kv), (t.ATTN_V, kv)))
        yield _name(t.ATTN_OUT, i), (d, q)
        yield _name(t.FFN_NORM, i), (d,)
        yield _name(t.FFN_GATE, i), (shape.n_ff, d)
        yield _name(t.FFN_UP, i), (shape.n_ff, d)
        yield _name(t.FFN_DOWN, i), (d, shape.n_ff)
    yield _name(t.OUTPUT_NORM), (d,)
    if not shape.tied_embeddings:
        yield _name(t.OUTPUT), (shape.n_vocab, d)


class WeightSource:
    """Random weight values: a pool of unit-variance values drawn once, read from random offsets. An 8B
    model needs 8 G values, whose drawing alone would outlast the rest of the write; only their scale matters."""

    def __init__(self, seed: int = 0, pool_size: int = 1 << 22) -> None:
        self.rng = np.random.default_rng(seed)
        half = self.rng.uniform(-np.sqrt(3.0), np.sqrt(3.0), pool_size).astype(np.float32)
        self.pool = np.concatenate([half, half])  # a slice from any offset up to pool_size wraps around
        self.pool_size = pool_size

    def tensor(self, name: str, dims: tuple[int, ...], n_layer: int) -> np.ndarray:
        if len(dims) == 1:  # norms multiply by 1, biases add 0: F32, as llama.cpp keeps them
            return np.full(dims, 1.0 if name.endswith("norm.weight") else 0.0, dtype=np.float32)
        std = 1.0 / np.sqrt(dims[1])
        if ".attn_output." in name or ".ffn_down." in name:  # writes into the residual stream
            std /= np.sqrt(2 * n_layer)
        out = np.empty(dims, dtype=np.float16)
        flat = out.reshape(-1)
        for start in range(0, flat.size, self.pool_size):
            n = min(self.pool_size, flat.size - start)
            offset = int(self.rng.integers(self.pool_size))
            np.multiply(self.pool[offset:offset + n], std, out=flat[start:start + n], casting="unsafe")
        return out


def _add_tokenizer(writer: gguf.GGUFWriter, source: str, n_vocab: int | None = None) -> None:
    """Copy the source model's tokenizer, padded with never-produced tokens up to n_vocab."""
    reader = gguf.GGUFReader(source)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"{source} holds no tokenizer")
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    n_vocab = n_vocab or len(tokens)
    if n_vocab < len(tokens):
        raise ValueError(f"vocabulary {n_vocab} is smaller than the embedded tokenizer's {len(tokens)}")
    pad = n_vocab - len(tokens)
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens + [f"<|synth_unused_{i}|>" for i in range(pad)])
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    writer.add_unk_token_id(field("tokenizer.ggml.unknown_token_id"))
    writer.add_pad_token_id(field("tokenizer.ggml.padding_token_id"))
    writer.add_add_bos_token(field("tokenizer.ggml.add_bos_token"))
    writer.add_add_space_prefix(field("tokenizer.ggml.add_space_prefix"))
    writer.add_chat_template(field("tokenizer.chat_template"))


def write_tokenizer(source: str, path: str) -> None:
    """A GGUF holding only `source`'s tokenizer: what synth-model needs of the embedded model, in a small
    fraction of its file (the GPU kit carries it)."""
    writer = gguf.GGUFWriter(path, "llama")
    _add_tokenizer(writer, source)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def write_f16(shape: ModelShape, path: str, tokenizer_source: str, seed: int = 0) -> None:
    """Write the model as F16 GGUF, one tensor at a time (an 8B model never sits in memory whole)."""
    writer = gguf.GGUFWriter(path, shape.arch)
    writer.add_name(f"cobali synth {shape.arch} {shape.n_params / 1e9:.2f}B (random weights)")
    writer.add_block_count(shape.n_layer)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.head_size is not None:  # llama.cpp's n_embd_head_k and n_embd_head_v
        writer.add_key_length(shape.head_size)
        writer.add_value_length(shape.head_size)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(shape.n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _add_tokenizer(writer, tokenizer_source, shape.n_vocab)
    layout = list(tensor_shapes(shape))
    for name, dims in layout:
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    source = WeightSource(seed)
    for name, dims in layout:
        writer.write_tensor_data(source.tensor(name, dims, shape.n_layer))
    writer.close()


def synth_model(shape: ModelShape, quant: str, out: str, tokenizer_source: str, seed: int = 0,
                n_threads: int = 0) -> Path:
    """Write `out`: F16 straight from numpy, any other type through llama.cpp's quantizer."""
    from cobali.backends.llama_cpp import quantize_model

    quant = quant.upper()
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if quant == F16:
        write_f16(shape, out, tokenizer_source, seed)
        return out_path
    staging = out_path.with_name(out_path.name + ".f16.tmp")
    try:
        write_f16(shape, str(staging), tokenizer_source, seed)
        quantize_model(str(staging), out, quant, n_threads)
    finally:
        staging.unlink(missing_ok=True)
    return out_path


@dataclass(frozen=True)
class DecodeCheck:
    description: str
    n_vocab: int
    n_tokens: int
    non_finite: int  # steps whose logits held a NaN or an inf
    min_std: float  # the smallest spread of one step's logits: 0 would mean the weights never reach them
    tok_s: float


def check_decode(path: str, n_tokens: int, n_threads: int = 0) -> DecodeCheck:
    """Greedy-decode n_tokens one at a time after a short prompt, watching every step's logits."""
    from cobali.backends.llama_cpp import LlamaCppBackend
    from cobali.backends.llama_cpp.config import LlamaCppConfig

    backend = LlamaCppBackend(LlamaCppConfig(path, n_ctx=n_tokens + 64, n_seq_max=1, n_batch=64, n_threads=n_threads))
    try:
        tokens = np.array(backend.tokenize("The capital of France is"), np.int32)
        n = len(tokens)
        last_row = np.eye(1, n, n - 1, dtype=np.int8)[0]
        logits = backend.decode(tokens, np.arange(n, dtype=np.int32), np.zeros(n, np.int32), last_row)
        non_finite, spreads, start = 0, [], time.perf_counter()
        for pos in range(n, n + n_tokens):
            row = logits[-1]
            non_finite += int(not np.isfinite(row).all())
            spreads.append(float(row.std()))
            logits = backend.decode(np.array([np.argmax(row)], np.int32), np.array([pos], np.int32),
                                    np.zeros(1, np.int32), np.ones(1, np.int8))
        return DecodeCheck(backend.info.description, backend.info.n_vocab, n_tokens, non_finite, min(spreads),
                           n_tokens / (time.perf_counter() - start))
    finally:
        backend.close()


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    dims = {k: getattr(args, k) for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab")}
    if args.like is None:
        missing = [f"--{k.replace('_', '-')}" for k, v in dims.items() if v is None]
        if missing:
            raise ValueError(f"without --like, give every dimension (missing {', '.join(missing)})")
        return ModelShape(args.arch or "llama", **dims, tied_embeddings=args.tied, head_size=args.head_dim)
    base = SHAPES[args.like]
    overrides = {k: v for k, v in dict(dims, head_size=args.head_dim).items() if v is not None}
    if args.arch:
        overrides["arch"] = args.arch
    return replace(base, **overrides)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("synth-model", help="write a GGUF of random weights in a real model's shapes")
    parser.add_argument("--like", choices=sorted(SHAPES), default=None, help="a named architecture's shapes")
    parser.add_argument("--quant", default="Q5_K_M", type=str.upper, choices=QUANT_TYPES,
                        metavar="TYPE", help=f"weight type ({', '.join(QUANT_TYPES)}); default Q5_K_M")
    parser.add_argument("--out", required=True, help="GGUF file to write")
    parser.add_argument("--arch", choices=("llama", "qwen2"), default=None)
    for flags, what in (
            (["--n-layer"], "layers"), (["--n-embd"], "hidden size"), (["--n-head"], "attention heads"),
            (["--n-head-kv"], "KV heads"), (["--n-ff"], "FFN size"),
            (["--n-vocab", "--vocab-size"], "vocabulary, >= the tokenizer's: it is padded with unused tokens to it, "
             "so the embeddings, the output projection and the logits cost what a real model's do (--like's real "
             "size by default: 151936 for qwen2.5-0.5b)"),
            (["--head-dim"], "attention head size, if not hidden size / heads (llama only; Qwen3's: 128)")):
        parser.add_argument(*flags, type=positive_int, default=None, help=f"{what} (overrides --like)")
    parser.add_argument("--tied", action="store_true", help="without --like: output projection = embeddings")
    parser.add_argument("--tokenizer", default=None,
                        help="GGUF whose tokenizer is copied (default: the embedded SmolLM2 model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="quantizer and --check threads (0 = all cores)")
    parser.add_argument("--check", type=positive_int, default=None, metavar="N",
                        help="then greedy-decode N tokens and fail unless every step's logits are finite")
    parser.set_defaults(func=synth_command)


def synth_command(args: argparse.Namespace) -> int:
    from cobali.backends.embedded_model import embedded_model_path

    shape = shape_from_args(args)
    start = time.perf_counter()
    tokenizer = args.tokenizer or embedded_model_path()
    if not os.path.isfile(tokenizer):
        raise ValueError(f"--tokenizer {tokenizer}: no such file")
    path = synth_model(shape, args.quant, args.out, tokenizer, args.seed, args.threads)
    size = os.path.getsize(path)
    print(f"wrote {path}: {shape.arch}, {shape.n_params / 1e9:.3f} B params, {args.quant}, "
          f"{size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s")
    if args.check:
        check = check_decode(str(path), args.check, args.threads)
        print(f"check: {check.description}: {check.n_tokens} greedy tokens at {check.tok_s:.2f} tok/s, "
              f"{check.non_finite} with non-finite logits, smallest logit std {check.min_std:.3f}")
        return 1 if check.non_finite or check.min_std == 0 else 0
    return 0
