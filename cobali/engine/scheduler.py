"""One plan per tick: which requests feed which tokens, in which batch rows.

The scheduler owns the waiting queue and the running list. Each tick it first makes sure every
generating request has KV for its next token (preempting the newest request if the pool ran dry),
then lets the batch policy fill the token budget with decode rows and prefill chunks, admitting
waiting requests into free slots as the mode's admission policy allows. It decides, and commits what it
decided: each request counts its planned rows into its KV and a stand-in for each token they sample, so the
next tick can be planned before this one ran. The plan carries the KV operations on slots with the batch, and
the engine's executor runs both.
"""

from __future__ import annotations

import logging
from collections import deque

from cobali.engine.budget import FixedBudget, TickBudget
from cobali.engine.engine_config import EngineConfig
from cobali.engine.kv import SlotPool
from cobali.engine.plan import Chunk, Plan
from cobali.engine.policies import (
    AdapterTurns,
    KvPolicy,
    ReserveKv,
    TwoPassTicks,
    admission_for_mode,
    batch_policy,
    kv_policy,
)
from cobali.engine.queue import WaitQueue
from cobali.engine.request import Request, RequestState
from cobali.engine.running_prefixes import RunningPrefixes
from cobali.engine.speculative import Drafter, NgramDrafter
from cobali.engine.tick import Admitting, Runnable, TickBuilder, TickQueues

log = logging.getLogger("cobali.scheduler")

BACKOFF_WINDOW_TICKS = 64


class Scheduler:
    def __init__(self, config: EngineConfig, slots: SlotPool, budget: TickBudget | None = None, *,
                 prefill_tile: int = 1, adapters: bool = False) -> None:
        """prefill_tile: the backend's shortest fast prefill chunk; adapters: requests may name LoRA adapters."""
        n_batch = config.n_batch
        if n_batch < slots.max_slots:
            raise ValueError(f"n_batch ({n_batch}) must be >= max_slots ({slots.max_slots}) so decodes fit")
        self.slots = slots
        self.accountant = slots.accountant
        self.admission = admission_for_mode(config.mode, config.prefill_chunk_tokens)
        self.n_batch = n_batch
        self.batch = batch_policy(config.policy)
        self.kv = kv_policy(config.kv_admission)
        self.waiting = WaitQueue(config.queue)
        self.budget = budget or FixedBudget(n_batch)
        # Guesses tokens for greedy decodes (engine/speculative.py); None: no speculation.
        self.drafter: Drafter | None = NgramDrafter(config.spec) if config.spec.enabled else None
        self.adapters = AdapterTurns() if adapters else None  # None: every request runs on the base model
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        # With per-sequence KV streams, ticks laid out for two forward passes at most; a unified KV runs any in one.
        self.layout = TwoPassTicks(n_batch) if config.two_pass_ticks and not self.accountant.unified else None
        self._prefixes = RunningPrefixes(slots.min_reuse_tokens) if slots.prefix_cache else None
        self._queues = TickQueues(slots, self.waiting, self.running, self.admission, n_batch, prefill_tile,
                                  self.layout, self._prefixes)
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
            if self._prefixes is not None:
                self._prefixes.discard(request)
        if self.drafter is not None:
            self.drafter.forget(request.id)
        if request.slot is not None:
            kv_tokens = request.kv_key(request.computed_tokens) if keep_kv else None
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
        victim.computed_tokens = 0
        victim.transition(RequestState.PENDING)
        victim.preemptions += 1
        self.waiting.push(victim, front=True)
        self.preemptions += 1
        self._recent_preemptions.append(self.tick)
        log.info("preempted request %d (%s): %d tokens to recompute", victim.id, reason, victim.n_context_tokens)
        return victim

    def _grow_decodes(self, generating: list[Request]) -> list[int]:
        """Give every generating request KV for its next token; preempt newest-first when none is left."""
        preempted: list[int] = []
        for request in generating:
            if request.slot is None:  # preempted for an earlier one
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

    def _split_running(self) -> tuple[list[Request], list[Request]]:
        """The running requests that generate another token this tick, and those whose prompt is being
        prefilled; in one pass, as there are hundreds of them every tick."""
        generating: list[Request] = []
        prefilling: list[Request] = []
        for request in self.running:
            if request.state is RequestState.PREFILL:
                prefilling.append(request)
            elif self._generates_more(request):
                generating.append(request)
        return generating, prefilling

    def _generates_more(self, request: Request) -> bool:
        """A generating request that needs another row. With async scheduling a request whose final token a
        decode in flight is sampling is still running, and must not ride a row it never uses."""
        return request.state is RequestState.DECODE and not request.has_final_token(self.accountant.seq_limit)

    def _backing_off(self) -> bool:
        """While preemptions are frequent, admit only what can run to completion (stops the cascade)."""
        while self._recent_preemptions and self._recent_preemptions[0] < self.tick - BACKOFF_WINDOW_TICKS:
            self._recent_preemptions.popleft()
        if not self._recent_preemptions:
            return False
        window = min(BACKOFF_WINDOW_TICKS, 4 * len(self._recent_preemptions))
        return self.tick - self._recent_preemptions[-1] <= window

    def _compact(self, chunks: list[Chunk]) -> None:
        """With per-sequence KV streams llama.cpp runs one forward pass per run of consecutive seq_ids among
        a batch's rows, so a free slot between running ones splits every decode in two: one more forward pass
        a tick (a whole extra weight read on a GPU). Once this tick's admissions filled what gaps they
        could, the request in the highest slot moves into the lowest gap left, one a tick: the copy costs about
        half what a gap costs each tick (bench/engine/kv_streams.py)."""
        by_slot = {r.slot: r for r in self.running if r.slot is not None}
        if not by_slot:
            return
        highest = max(by_slot)
        holder = by_slot[highest]
        if not (holder.state is RequestState.PREFILL or self._generates_more(holder)):
            return  # a request on its final token frees its slot anyway
        slot = self.slots.fill_gap(highest)
        if slot is None:
            return
        holder.slot = slot
        for i, chunk in enumerate(chunks):
            if chunk.request_id == holder.id:
                chunks[i] = chunk._replace(slot=slot)

    # ---- the plan --------------------------------------------------------------------------------

    def schedule(self, now: float = 0.0) -> Plan:
        """now: the tick's start on the engine's clock (a deadline budget measures slack from it)."""
        self.tick += 1
        generating, prefilling = self._split_running()
        preempted = self._grow_decodes(generating)
        if preempted:  # the victims are queued again
            generating = [r for r in generating if r.slot is not None]
            prefilling = [r for r in prefilling if r.slot is not None]
        fit_policy = ReserveKv() if self._backing_off() else self.kv
        # The layout weighs each chunk's passes by its slot, so a move into a gap comes before the tick is laid
        # out; none while a waiting request could fill the gap for free.
        compact_first = self.layout is not None
        if compact_first and self.slots.may_have_gap and not (self.waiting and self.slots.can_assign()):
            self._compact([])
        if self.adapters is None:
            lora, tick, drafts = 0, *self._compose(0, generating, prefilling, not preempted, fit_policy, now)
        else:
            head = self.waiting[0] if self.waiting and self.slots.can_assign() else None
            for lora in self.adapters.order(self.tick, generating + prefilling, head):
                tick, drafts = self._compose(lora, [r for r in generating if r.lora == lora],
                                             [r for r in prefilling if r.lora == lora], not preempted, fit_policy, now)
                if tick.chunks:
                    break
        if not compact_first and self.slots.may_have_gap:
            self._compact(tick.chunks)
        # Slots the admission policy kept shut while requests waited (the static convoy); slots left
        # free only because this tick's token budget or KV ran out are not waste.
        wasted = max(0, min(self.slots.n_free, len(self.waiting)) - tick.allowance)
        assert tick.chunks or all(r.state is RequestState.DECODE and not self._generates_more(r)
                                  for r in self.running), "running requests but an empty plan: the engine would spin"
        plan = Plan(self.tick, tuple(tick.chunks), tuple(tick.admitted), wasted, tuple(preempted),
                    kv_ops=self.slots.take_kv_ops(), drafts=drafts, lora=lora, start=now,
                    n_running=len(self.running), n_waiting=len(self.waiting))
        self._commit(tick, now)
        return plan

    @staticmethod
    def _commit(tick: TickBuilder, now: float) -> None:
        """Each request counts its rows into its KV now, and a stand-in for the token they sample: the next plan
        is made on what the engine will know once this one ran. A request's first chunk stamps its start."""
        for chunk, request in zip(tick.chunks, tick.requests, strict=True):
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.advance(chunk.n_tokens, chunk.yields_token)

    def _compose(self, lora: int, generating: list[Request], prefilling: list[Request], may_admit: bool,
                 fit_policy: KvPolicy, now: float) -> tuple[TickBuilder, dict[int, tuple[int, ...]]]:
        """One tick's batch for the requests of one LoRA adapter (0: the base model), and its guesses."""
        depth = max((r.computed_tokens for r in prefilling), default=0)
        budget = self.budget.tokens(generating, depth, now)
        tick = TickBuilder(self._queues, self.tick, budget, Runnable(generating, prefilling),
                           Admitting(may_admit, fit_policy, lora))
        self.batch.compose(tick)
        drafts = tick.add_drafts(self.drafter, not self.accountant.unified) if self.drafter is not None else {}
        return tick, drafts
