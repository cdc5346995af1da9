"""A request's life: one state machine, its transitions, and the data it carries."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from cobali.engine.detok import TextStream
from cobali.engine.sampling import TokenLogprob
from cobali.engine.sampling_params import SamplingParams


class RequestState(enum.Enum):
    PENDING = "pending"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        return self in (RequestState.DONE, RequestState.FAILED)


# The only legal moves. PREFILL/DECODE -> PENDING is preemption: KV dropped, tokens kept.
_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.PENDING: frozenset({RequestState.PREFILL, RequestState.FAILED, RequestState.DONE}),
    RequestState.PREFILL: frozenset(
        {RequestState.PREFILL, RequestState.DECODE, RequestState.PENDING, RequestState.DONE, RequestState.FAILED}
    ),
    # DECODE -> PREFILL: the decode that sampled its first token failed, and that prompt chunk runs again.
    RequestState.DECODE: frozenset({RequestState.PENDING, RequestState.PREFILL, RequestState.DONE,
                                    RequestState.FAILED}),
    RequestState.DONE: frozenset(),
    RequestState.FAILED: frozenset(),
}


# Stands in for a token that a planned or running decode samples: the scheduler counts it when it plans the row
# that samples it, so the next tick can be planned before the token is known (async scheduling, engine/overlap.py).
PENDING_TOKEN = -1
# Above any vocabulary: adapter a keys token t as -(a * stride + t + 1) (Request.kv_key), within the 32 bits a
# key gives a token for adapter indices up to MAX_ADAPTER_INDEX (8191; an engine refuses to load one more).
ADAPTER_KEY_STRIDE = 1 << 18
MAX_ADAPTER_INDEX = (1 << 31) // ADAPTER_KEY_STRIDE - 1
# A cache_salt's mark, in the first SALT_KEYS keys of its requests (Request.kv_key): any reuse spans at least
# min_reuse_tokens >= SALT_KEYS keys, so two salts would share KV only if their digests' 240 bits collided.
SALT_KEYS = 8


@lru_cache(maxsize=4096)  # a tenant's salt comes back with each of its requests, and is keyed several times each
def salt_marks(salt: str) -> tuple[int, ...]:
    """SALT_KEYS tags of 30 random bits each, nonzero, above a key's 32 token bits: a salted key is >= 2**32,
    where an unsalted one (a token id, or an adapter's negative key) never is."""
    digest = hashlib.blake2b(salt.encode(), digest_size=4 * SALT_KEYS).digest()
    words = (int.from_bytes(digest[i : i + 4], "big") for i in range(0, len(digest), 4))
    return tuple(((word >> 1) | 1) << 32 for word in words)


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)  # identity: found in lists of hundreds, where comparing every field made each search slow
class Request:
    """Everything about one request the engine holds, its output text included: finishing it releases this."""

    id: int
    prompt_tokens: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    priority: int = 0
    lora: int = 0  # the LoRA adapter it runs with (1..BackendInfo.n_loras); 0: the base model
    stream_interval: int | None = None  # its text is handed out every this many tokens; None: only at the end
    state: RequestState = RequestState.PENDING
    # Sampled tokens, then n_pending stand-ins (PENDING_TOKEN) for those planned decodes are sampling.
    output_tokens: list[int] = field(default_factory=list)
    n_pending: int = 0
    computed_tokens: int = 0  # tokens of prompt+output in KV once the planned rows ran: the next row's position
    cached_tokens: int = 0  # prompt tokens its slot got from a cached or running prefix at its (last) admission
    slot: int | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # what ended a STOP other than an end token: a stop string or stop token id
    error: str | None = None
    own_fault: bool = False  # its own input made it fail (a ValueError: a grammar that allows no token), not the engine
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    # One per prompt token after the first (which nothing predicts), when params.prompt_logprobs is set.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_time: float | None = None
    preemptions: int = 0
    n_reported: int = 0  # output tokens already handed out in an output
    stream: TextStream = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.stream = TextStream(p.stop, self.stream_interval or 1, p.min_tokens, p.include_stop_str)

    @property
    def text(self) -> str:
        return self.stream.text

    def transition(self, new: RequestState) -> None:
        assert new in _TRANSITIONS[self.state], f"request {self.id}: illegal {self.state} -> {new}"
        self.state = new

    def advance(self, n_tokens: int, samples: bool) -> None:
        """n_tokens more are planned into KV; samples: the row after them samples its next token, counted now
        as a stand-in (the first output token ends the prefill)."""
        self.computed_tokens += n_tokens
        if samples:
            if self.state is RequestState.PREFILL:
                self.transition(RequestState.DECODE)
            self.output_tokens.append(PENDING_TOKEN)
            self.n_pending += 1

    def add_token(self, token: int) -> int:
        """A sampled token into the outputs, over its oldest stand-in (a guessed token, kept, has none).
        Returns the outputs up to and including it."""
        outputs = self.output_tokens
        if not self.n_pending:
            outputs.append(token)
            return len(outputs)
        at = len(outputs) - self.n_pending
        outputs[at] = token
        self.n_pending -= 1
        return at + 1

    def undo(self, start: int, samples: bool, prefill: bool) -> None:
        """A planned chunk that never ran (its decode failed): back to `start` in KV, its stand-in dropped and,
        for a prompt chunk that sampled, back in prefill."""
        self.computed_tokens = start
        if samples:
            self.output_tokens.pop()
            self.n_pending -= 1
            if prefill and self.state is RequestState.DECODE:
                self.transition(RequestState.PREFILL)

    @property
    def n_sampled(self) -> int:
        """Outputs sampled so far, without the stand-ins of tokens still being sampled."""
        return len(self.output_tokens) - self.n_pending

    def drop_pending_tokens(self) -> bool:
        """Forget stand-ins for tokens that will never be taken (the request ends, or goes back to the queue,
        with a decode planned or running); True if there were any."""
        if not self.n_pending:
            return False
        del self.output_tokens[-self.n_pending:]
        self.n_pending = 0
        return True

    def has_final_token(self, seq_limit: int) -> bool:
        """Its last token is sampled or being sampled: no more rows for it."""
        return self.is_at_length(len(self.output_tokens), seq_limit)

    def is_at_length(self, n_out: int, seq_limit: int) -> bool:
        """n_out outputs are all it may have: max_tokens, or the context is full."""
        return n_out >= self.params.max_tokens or len(self.prompt_tokens) + n_out >= seq_limit

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_tokens + self.output_tokens

    def tokens_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without joining the two."""
        n = len(self.prompt_tokens)
        if start >= n:
            return self.output_tokens[start - n:end - n]
        return self.prompt_tokens[start:end] if end <= n else self.prompt_tokens[start:] + self.output_tokens[:end - n]

    def kv_key(self, n: int, start: int = 0) -> list[int]:
        """Its first n tokens as the prefix cache knows them (from `start`: those keys alone). KV computed under a
        LoRA adapter is that adapter's alone, so an adapter's tokens are keyed as negative ids, in a range of its
        own (the base model's keep their ids): the pool's comparisons of token arrays then never match across
        adapters. A cache_salt marks the first keys (as vLLM folds it into its first block's hash), so only
        requests with that salt match."""
        tokens = self.all_tokens[start:n]
        if self.lora:
            offset = self.lora * ADAPTER_KEY_STRIDE + 1
            tokens = [-(t + offset) for t in tokens]
        if self.params.cache_salt is not None and start < SALT_KEYS:
            marks = salt_marks(self.params.cache_salt)[start:]
            tokens[: len(marks)] = [mark | (t & 0xFFFFFFFF) for mark, t in zip(marks, tokens, strict=False)]
        return tokens

    @property
    def n_context_tokens(self) -> int:
        """Tokens that must be in KV before the next sample: prompt plus output (recomputed after preemption)."""
        return len(self.prompt_tokens) + len(self.output_tokens)

    @property
    def uncached_tokens(self) -> int:
        """Tokens not yet in KV: the whole prompt at first, 1 (the last sampled token) while decoding."""
        return self.n_context_tokens - self.computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.state.is_finished

    def finish(self, reason: FinishReason, now: float, error: str | Exception | None = None) -> None:
        """error: what failed it (ERROR); an exception's message is kept, and a ValueError is its own fault."""
        self.transition(RequestState.FAILED if reason is FinishReason.ERROR else RequestState.DONE)
        self.finish_reason = reason
        self.own_fault = isinstance(error, ValueError)
        self.error = f"{type(error).__name__}: {error}" if isinstance(error, Exception) else error
        self.finish_time = now


class Drafted(NamedTuple):
    """What a tick's guesses gave one request, beyond the token its decode row sampled."""

    slot: int
    start: int  # the first guessed row's position: the request's KV is counted up to it, then one per kept token
    end: int  # positions its rows wrote into the KV: a guessed row found wrong leaves a cell to trim
    tokens: list[int]  # the greedy tokens at the guessed rows while the guesses held
    logprobs: list[TokenLogprob | None]
