"""Model-free backends: the base every stand-in shares, and a deterministic one for tests.

Logits for a row depend only on its sequence's KV contents, never on what else is in the batch, so any
correct schedule produces the same greedy tokens as sequential decoding. The KV bookkeeping is strict:
a row whose position is not the next free position of its sequence is a scheduler bug and raises.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np
from llguidance import LLTokenizer, TokenizerWrapper

from cobali.backends.base import (
    WANT_ARGMAX,
    Backend,
    BackendInfo,
    BatchArrays,
    DecodeError,
    EmbeddingLimits,
    SamplerChain,
    TemplateSource,
    TokenSampler,
)

EOG_TOKEN = 0
DEFAULT_SEED = 0
_FIRST_CHAR = 32  # token t >= 1 renders as chr(31 + t): printable ASCII


@dataclass(frozen=True)
class Batch:
    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    seq_ids: tuple[int, ...]
    want_logits: tuple[bool, ...]


class StandInBackend(Backend):
    """The base of every model-free backend (FakeBackend, the simulator's, bench/'s null and sleeping ones). It
    declares the Backend protocol, so that mypy refuses to build a stand-in lacking a member, and answers what a
    backend without a model answers alike: a member the protocol gains is added here once, for all of them. Each
    stand-in brings its own info, decode, batch_arrays, KV edits and vocabulary (tokenize, token_bytes, eog_mask)."""

    # Unknown: a prompt is refused by its tokens only, never by its length in characters.
    max_token_bytes = 0

    @property
    def n_vocab(self) -> int:
        return self.info.n_vocab

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        return logits.argmax(axis=1)

    def special_token_bytes(self, token: int) -> bytes:
        return self.token_bytes(token)  # a vocabulary without control tokens

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def chat_template_source(self) -> TemplateSource:
        return TemplateSource(None)  # the fallback above

    @property
    def embedding_limits(self) -> EmbeddingLimits:
        return EmbeddingLimits(self.info.n_ctx_seq, 4, self.info.n_vocab)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Counts of each token: texts sharing words point the same way."""
        out = np.zeros((len(inputs), self.info.n_vocab), dtype=np.float32)
        for row, tokens in enumerate(inputs):
            np.add.at(out[row], tokens, 1.0)
        return out

    # No adapters (info.n_loras = 0), no saved KV (info.kv_bytes_per_token = 0), greedy rows only: the engine asks
    # none of these of a stand-in that declares so; one that does overrides them.
    def use_lora(self, index: int) -> None:
        assert index == 0, f"{type(self).__name__} has no LoRA adapters"

    def load_lora(self, path: str) -> int:
        raise ValueError(f"could not load a LoRA adapter for this model from {path}: {type(self).__name__} takes none")

    def unload_lora(self, index: int) -> None:
        raise AssertionError(f"{type(self).__name__} has no LoRA adapter {index}")

    def save_seq(self, seq_id: int) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} saves no KV")

    def load_seq(self, seq_id: int, data: np.ndarray) -> None:
        raise NotImplementedError(f"{type(self).__name__} saves no KV")

    def new_sampler(self, spec: SamplerChain) -> TokenSampler:
        raise NotImplementedError(f"{type(self).__name__} samples greedy rows only")

    def guidance_tokenizer(self) -> LLTokenizer:
        raise NotImplementedError(f"{type(self).__name__} takes no constraints")

    def close(self) -> None:
        pass


@dataclass
class FakeBackend(StandInBackend):
    n_seq_max: int = 4
    n_ctx_seq: int = 4096
    n_batch: int = 512
    kv_unified: bool = False
    n_vocab: int = 96
    fail_on_calls: set[int] = field(default_factory=set)  # decode call indices that raise
    fail_code: int = -3  # what they raise: 1 is llama.cpp's "no KV slot", negatives are fatal errors
    prefill_tile: int = 1
    kv_bytes_per_token: int = 4
    # Pick WANT_ARGMAX rows' tokens "on the device", as llama.cpp's backend sampling does: their logits rows
    # come back as NaN, so a host that reads them (or samples them with a chain) goes wrong visibly.
    device_argmax: bool = False
    n_loras: int = 0  # "adapters": adapter i moves every greedy token by 7 * i
    # Control tokens, as a real vocabulary's `<|im_start|>`: id -> the text they render as only with special
    # rendering (their plain text is empty), which tokenize reads as one token. Ids past the characters a test
    # writes (>= 96), so that no character becomes one.
    control_tokens: dict[int, str] = field(default_factory=dict)
    batches: list[Batch] = field(default_factory=list)

    def __post_init__(self) -> None:
        n_ctx = self.n_ctx_seq if self.kv_unified else self.n_ctx_seq * self.n_seq_max
        self.info = BackendInfo(
            n_vocab=self.n_vocab, n_ctx=n_ctx, n_ctx_seq=self.n_ctx_seq, n_seq_max=self.n_seq_max,
            n_batch=self.n_batch, kv_unified=self.kv_unified, description="fake", prefill_tile=self.prefill_tile,
            kv_bytes_per_token=self.kv_bytes_per_token, n_loras=self.n_loras,
        )
        self.lora = 0
        self.loras: dict[int, str] = {i: f"adapter {i}" for i in range(1, self.n_loras + 1)}  # index -> path
        self._next_lora = self.n_loras + 1
        self.kv: dict[int, list[int]] = {s: [] for s in range(self.n_seq_max)}
        self.last_logits = np.zeros((0, self.n_vocab), dtype=np.float32)
        self._arrays = BatchArrays.zeros(self.n_batch)
        self._picked: dict[int, int] = {}  # the last decode's output rows picked on the "device": their tokens
        self.n_picked = 0  # tokens picked on the "device" so far

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        best = super().argmax(logits)
        for out_row, token in self._picked.items():
            best[out_row] = token
        return best

    def batch_arrays(self) -> BatchArrays:
        return self._arrays

    def decode(self, tokens, positions, seq_ids, want_logits) -> np.ndarray:
        call = len(self.batches)
        self.batches.append(Batch(tuple(map(int, tokens)), tuple(map(int, positions)),
                                  tuple(map(int, seq_ids)), tuple(map(bool, want_logits))))
        assert 0 < len(tokens) <= self.n_batch, f"batch of {len(tokens)} rows exceeds n_batch {self.n_batch}"
        if call in self.fail_on_calls:
            what = "no KV slot for the batch" if self.fail_code == 1 else "injected failure"
            raise DecodeError(f"{what} (decode call {call})", code=self.fail_code)
        staged = {s: list(kv) for s, kv in self.kv.items()}
        rows, picked = [], {}
        for tok, pos, seq, want in zip(tokens, positions, seq_ids, want_logits, strict=True):
            kv = staged[int(seq)]
            assert pos == len(kv), f"seq {seq}: row at pos {pos}, but KV holds {len(kv)} tokens"
            kv.append(int(tok))
            if want:
                rows.append(self._logits_after(kv))
            if want == WANT_ARGMAX and self.device_argmax:
                picked[len(rows) - 1] = int(rows[-1].argmax())
                rows[-1] = np.full(self.n_vocab, np.nan, dtype=np.float32)
        if not self._fits(staged):
            raise DecodeError("no KV slot for the batch", code=1)
        self.kv, self._picked = staged, picked
        self.n_picked += len(picked)
        self.last_logits = np.array(rows, dtype=np.float32).reshape(len(rows), self.n_vocab)
        return self.last_logits

    def _fits(self, kv: dict[int, list[int]]) -> bool:
        if self.kv_unified:
            return sum(map(len, kv.values())) <= self.info.n_ctx
        return all(len(v) <= self.n_ctx_seq for v in kv.values())

    def use_lora(self, index: int) -> None:
        assert index == 0 or index in self.loras, index
        self.lora = index

    def load_lora(self, path: str) -> int:
        """A file that does not start as a GGUF does is not an adapter."""
        if not (os.path.isfile(path) and _starts_as_gguf(path)):
            raise ValueError(f"could not load a LoRA adapter for this model from {path}")
        index, self._next_lora = self._next_lora, self._next_lora + 1
        self.loras[index] = path
        return index

    def unload_lora(self, index: int) -> None:
        del self.loras[index]
        if self.lora == index:
            self.lora = 0

    def _logits_after(self, history: list[int]) -> np.ndarray:
        target = (sum(history[-3:]) * 7 + len(history) * 13 + 7 * self.lora) % self.n_vocab
        return -0.5 * np.abs(np.arange(self.n_vocab, dtype=np.float32) - target)

    def remove_seq(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        kv = self.kv[seq_id]
        assert p1 == -1 or p1 >= len(kv), "the fake backend only truncates sequence tails"
        del kv[p0:]

    def copy_seq(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        assert p0 == 0 and not self.kv[dst], "the fake backend copies a prefix into an empty sequence"
        self.kv[dst] = list(self.kv[src][: None if p1 == -1 else p1])

    def save_seq(self, seq_id: int) -> np.ndarray:
        return np.array(self.kv[seq_id], dtype=np.int32)

    def load_seq(self, seq_id: int, data: np.ndarray) -> None:
        staged = {**self.kv, seq_id: data.tolist()}
        if not self._fits(staged):
            raise RuntimeError(f"no room in KV for {len(data)} saved tokens")
        self.kv = staged

    def eog_mask(self) -> np.ndarray:
        mask = np.zeros(self.n_vocab, dtype=bool)
        mask[EOG_TOKEN] = True
        return mask

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        if not self.control_tokens:
            return self._char_tokens(text)
        by_text = {tag: token for token, tag in self.control_tokens.items()}
        pieces = re.split("(" + "|".join(map(re.escape, sorted(by_text, key=len, reverse=True))) + ")", text)
        # re.split puts the tags it split at in the odd places
        return [t for i, piece in enumerate(pieces) for t in ([by_text[piece]] if i % 2 else self._char_tokens(piece))]

    def _char_tokens(self, text: str) -> list[int]:
        return [max(1, min(ord(c) - _FIRST_CHAR + 1, self.n_vocab - 1)) for c in text]

    def token_bytes(self, token: int) -> bytes:
        if token == EOG_TOKEN or token in self.control_tokens:
            return b""
        return chr(_FIRST_CHAR - 1 + token).encode()

    def special_token_bytes(self, token: int) -> bytes:
        control = self.control_tokens.get(token)
        return control.encode() if control is not None else self.token_bytes(token)

    def new_sampler(self, spec: SamplerChain) -> FakeSampler:
        return FakeSampler(self, spec)

    def guidance_tokenizer(self) -> LLTokenizer:
        return LLTokenizer(TokenizerWrapper(_FakeVocabulary(self)), slices=[])

    def close(self) -> None:
        self.kv.clear()


class FakeSampler:
    """Temperature / top-k / top-p / penalties in numpy over the fake's last logits."""

    def __init__(self, backend: FakeBackend, spec: SamplerChain) -> None:
        self.backend = backend
        self.spec = spec
        # Unseeded requests draw from a fixed seed too: a test run reproduces itself exactly.
        self.rng = np.random.default_rng(DEFAULT_SEED if spec.seed is None else spec.seed)
        self.counts = np.zeros(backend.n_vocab, dtype=np.float32)

    def sample(self, row: int) -> int:
        p = self.spec
        out_row = sum(self.backend.batches[-1].want_logits[:row])
        logits = self.backend.last_logits[out_row].copy()
        for token, bias in p.logit_bias:
            logits[token] += bias
        seen = self.counts > 0
        with np.errstate(all="ignore"):
            logits[seen] = np.where(logits[seen] > 0, logits[seen] / p.repetition_penalty,
                                    logits[seen] * p.repetition_penalty)
        logits -= p.frequency_penalty * self.counts + p.presence_penalty * seen
        token = int(np.argmax(logits)) if p.temperature == 0 or p.top_k == 1 else self._draw(logits / p.temperature)
        self.counts[token] += 1
        return token

    def _draw(self, logits: np.ndarray) -> int:
        p = self.spec
        order = np.argsort(-logits)
        if p.top_k:
            order = order[: p.top_k]
        with np.errstate(all="ignore"):  # extreme temperatures and penalties give inf/nan: drawn as 0
            probs = np.nan_to_num(np.exp(logits[order] - logits[order[0]]))
        total = probs.sum()
        if not np.isfinite(total) or total <= 0:
            return int(order[0])
        probs /= total
        keep = np.cumsum(probs) - probs < p.top_p
        keep &= probs >= p.min_p * probs[0]
        keep[0] = True  # the most likely token always survives the filters
        probs = probs[keep] / probs[keep].sum()
        return int(self.rng.choice(order[keep], p=probs))

    def close(self) -> None:
        self.counts[:] = 0


class _FakeVocabulary:
    """The fake's vocabulary as llguidance's TokenizerWrapper reads a tokenizer: the end token is special."""

    def __init__(self, backend: FakeBackend) -> None:
        self.eos_token_id, self.bos_token_id = EOG_TOKEN, None
        self.special_token_ids = [EOG_TOKEN, *backend.control_tokens]
        # llguidance's form of a special token: 0xff, then its text
        self.tokens = [b"\xff<eos>"] + [b"\xff" + backend.special_token_bytes(t) if t in backend.control_tokens
                                        else backend.token_bytes(t) for t in range(1, backend.n_vocab)]
        self._backend = backend

    def __call__(self, text: bytes) -> list[int]:
        return self._backend.tokenize(text.decode("utf-8", errors="replace"))


def _starts_as_gguf(path: str) -> bool:
    with open(path, "rb") as file:
        return file.read(4) == b"GGUF"
