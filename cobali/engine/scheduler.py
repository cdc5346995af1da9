"""One plan per tick: which requests feed which tokens, in which batch rows.

The scheduler owns the waiting queue and the running list. Each tick it first makes sure every
generating request has KV for its next token (preempting the newest request if the pool ran dry),
then lets the batch policy fill the token budget with decode rows and prefill chunks, admitting
waiting requests into free slots as the mode's admission policy allows.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cobali.engine.budget import FixedBudget, TickBudget
from cobali.engine.kv import SlotPool
from cobali.engine.policies import AdmissionPolicy, BatchPolicy, DecodeMax, KvPolicy, OptimisticKv, ReserveKv
from cobali.engine.queue import WaitQueue
from cobali.engine.request import Request, RequestState

log = logging.getLogger("cobali.scheduler")

BACKOFF_WINDOW_TICKS = 64


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
    wasted_slots: int = 0  # free slots the admission policy kept from waiting requests this tick
    preempted: tuple[int, ...] = ()

    @cached_property
    def rows(self) -> tuple[Chunk, ...]:
        """The chunks in batch-row order, by slot (= seq_id); `chunks` keeps the scheduling priority order.
        With per-sequence KV streams llama.cpp cuts a batch into micro-batches of consecutive seq_ids, so
        any other order multiplies the graph runs: a shuffled 16-row decode costs 1.5x a sorted one."""
        return tuple(sorted(self.chunks, key=lambda c: c.slot))

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


class Scheduler:
    def __init__(self, slots: SlotPool, admission: AdmissionPolicy, n_batch: int,
                 batch: BatchPolicy | None = None, kv: KvPolicy | None = None,
                 queue: WaitQueue | None = None, budget: TickBudget | None = None) -> None:
        if n_batch < slots.max_slots:
            raise ValueError(f"n_batch ({n_batch}) must be >= max_slots ({slots.max_slots}) so decodes fit")
        self.slots = slots
        self.accountant = slots.accountant
        self.admission = admission
        self.n_batch = n_batch
        self.batch = batch or DecodeMax()
        self.kv = kv or OptimisticKv()
        self.waiting = queue or WaitQueue()
        self.budget = budget or FixedBudget(n_batch)
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.tick = 0
        self.preemptions = 0
        self._recent_preemptions: deque[int] = deque()

    def add(self, request: Request) -> None:
        assert request.state is RequestState.PENDING
        self.waiting.push(request)

    def remove(self, request: Request, keep_kv: bool = False) -> None:
        """Take a request out of the queues and give back its slot; keep_kv leaves its KV as a cached prefix."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        if request.slot is not None:
            kv_tokens = request.all_tokens[: request.prefill_cursor] if keep_kv else None
            self.slots.release(request.slot, kv_tokens)
            request.slot = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- preemption ------------------------------------------------------------------------------

    def preempt_newest(self, reason: str, among: set[int] | None = None) -> Request | None:
        """Free the newest running request's KV and put it at the front of the queue, tokens kept."""
        candidates = [r for r in self.running if among is None or r.id in among]
        if not candidates:
            return None
        victim = candidates[-1]
        self.remove(victim)
        victim.prefill_cursor = 0
        victim.transition(RequestState.PENDING)
        self.waiting.push(victim, front=True)
        self.preemptions += 1
        self._recent_preemptions.append(self.tick)
        log.info("preempted request %d (%s): %d tokens to recompute", victim.id, reason, victim.n_context_tokens)
        return victim

    def _grow_decodes(self) -> list[int]:
        """Give every generating request KV for its next token; preempt newest-first when none is left."""
        preempted: list[int] = []
        for request in list(self.running):
            if request.state is not RequestState.DECODE or request.slot is None:
                continue
            need = request.n_context_tokens
            if need <= self.accountant.held_tokens(request.slot):
                continue
            while not self.accountant.can_hold(request.slot, need) and not self.slots.evict_one():
                victim = self.preempt_newest("KV pool full") if self.kv.preempts else None
                if victim is None:
                    break
                preempted.append(victim.id)
                if victim is request:
                    break
            if request.slot is not None:
                self.accountant.hold(request.slot, need)
        return preempted

    def _backing_off(self) -> bool:
        """While preemptions are frequent, admit only what can run to completion (stops the cascade)."""
        while self._recent_preemptions and self._recent_preemptions[0] < self.tick - BACKOFF_WINDOW_TICKS:
            self._recent_preemptions.popleft()
        if not self._recent_preemptions:
            return False
        window = min(BACKOFF_WINDOW_TICKS, 4 * len(self._recent_preemptions))
        return self.tick - self._recent_preemptions[-1] <= window

    # ---- the plan --------------------------------------------------------------------------------

    def schedule(self) -> Plan:
        self.tick += 1
        preempted = self._grow_decodes()
        fit_policy = ReserveKv() if self._backing_off() else self.kv
        decoding = [r for r in self.running if r.state is RequestState.DECODE]
        depth = max((r.prefill_cursor for r in self.running if r.state is RequestState.PREFILL), default=0)
        budget = self.budget.tokens(len(decoding), sum(r.n_context_tokens for r in decoding), depth)
        tick = TickBuilder(self, budget, decoding, may_admit=not preempted, fit_policy=fit_policy)
        self.batch.compose(tick)
        # Slots the admission policy kept shut while requests waited (the static convoy); slots left
        # free only because this tick's token budget or KV ran out are not waste.
        wasted = max(0, min(self.slots.n_free, len(self.waiting)) - tick.allowance)
        assert tick.chunks or not self.running, "running requests but an empty plan: the engine would spin"
        return Plan(self.tick, tuple(tick.chunks), tuple(tick.admitted), wasted, tuple(preempted))


class TickBuilder:
    """One tick's batch under construction; the batch policy decides the order of its steps."""

    def __init__(self, scheduler: Scheduler, budget: int, decoding: list[Request], may_admit: bool,
                 fit_policy: KvPolicy) -> None:
        assert 0 < budget <= scheduler.n_batch
        self.s = scheduler
        self.budget = budget
        self.decoding = decoding  # generating requests at the tick's start, in admission order
        self.may_admit = may_admit
        self.fit_policy = fit_policy
        self.chunks: list[Chunk] = []
        self.admitted: list[int] = []
        self.allowance = 0
        self.chunk_tokens = scheduler.admission.chunk_tokens(scheduler.n_batch)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def has_prefill_work(self) -> bool:
        prefilling = any(r.state is RequestState.PREFILL for r in self.s.running)
        return prefilling or bool(self.s.waiting and self.s.slots.can_assign())

    def add_decodes(self, limit: int | None = None) -> None:
        decoding = self.decoding
        if limit is not None and len(decoding) > limit:
            # Rotate which requests wait, so a capped decode set starves nobody.
            start = self.s.tick % len(decoding)
            decoding = (decoding[start:] + decoding[:start])[:limit]
        for request in decoding:
            self._add(request, 1, ChunkKind.DECODE)

    def add_prefills(self) -> None:
        for request in self.s.running:
            if request.state is RequestState.PREFILL and self.budget > 0:
                self._add_prefill(request)
        self._admit()

    def _add_prefill(self, request: Request) -> None:
        """The next chunk of a prompt, shaped for the backend's prefill tile: no chunk shorter than the tile
        unless it ends the prompt, and no shorter tail left behind (the chunk shrinks, or takes the tail
        along past the tick's budget while the batch has room). A chunk size set below the tile wins, and
        the tile never exceeds what the batch keeps free beside a full set of decodes, so prompts progress."""
        s = self.s
        tile = max(1, min(s.slots.backend.info.prefill_tile, self.chunk_tokens, s.n_batch - s.slots.max_slots))
        left = request.uncached_tokens
        n = min(left, self.chunk_tokens, self.budget)
        room = min(self.chunk_tokens, s.n_batch - sum(c.n_tokens for c in self.chunks))
        if 0 < left - n < tile:
            if left - tile >= tile:
                n = left - tile
            elif left <= room:
                n = left
        elif n < left - n < 2 * tile and (left + 1) // 2 <= room:
            # A rest that a chunk of this size cannot split into two tile-sized chunks: halve the prompt
            # now (n grows by < tile/2) rather than take the whole rest past the budget next tick.
            n = (left + 1) // 2
        if n > 0 and (n == left or n >= tile):
            self._add(request, n, ChunkKind.PREFILL)

    def _admit(self) -> None:
        s = self.s
        limit = s.admission.admit_limit(len(s.running), s.slots.n_free)
        while self.may_admit and len(self.admitted) < limit and s.slots.can_assign():
            if s.admission.admits_only_with_budget and self.budget <= 0:
                break
            request = s.waiting.pop_admissible(self._fits)
            if request is None:
                break
            self._assign(request)
            self._add_prefill(request)
        self.allowance = limit - len(self.admitted)

    def _fits(self, request: Request) -> bool:
        acc = self.s.accountant
        need = self.fit_policy.tokens_to_admit(request, acc.seq_limit)
        if acc.can_hold(None, need):
            return True
        # Cached prefixes in free slots give their cells back when evicted.
        return acc.unified and acc.blocks_for(need) <= acc.free_blocks + self.s.slots.cached_blocks

    def _assign(self, request: Request) -> None:
        s = self.s
        need = self.fit_policy.tokens_to_admit(request, s.accountant.seq_limit)
        while not s.accountant.can_hold(None, need) and s.slots.evict_one():
            pass
        sources = None
        if s.slots.prefix_cache:
            sources = {r.slot: np.asarray(r.all_tokens[: r.prefill_cursor], dtype=np.int32)
                       for r in s.running if r.slot is not None and r.id not in self.admitted}
        # Prompt logprobs need logits at every prompt position: no cached prefix may skip them.
        reusable = request.all_tokens if request.params.prompt_logprobs is None else None
        assignment = s.slots.assign(reusable, sources)
        request.slot = assignment.slot
        request.prefill_cursor = assignment.reused_tokens
        s.accountant.hold(assignment.slot, need)
        request.transition(RequestState.PREFILL)
        s.running.append(request)
        self.admitted.append(request.id)

    def _add(self, request: Request, n: int, kind: ChunkKind) -> None:
        assert request.slot is not None and n > 0
        self.chunks.append(Chunk(
            request_id=request.id, slot=request.slot, kind=kind, start=request.prefill_cursor,
            n_tokens=n, of=request.n_context_tokens, samples=n == request.uncached_tokens,
        ))
        self.budget -= n
