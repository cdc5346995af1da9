"""The seam between the host (scheduling, state) and a model backend (weights, kernels, KV layout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from llguidance import LLTokenizer

MAX_LOGPROBS = 20  # alternatives per token by default (the server's --max-logprobs), as vLLM's

# A batch row's want_logits: 0 for no output, else what the host reads of the row's output.
WANT_LOGITS = 1  # the logits (a sampler chain, logprobs, prompt logprobs)
# Only the greedy token, through Backend.argmax: a backend may pick it on its device and hand over no logits.
WANT_ARGMAX = 2


@dataclass(frozen=True, kw_only=True)
class SamplerChain:
    """What a backend's sampler chain reads of one request: how its logits are reshaped, and the draw. Built from
    the engine's SamplingParams (SamplingParams.chain), which checks the values."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias added to its logit before sampling)


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
    # Host memory one token's KV takes when a sequence is saved (estimated); 0: the backend cannot save KV.
    kv_bytes_per_token: int = 0
    # Most output rows one sequence may have in a decode (speculative decoding feeds 1 + its guesses); 0: any.
    max_outputs_per_seq: int = 0
    n_loras: int = 0  # LoRA adapters loaded with the model: indices 1..n_loras (more may come: Backend.load_lora)


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


@dataclass(frozen=True)
class BatchArrays:
    """One decode's inputs, a row per token. The engine fills a backend's own arrays in place and hands
    decode views of their first rows, so nothing is copied between the plan and llama.cpp."""

    tokens: np.ndarray  # int32
    positions: np.ndarray  # int32
    seq_ids: np.ndarray  # int32
    want_logits: np.ndarray  # int8: 0, WANT_LOGITS or WANT_ARGMAX

    @classmethod
    def zeros(cls, capacity: int) -> BatchArrays:
        return cls(*(np.zeros(capacity, dtype=t) for t in (np.int32, np.int32, np.int32, np.int8)))


class TokenSampler(Protocol):
    """Per-request sampling state (penalties history, RNG, grammar)."""

    def sample(self, row: int) -> int:
        """Sample from the logits of batch row `row` of the last decode, and remember the choice."""
        ...

    def close(self) -> None: ...


class Vocabulary(Protocol):
    """A model's text side: what tokenizing, detokenizing, prompting and compiling grammars read, and nothing
    that decodes. Every Backend is one; a frontend in a process apart from the engine's holds one of its own (for
    llama.cpp a vocabulary-only load: LlamaCppVocabulary). Thread-safe: it only reads the vocabulary."""

    @property
    def n_vocab(self) -> int: ...

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token (0: unknown): a text of more characters than the context's tokens times this
        cannot fit, and is refused before it is tokenized."""
        ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """A token's text as a reply shows it: a control token's is empty."""
        ...

    def special_token_bytes(self, token: int) -> bytes:
        """A token's text with a control token's written out (`<|im_start|>`): what a preserved token shows."""
        ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt by the model's own template matcher (no tools); ValueError if it has none."""
        ...

    def chat_template_source(self) -> TemplateSource: ...

    def guidance_tokenizer(self) -> LLTokenizer:
        """The vocabulary as llguidance reads it (cobali.structured): built once, on the first constraint. It
        may call into the vocabulary: not to be used after close()."""
        ...

    def close(self) -> None: ...


class Backend(Vocabulary, Protocol):
    info: BackendInfo

    def decode(
        self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, want_logits: np.ndarray
    ) -> np.ndarray:
        """Run one forward pass over the rows and return the logits of rows with want_logits set,
        in row order, shape (n_outputs, n_vocab). The array is only valid until the next decode, and the rows
        of WANT_ARGMAX rows may hold anything (a backend that picked their tokens on its device need not
        copy their logits). Raises DecodeError."""
        ...

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        """The most likely token of every row of `logits`, the last decode's output. At hundreds of rows the
        logits are tens of MB: a GPU backend answers from the device, which no host pass over them can match,
        at least for WANT_ARGMAX rows, whose logits rows it may never have filled."""
        ...

    def batch_arrays(self) -> BatchArrays:
        """Arrays of n_batch rows that decode reads without copying when it is given views of them."""
        ...

    def remove_seq(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Drop positions [p0, p1) of a sequence from KV (p1 = -1: to the end)."""
        ...

    def use_lora(self, index: int) -> None:
        """Decode with loaded LoRA adapter `index` from the next decode on, 0: the base model alone. An adapter
        applies to every row of a decode (llama.cpp sets adapters per context)."""
        ...

    def load_lora(self, path: str) -> int:
        """Load a LoRA adapter from a file; its index: the lowest never used before (those loaded with the model
        are 1..info.n_loras; a load that fails uses up none). ValueError naming the path when it is not an adapter
        for this model."""
        ...

    def unload_lora(self, index: int) -> None:
        """Free a loaded adapter (the base model is used from then on if it was in use)."""
        ...

    def copy_seq(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None: ...

    def save_seq(self, seq_id: int) -> np.ndarray:
        """A copy of the sequence's KV in host memory, as bytes only load_seq reads."""
        ...

    def load_seq(self, seq_id: int, data: np.ndarray) -> None:
        """Replace the sequence's KV with what save_seq saved (of any sequence). The caller makes sure the
        KV has room for all of it; RuntimeError if the backend finds none."""
        ...

    def eog_mask(self) -> np.ndarray:
        """Boolean array over the vocabulary: True for end-of-generation tokens."""
        ...

    def new_sampler(self, chain: SamplerChain) -> TokenSampler: ...

    @property
    def embedding_limits(self) -> EmbeddingLimits: ...

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled embeddings (not normalized), one row per input; each within embedding_limits. Thread-safe
        against decode (a context of its own) but not against itself."""
        ...
