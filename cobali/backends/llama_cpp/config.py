"""llama.cpp's typed settings and its shaping constants, importable without llama.cpp itself (the simulator
sizes its KV and chunks by them)."""

from __future__ import annotations

from dataclasses import dataclass

# KV cells per sequence when no total is given, capped at the model's training context: 16 slots of 2048 are a
# known, modest KV budget for any model (docs/configuration.md: "Context and memory"); --fit, --ctx and
# --kv-unified give more.
DEFAULT_CTX_PER_SEQ = 2048

# KV cache types as llama-server spells them (--cache-type-k/-v): bytes per block and values per block (ggml's).
KV_CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (4, 1), "f16": (2, 1), "bf16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32), "q4_1": (20, 32),
    "iq4_nl": (18, 32), "q5_0": (22, 32), "q5_1": (24, 32),
}
FLASH_ATTN_MODES = ("auto", "on", "off")

# llama.cpp's CPU flash attention takes its tiled path only for 64 or more query rows of one sequence;
# fewer go row by row, far slower (docs/results.md, "Prefill chunks of ≥ 65 tokens"). With per-sequence KV
# streams the batch split also puts one token of every sequence into the decode rows' micro-batch, so a chunk
# needs 65.
PREFILL_TILE = 65


@dataclass(frozen=True)
class LlamaCppConfig:
    model_path: str | None = None  # GGUF file; None: the embedded SmolLM2-135M
    n_ctx: int = 0  # total KV cells; 0 = DEFAULT_CTX_PER_SEQ per slot, capped at the model's training context
    n_seq_max: int = 16
    n_batch: int = 512
    n_threads: int = 0  # 0 = all cores
    kv_unified: bool = False
    n_gpu_layers: int = -1  # -1 = all layers when the build can offload, else 0
    # Weights repacked for the CPU's tiled matmul (llama.cpp's extra buffer types, llama-server's --repack):
    # True/False as asked; None: on where no AMX is present (repack.py: its matmul segfaulted on Sapphire Rapids).
    repack: bool | None = None
    # Greedy rows that need only their token get it from an argmax node in llama.cpp's graph (its experimental
    # backend sampling): no logits copied out for them, no host pass over them. Off by default: experimental
    # upstream, and llama.cpp's output buffer then holds 3 more n_vocab-wide rows beside each logits row, sized
    # by the most outputs one decode had so far (what that costs: docs/results.md, "Host path").
    backend_sampling: bool = False
    # Output rows one sequence may have in a decode: 1 + the engine's guessed tokens (speculative decoding).
    # llama.cpp's backend sampling refuses a decode with more (its default is 1).
    max_outputs_per_seq: int = 1
    lora_paths: tuple[str, ...] = ()  # LoRA adapter GGUFs, served as adapters 1..n (Backend.use_lora)
    verbose: bool = False  # let llama.cpp's own log lines through to stderr
    cache_type_k: str = "f16"  # KV cache types (KV_CACHE_TYPES); quantized ones trade a little fidelity for memory
    cache_type_v: str = "f16"
    flash_attn: str = "auto"  # auto: llama.cpp decides per device, and turns it on for a quantized V cache
    # Count what llama.cpp does in each decode with its own hooks (counters.py): passes, graph reuses, logits
    # rows copied. For tests and benchmarks: the hooks add host work to every decode.
    count_decodes: bool = False
    # Size the context to the memory there is: the cells --ctx asks for (or, without it, the model's training
    # context for every slot), cut down to what free memory holds beside the weights (cobali/backends/memory.py).
    fit: bool = False

    def __post_init__(self) -> None:
        if self.max_outputs_per_seq < 1:
            raise ValueError(f"max_outputs_per_seq must be >= 1, got {self.max_outputs_per_seq}")
        if self.n_batch < self.n_seq_max:
            raise ValueError(f"--n-batch ({self.n_batch}) must be >= --max-slots ({self.n_seq_max})")
        for flag, name in (("--cache-type-k", self.cache_type_k), ("--cache-type-v", self.cache_type_v)):
            if name not in KV_CACHE_TYPES:
                raise ValueError(f"{flag}: unknown cache type {name!r} (one of {', '.join(KV_CACHE_TYPES)})")
        if self.flash_attn not in FLASH_ATTN_MODES:
            raise ValueError(f"--flash-attn: expected one of {', '.join(FLASH_ATTN_MODES)}, got {self.flash_attn!r}")
        if self.flash_attn == "off" and KV_CACHE_TYPES[self.cache_type_v][1] > 1:
            # llama.cpp stores a quantized V cache only for flash attention (it refuses the context otherwise).
            raise ValueError(f"--cache-type-v {self.cache_type_v} needs flash attention: use --flash-attn on or auto "
                             "(auto turns it on), or an unquantized V cache (f16)")

    def total_cells(self, n_ctx_train: int | None = None) -> int:
        """KV cells of the context: --ctx, else DEFAULT_CTX_PER_SEQ per sequence. A unified KV gets as many cells
        as the streams would, in one pool any sequence may fill: the same memory, and long requests fit."""
        per_seq = min(DEFAULT_CTX_PER_SEQ, n_ctx_train or DEFAULT_CTX_PER_SEQ)
        return self.n_ctx or per_seq * self.n_seq_max

    def kv_row_bytes(self, n_layer: int, k_width: int, v_width: int) -> int:
        """Bytes one KV cell takes over n_layer layers whose K and V rows hold k_width and v_width values."""
        return n_layer * (row_bytes(self.cache_type_k, k_width) + row_bytes(self.cache_type_v, v_width))


def row_bytes(cache_type: str, width: int) -> int:
    """Bytes of one row of `width` values in a cache type (ggml's block layout)."""
    block_bytes, block_size = KV_CACHE_TYPES[cache_type]
    return -(-width // block_size) * block_bytes
