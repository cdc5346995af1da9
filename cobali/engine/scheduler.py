"""One plan per tick: which requests feed which tokens, in which batch rows.

Decode rows come first (one token per generating request), then prefill chunks of requests already in
flight, then newly admitted requests, until the token budget or the slots run out. Modes differ only in
their admission policy and chunk size.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from cobali.engine.kv import SlotPool
from cobali.engine.request import Request, RequestState


class ChunkKind(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclass(frozen=True)
class Chunk:
    request_id: int
    slot: int
    kind: ChunkKind
    start: int  # position of the chunk's first token
    n_tokens: int
    of: int  # context tokens the request needs in KV before it samples
    samples: bool  # the chunk's last row wants logits: the request samples a token this tick

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass(frozen=True)
class Plan:
    tick: int
    chunks: tuple[Chunk, ...]
    admitted: tuple[int, ...] = ()
    wasted_slots: int = 0  # free slots that a waiting request could not take this tick

    @property
    def n_tokens(self) -> int:
        return sum(c.n_tokens for c in self.chunks)

    @property
    def n_decode(self) -> int:
        return sum(c.kind is ChunkKind.DECODE for c in self.chunks)

    @property
    def n_prefill_tokens(self) -> int:
        return sum(c.n_tokens for c in self.chunks if c.kind is ChunkKind.PREFILL)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def describe(self) -> str:
        prefills = [c for c in self.chunks if c.kind is ChunkKind.PREFILL]
        parts = ", ".join(f"req {c.request_id}: [{c.start}..{c.end}) of {c.of}" for c in prefills)
        detail = f" ({parts})" if parts else ""
        return f"{self.n_decode} decode + {len(prefills)} prefill{detail} = {self.n_tokens} tok"


class AdmissionPolicy(Protocol):
    """How many new requests may enter this tick, and how long a prefill chunk may be."""

    name: str
    # Continuous admission only takes a request it can feed this tick; cohort modes take the whole
    # cohort at once and prefill it over the following ticks.
    admits_only_with_budget: bool

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
    raise ValueError(f"unknown mode {mode!r}: expected seq, static or cont")


class Scheduler:
    def __init__(self, slots: SlotPool, admission: AdmissionPolicy, n_batch: int) -> None:
        if n_batch < slots.max_slots:
            raise ValueError(f"n_batch ({n_batch}) must be >= max_slots ({slots.max_slots}) so decodes fit")
        self.slots = slots
        self.admission = admission
        self.n_batch = n_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.tick = 0

    def add(self, request: Request) -> None:
        assert request.state is RequestState.PENDING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and give back its slot (on finish or abort)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        if request.slot is not None:
            self.slots.release(request.slot)
            request.slot = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Plan:
        budget = self.n_batch
        chunks: list[Chunk] = []
        for request in self.running:
            if request.state is RequestState.DECODE:
                chunks.append(self._chunk(request, 1, ChunkKind.DECODE))
                budget -= 1
        chunk_tokens = self.admission.chunk_tokens(self.n_batch)
        for request in self.running:
            if request.state is RequestState.PREFILL and budget > 0:
                n = min(request.uncached_tokens, chunk_tokens, budget)
                chunks.append(self._chunk(request, n, ChunkKind.PREFILL))
                budget -= n
        admitted = self._admit(chunks, budget, chunk_tokens)
        wasted = min(self.slots.n_free, len(self.waiting))
        self.tick += 1
        return Plan(self.tick, tuple(chunks), tuple(admitted), wasted)

    def _admit(self, chunks: list[Chunk], budget: int, chunk_tokens: int) -> list[int]:
        admitted: list[int] = []
        limit = self.admission.admit_limit(len(self.running), self.slots.n_free)
        while self.waiting and len(admitted) < limit and self.slots.can_assign():
            if self.admission.admits_only_with_budget and budget <= 0:
                break
            request = self.waiting.popleft()
            request.slot = self.slots.assign()
            request.transition(RequestState.PREFILL)
            self.running.append(request)
            admitted.append(request.id)
            n = min(request.uncached_tokens, chunk_tokens, budget)
            if n > 0:
                chunks.append(self._chunk(request, n, ChunkKind.PREFILL))
                budget -= n
        return admitted

    @staticmethod
    def _chunk(request: Request, n: int, kind: ChunkKind) -> Chunk:
        assert request.slot is not None and n > 0
        return Chunk(
            request_id=request.id, slot=request.slot, kind=kind, start=request.prefill_cursor,
            n_tokens=n, of=request.n_context_tokens, samples=n == request.uncached_tokens,
        )
