"""Small policy objects the scheduler composes.

- Admission (the mode): how many new requests may enter per tick and how long a prefill chunk may be.
- Batch order: how decode rows and prefill chunks share a tick's token budget.
- KV admission: how much KV a request must be able to hold to enter, and whether it may be preempted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from cobali.engine.request import Request

MODES = ("seq", "static", "cont")
BATCH_POLICIES = ("decode-max", "prefill-first", "balanced")
KV_POLICIES = ("reserve", "optimistic")


class AdmissionPolicy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def admits_only_with_budget(self) -> bool:
        """Continuous admission only takes a request it can feed this tick; cohort modes take the whole
        cohort at once and prefill it over the following ticks."""
        ...

    def admit_limit(self, n_running: int, n_free_slots: int) -> int: ...

    def chunk_tokens(self, n_batch: int) -> int: ...


@dataclass(frozen=True)
class SequentialAdmission:
    name: str = "seq"
    admits_only_with_budget: bool = False

    def admit_limit(self, n_running: int, n_free_slots: int) -> int:
        return 1 if n_running == 0 else 0

    def chunk_tokens(self, n_batch: int) -> int:
        return n_batch


@dataclass(frozen=True)
class StaticAdmission:
    """Request-level batching: a cohort enters together and the next waits until the whole cohort ends."""

    name: str = "static"
    admits_only_with_budget: bool = False

    def admit_limit(self, n_running: int, n_free_slots: int) -> int:
        return n_free_slots if n_running == 0 else 0

    def chunk_tokens(self, n_batch: int) -> int:
        return n_batch


@dataclass(frozen=True)
class ContinuousAdmission:
    prefill_chunk_tokens: int = 512
    name: str = "cont"
    admits_only_with_budget: bool = True

    def admit_limit(self, n_running: int, n_free_slots: int) -> int:
        return n_free_slots

    def chunk_tokens(self, n_batch: int) -> int:
        return min(self.prefill_chunk_tokens, n_batch)


def admission_for_mode(mode: str, prefill_chunk_tokens: int) -> AdmissionPolicy:
    if mode == "seq":
        return SequentialAdmission()
    if mode == "static":
        return StaticAdmission()
    if mode == "cont":
        return ContinuousAdmission(prefill_chunk_tokens)
    raise ValueError(f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")


class TickComposer(Protocol):
    """The steps a batch policy orders: one tick's batch under construction (cobali.engine.tick.TickBuilder)."""

    budget: int  # tokens left this tick

    @property
    def is_empty(self) -> bool: ...

    @property
    def has_prefill_work(self) -> bool: ...

    def add_decodes(self, limit: int | None = None) -> None: ...

    def add_prefills(self) -> None: ...


class BatchPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def compose(self, tick: TickComposer) -> None: ...


@dataclass(frozen=True)
class DecodeMax:
    """Every generating request decodes every tick; prefill chunks fill the rest of the budget."""

    name: str = "decode-max"

    def compose(self, tick: TickComposer) -> None:
        tick.add_decodes()
        tick.add_prefills()


@dataclass(frozen=True)
class PrefillFirst:
    """Prefill whenever there is prefill to do, and decode only in ticks without any (SGLang-style)."""

    name: str = "prefill-first"

    def compose(self, tick: TickComposer) -> None:
        tick.add_prefills()
        if tick.is_empty:
            tick.add_decodes()


@dataclass(frozen=True)
class Balanced:
    """Decodes first, but at most (1 - prefill_share) of the budget while prefill work waits, so a large
    decode population cannot starve new requests of their first token."""

    prefill_share: float = 0.5
    name: str = "balanced"

    def compose(self, tick: TickComposer) -> None:
        reserved = int(tick.budget * self.prefill_share) if tick.has_prefill_work else 0
        tick.add_decodes(limit=tick.budget - reserved)
        tick.add_prefills()


@dataclass(frozen=True)
class TwoPassTicks:
    """A tick's layout with per-sequence KV streams. llama.cpp cuts such a batch into micro-batches, each a run of
    consecutive slots taking as many rows from each as the shortest has left (engine/ubatches.py), so prompt
    chunks of different lengths, or in slots apart, cost a forward pass each. A prompt chunk joins a tick only
    where the tick stays within two passes: one chunk beside a run of decode rows, or chunks of one length in
    consecutive slots. The tick's first chunk may take one pass more than its decode rows alone when a gap
    splits those already, so that prompts always progress."""

    n_ubatch: int  # llama.cpp's micro-batch bound: no run takes more rows than this in one pass
    most_passes: int = 2

    def allows(self, passes: int, decode_passes: int, first_chunk: bool) -> bool:
        return passes <= self.most_passes or (first_chunk and passes <= decode_passes + 1)


def batch_policy(name: str) -> BatchPolicy:
    policies: dict[str, BatchPolicy] = {"decode-max": DecodeMax(), "prefill-first": PrefillFirst(),
                                        "balanced": Balanced()}
    if name not in policies:
        raise ValueError(f"unknown policy {name!r}: expected one of {', '.join(BATCH_POLICIES)}")
    return policies[name]


class KvPolicy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def preempts(self) -> bool: ...

    def tokens_to_admit(self, request: Request, seq_limit: int) -> int:
        """KV cells a request must be able to hold to be admitted (and is charged for at admission)."""
        ...


@dataclass(frozen=True)
class ReserveKv:
    """Admit only what can run to max_tokens: never preempts, admits less."""

    name: str = "reserve"
    preempts: bool = False

    def tokens_to_admit(self, request: Request, seq_limit: int) -> int:
        remaining = request.params.max_tokens - len(request.output_tokens)
        return min(request.n_context_tokens + remaining, seq_limit)


@dataclass(frozen=True)
class OptimisticKv:
    """Admit when the prompt fits; grow per token; preempt the newest request when the pool runs dry."""

    name: str = "optimistic"
    preempts: bool = True

    def tokens_to_admit(self, request: Request, seq_limit: int) -> int:
        return request.n_context_tokens


def kv_policy(name: str) -> KvPolicy:
    if name == "reserve":
        return ReserveKv()
    if name == "optimistic":
        return OptimisticKv()
    raise ValueError(f"unknown KV admission {name!r}: expected one of {', '.join(KV_POLICIES)}")


class AdapterTurns:
    """LoRA adapters take turns. llama.cpp applies one set of adapters to a whole decode, so a tick serves the
    requests of one adapter (0: the base model). Each tick the next adapter in turn, among those with rows to
    run or a request at the queue's head that a free slot could take, goes first; the scheduler tries the
    others in order when its tick would be empty. With n adapters busy each one's requests run every n-th
    tick (llama-server splits its batches by adapter the same way); docs/results.md, "LoRA adapters"."""

    def order(self, tick: int, runnable: Iterable[Request], head: Request | None) -> list[int]:
        loras = {r.lora for r in runnable}
        if head is not None:
            loras.add(head.lora)
        order = sorted(loras) or [0]
        start = tick % len(order)
        return order[start:] + order[:start]
