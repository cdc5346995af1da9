"""llama.cpp's typed settings and its shaping constants, importable without llama.cpp itself (the simulator
sizes its KV and chunks by them)."""

from __future__ import annotations

from dataclasses import dataclass

# KV cells per sequence when no total is given (like llama-server's default context), capped at the model's
# training context.
DEFAULT_CTX_PER_SEQ = 2048

# llama.cpp's CPU flash attention takes its tiled path only for 64 or more query rows of one sequence;
# fewer go row by row, 2-3x slower at position 500 (measured here). With per-sequence KV streams the batch
# split also puts one token of every sequence into the decode rows' micro-batch, so a chunk needs 65.
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
    # Extra CPU buffer types (AMX, weight repacking) are off: the AMX matmul segfaults on this machine's
    # CPUs (seen with llama-cpp-python 0.3.36), and with them off prefill still reaches ~300 tok/s.
    use_extra_bufts: bool = False
    # Greedy rows that need only their token get it from an argmax node in llama.cpp's graph (its experimental
    # backend sampling): no logits copied out for them, no host pass over them. Off by default: experimental
    # upstream, and llama.cpp's output buffer then holds 3 more n_vocab-wide rows beside each logits row, sized
    # by the most outputs one decode had so far (~38 MB more for SmolLM2 at 64 decode rows).
    backend_sampling: bool = False
    # Output rows one sequence may have in a decode: 1 + the engine's guessed tokens (speculative decoding).
    # llama.cpp's backend sampling refuses a decode with more (its default is 1).
    max_outputs_per_seq: int = 1
    lora_paths: tuple[str, ...] = ()  # LoRA adapter GGUFs, served as adapters 1..n (Backend.use_lora)
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.max_outputs_per_seq < 1:
            raise ValueError(f"max_outputs_per_seq must be >= 1, got {self.max_outputs_per_seq}")
        if self.n_batch < self.n_seq_max:
            raise ValueError(f"--n-batch ({self.n_batch}) must be >= --max-slots ({self.n_seq_max})")

    def total_cells(self, n_ctx_train: int | None = None) -> int:
        """KV cells of the context: --ctx, else DEFAULT_CTX_PER_SEQ per sequence (one pool when unified)."""
        per_seq = min(DEFAULT_CTX_PER_SEQ, n_ctx_train or DEFAULT_CTX_PER_SEQ)
        return self.n_ctx or per_seq * (1 if self.kv_unified else self.n_seq_max)
