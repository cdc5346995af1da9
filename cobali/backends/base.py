"""The seam between the host (scheduling, state) and a model backend (weights, kernels, KV layout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cobali.engine.sampling import SamplingParams

# llama.cpp's CPU flash attention takes its tiled path only for 64 or more query rows of one sequence;
# fewer go row by row, 2-3x slower at position 500 (measured here). With per-sequence KV streams the batch
# split also puts one token of every sequence into the decode rows' micro-batch, so a chunk needs 65.
LLAMA_CPP_PREFILL_TILE = 65


class DecodeError(RuntimeError):
    """A batch could not be decoded. `no_kv_slot` is llama.cpp's return code 1: the KV cache is full."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code

    @property
    def no_kv_slot(self) -> bool:
        return self.code == 1


@dataclass(frozen=True)
class BackendInfo:
    n_vocab: int
    n_ctx: int  # total KV cells
    n_ctx_seq: int  # cells one sequence can hold
    n_seq_max: int
    n_batch: int  # most tokens one decode call may carry
    kv_unified: bool
    description: str
    # A prefill chunk shorter than this takes a slow attention path: the scheduler spends no leftover
    # budget on one.
    prefill_tile: int = 1


@dataclass(frozen=True)
class TemplateSource:
    """A model's chat template: its Jinja text (None: the model has none) and the special tokens it prints."""

    text: str | None
    bos_token: str = ""
    eos_token: str = ""
    adds_bos: bool = False  # the tokenizer puts the BOS in front by itself


@dataclass(frozen=True)
class EmbeddingLimits:
    max_tokens: int  # per input
    max_inputs_per_decode: int
    n_embd: int


class TokenSampler(Protocol):
    """Per-request sampling state (penalties history, RNG, grammar)."""

    def sample(self, row: int) -> int:
        """Sample from the logits of batch row `row` of the last decode, and remember the choice."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    info: BackendInfo

    def decode(
        self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, want_logits: np.ndarray
    ) -> np.ndarray:
        """Run one forward pass over the rows and return the logits of rows with want_logits set,
        in row order, shape (n_outputs, n_vocab). The array is only valid until the next decode.
        Raises DecodeError."""
        ...

    def remove_seq(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Drop positions [p0, p1) of a sequence from KV (p1 = -1: to the end)."""
        ...

    def copy_seq(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None: ...

    def eog_mask(self) -> np.ndarray:
        """Boolean array over the vocabulary: True for end-of-generation tokens."""
        ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt by the backend's own template matcher (no tools); ValueError if it has none."""
        ...

    def chat_template_source(self) -> TemplateSource: ...

    def new_sampler(self, params: SamplingParams) -> TokenSampler: ...

    @property
    def embedding_limits(self) -> EmbeddingLimits: ...

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled embeddings (not normalized), one row per input; each within embedding_limits. Thread-safe
        against decode (a context of its own) but not against itself."""
        ...

    def close(self) -> None: ...
