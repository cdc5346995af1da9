"""The seam between the host (scheduling, state) and a model backend (weights, kernels, KV layout)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from llguidance import LLTokenizer

MAX_LOGPROBS = 20  # alternatives per token by default (the server's --max-logprobs), as vLLM's

# A batch row's want_logits: 0 for no output, else what the host reads of the row's output.
WANT_LOGITS = 1  # the logits (a sampler chain, logprobs, prompt logprobs)
# Only the greedy token, through Backend.argmax: a backend may pick it on its device and hand over no logits.
WANT_ARGMAX = 2


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping. Validated on construction: bad values raise ValueError."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None  # an llguidance grammar (cobali.structured.grammars): the output must follow it
    logprobs: int | None = None  # report each sampled token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # also each prompt token's logprob (after the first), with alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias added to its logit before sampling)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output as an end-of-generation token does
    min_tokens: int = 0  # until this many are out, end tokens and stop_token_ids are never sampled, stop strings unseen
    include_stop_str: bool = False  # the stop string that ended the output ends its text too
    # vLLM's: cached prompt KV is shared only among requests with the same salt (None: among unsalted ones), so one
    # tenant cannot learn another's prompts from its cache hits. The engine's prefix cache reads it, no sampler.
    cache_salt: str | None = None
    # Control tokens whose text the output keeps (llama-server's preserved tokens): the tags a reply parser reads,
    # which llama.cpp renders as no text. Made by the server from its parsers, never from a request: its size is
    # the parsers' tags, not the client's.
    preserved_tokens: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _check(math.isfinite(getattr(self, name)), f"{name} must be a finite number")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(self.seed is None or self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        # The server holds k to its --max-logprobs; the engine needs only a count.
        _check(self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0,
               f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        _check(all(math.isfinite(bias) for _, bias in self.logit_bias), "logit_bias values must be finite")
        _check(0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids (>= 0)")
        _check(isinstance(self.preserved_tokens, frozenset) and all(t >= 0 for t in self.preserved_tokens),
               "preserved_tokens must be a frozenset of token ids (>= 0)")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
               "cache_salt must be a non-empty string")
        # A finished grammar allows nothing but an end token: banning it would leave no token to sample.
        _check(not (self.min_tokens and self.grammar), "min_tokens cannot be combined with a grammar "
               "(response_format json_object or json_schema, or a forced tool call)")
        # Past the grammar's end only an end token is allowed: an output that may not end has nowhere to go.
        _check(not (self.ignore_eos and self.grammar), "ignore_eos cannot be combined with a grammar "
               "(response_format json_object or json_schema, structured outputs, or a forced tool call)")

    @cached_property  # read for every sampled token
    def is_greedy(self) -> bool:
        """Greedy rows are sampled by one vectorized argmax; anything that reshapes logits needs a chain."""
        return self.picks_the_likeliest and self.grammar is None

    @cached_property
    def picks_the_likeliest(self) -> bool:
        """The token is the argmax of the row as the host holds it (a constrained row: once masked)."""
        return (
            (self.temperature == 0 or self.top_k == 1)
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and not self.logit_bias
        )

    @cached_property
    def needs_only_argmax(self) -> bool:
        """A generated token's logits are read for nothing but their argmax (no logprobs to report), so the
        backend may pick it without handing the logits over. Prompt logprobs read only prefill rows."""
        return self.is_greedy and self.logprobs is None and self.min_tokens == 0  # a ban is applied on the host


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


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
    # Bytes of the vocabulary's longest token (0: unknown): a text of more characters than the context's tokens
    # times this cannot fit, and is refused before it is tokenized.
    max_token_bytes: int = 0


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


class Backend(Protocol):
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

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """A token's text as a reply shows it: a control token's is empty."""
        ...

    def special_token_bytes(self, token: int) -> bytes:
        """A token's text with a control token's written out (`<|im_start|>`): what a preserved token shows."""
        ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt by the backend's own template matcher (no tools); ValueError if it has none."""
        ...

    def chat_template_source(self) -> TemplateSource: ...

    def new_sampler(self, params: SamplingParams) -> TokenSampler: ...

    def guidance_tokenizer(self) -> LLTokenizer:
        """The vocabulary as llguidance reads it (cobali.structured): built once, on the first constraint."""
        ...

    @property
    def embedding_limits(self) -> EmbeddingLimits: ...

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled embeddings (not normalized), one row per input; each within embedding_limits. Thread-safe
        against decode (a context of its own) but not against itself."""
        ...

    def close(self) -> None: ...
