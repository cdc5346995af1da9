"""One tick's batch under construction: decode rows, prefill chunks, admissions, in the order the batch
policy calls its steps. It reads and updates the scheduler's queues, and never touches the backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cobali.engine.kv import SlotPool
from cobali.engine.kv_tier import KEY_DTYPE
from cobali.engine.plan import Chunk, ChunkKind
from cobali.engine.policies import AdmissionPolicy, KvPolicy, TwoPassTicks
from cobali.engine.queue import WaitQueue
from cobali.engine.request import Request, RequestState
from cobali.engine.running_prefixes import RunningPrefixes
from cobali.engine.speculative import Drafter, can_speculate
from cobali.engine.ubatches import SeqRows, count_passes


def fit_to_tile(n: int, left: int, room: int, tile: int) -> int:
    """A prefill chunk of n of the `left` prompt tokens, reshaped for the backend's prefill tile (a chunk
    shorter than it takes a slow path): no chunk shorter than the tile unless it ends the prompt, and no
    shorter tail left behind (the chunk shrinks, or takes the tail along past the tick's budget while the
    batch has `room`). Returns 0 for no chunk this tick."""
    if 0 < left - n < tile:
        if left - tile >= tile:
            n = left - tile
        elif left <= room:
            n = left
    elif n < left - n < 2 * tile and (left + 1) // 2 <= room:
        # A rest that a chunk of this size cannot split into two tile-sized chunks: halve the prompt
        # now (n grows by < tile/2) rather than take the whole rest past the budget next tick.
        n = (left + 1) // 2
    return n if n > 0 and (n == left or n >= tile) else 0


@dataclass
class TickQueues:
    """The scheduler's state a tick reads and updates."""

    slots: SlotPool
    waiting: WaitQueue
    running: list[Request]  # in admission order: the newest is preempted first
    admission: AdmissionPolicy
    n_batch: int
    prefill_tile: int  # the backend's shortest fast prefill chunk (BackendInfo.prefill_tile)
    layout: TwoPassTicks | None = None  # None: any layout runs in one pass (a unified KV), or no bound is kept
    prefixes: RunningPrefixes | None = None  # the running requests by their first tokens; None: no prefix cache


class Runnable(NamedTuple):
    """The running requests a tick may give rows to, in admission order."""

    decoding: list[Request]  # generating: a decode row each
    prefilling: list[Request]  # their prompt (or, after a preemption, prompt and outputs) being computed


class Admitting(NamedTuple):
    """What a tick may admit from the queue."""

    may_admit: bool  # False in a tick that preempted: its victims would come straight back
    fit_policy: KvPolicy  # how much KV a request must find free to enter
    lora: int = 0  # the LoRA adapter of the tick's requests: only its waiting requests are admitted


class TickBuilder:
    """Satisfies policies.TickComposer: the batch policy decides the order of its steps."""

    def __init__(self, queues: TickQueues, tick: int, budget: int, runnable: Runnable, admitting: Admitting) -> None:
        assert 0 < budget <= queues.n_batch
        self.queues = queues
        self.tick = tick
        self.budget = budget
        self.decoding, self.prefilling = runnable
        self.may_admit, self.fit_policy, self.lora = admitting
        self.chunks: list[Chunk] = []
        self.requests: list[Request] = []  # each chunk's, in the same order
        self.admitted: list[int] = []
        self.allowance = 0
        self.layout_full = False  # a prompt chunk was refused for the passes it would add: admit no more
        self.chunk_tokens = queues.admission.chunk_tokens(queues.n_batch)
        # The tile never exceeds what the batch keeps free beside a full set of decodes, so prompts progress;
        # a chunk size set below the tile wins.
        self.tile = max(1, min(queues.prefill_tile, self.chunk_tokens, queues.n_batch - queues.slots.max_slots))

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def has_prefill_work(self) -> bool:
        q = self.queues
        return bool(self.prefilling) or bool(q.waiting and q.slots.can_assign())

    def add_decodes(self, limit: int | None = None) -> None:
        decoding = self.decoding
        if limit is not None and len(decoding) > limit:
            # Rotate which requests wait, so a capped decode set starves nobody.
            start = self.tick % len(decoding)
            decoding = (decoding[start:] + decoding[:start])[:limit]
        # One row per generating request, built inline: this runs for every request every tick. tuple.__new__
        # skips the NamedTuple's Python-level constructor: half the time at hundreds of rows.
        kind, new = ChunkKind.DECODE, tuple.__new__
        self.chunks += [new(Chunk, (r.id, r.slot, kind, r.computed_tokens, 1, r.computed_tokens + 1, True))
                        for r in decoding]
        self.requests += decoding
        self.budget -= len(decoding)

    def add_drafts(self, drafter: Drafter, equal_lengths: bool) -> dict[int, tuple[int, ...]]:
        """Guessed tokens behind decode rows (engine/spec.py), in the budget and batch rows the decodes and
        prefills left: a wrong guess then costs a row no prompt was waiting for. Never past max_tokens or the
        context's end, nor past the KV the request holds. equal_lengths (per-sequence KV streams): every guess
        cut to the shortest, as llama.cpp runs one more forward pass for each distinct row count among the
        sequences of a batch. Returns the guesses by request id."""
        room = min(self.budget, self.queues.n_batch - sum(c.n_tokens for c in self.chunks))
        drafts: dict[int, tuple[int, ...]] = {}
        if room <= 0 or len(self.decoding) > drafter.max_batch:
            return drafts
        acc = self.queues.slots.accountant
        decoding = {r.id: r for r in self.decoding if can_speculate(r.params)}
        for chunk in self.chunks:
            request = decoding.get(chunk.request_id)
            if request is None or chunk.kind is not ChunkKind.DECODE:
                continue
            # The outputs it may have: max_tokens, or as many as the context holds (held rounds up to a block).
            most = min(request.params.max_tokens, acc.seq_limit - len(request.prompt_tokens))
            limit = min(room, most - len(request.output_tokens) - 1, acc.held_tokens(chunk.slot) - chunk.end)
            if guess := drafter.propose(request, limit):
                drafts[request.id] = guess
                room -= len(guess)
                if room <= 0:
                    break
        if equal_lengths and drafts:
            shortest = min(map(len, drafts.values()))
            drafts = {request_id: draft[:shortest] for request_id, draft in drafts.items()}
        for i, chunk in enumerate(self.chunks):
            if chunk.kind is ChunkKind.DECODE and (draft := drafts.get(chunk.request_id)):
                self.chunks[i] = chunk._replace(n_tokens=1 + len(draft), context_tokens=chunk.end + len(draft))
        self.budget -= sum(map(len, drafts.values()))
        return drafts

    def add_prefills(self) -> None:
        q = self.queues
        for request in q.waiting.prefill_order(self.prefilling):
            if self.budget > 0 and not self.layout_full:  # each refusal weighs hundreds of rows: stop at one
                self._add_prefill(request)
        self._admit()

    def _add_prefill(self, request: Request) -> None:
        """The next chunk of a prompt: as long as the mode's chunk size and the tick's budget allow, then
        shaped for the backend's prefill tile."""
        left = request.uncached_tokens
        n = min(left, self.chunk_tokens, self.budget)
        room = min(self.chunk_tokens, self.queues.n_batch - sum(c.n_tokens for c in self.chunks))
        n = fit_to_tile(n, left, room, self.tile)
        if n > 0 and self.queues.layout is not None:
            n = self._laid_out(self.queues.layout, request, n, room)
        if n > 0:
            self._add(request, n, ChunkKind.PREFILL)

    def _laid_out(self, layout: TwoPassTicks, request: Request, n: int, room: int) -> int:
        """A chunk of n, or else of the length the tick's other prompt chunks share (where the prefill tile
        allows it), that keeps the tick's forward passes within the layout's bound; 0: neither does."""
        assert request.slot is not None
        rows = [SeqRows(c.slot, c.n_tokens) for c in self.chunks]
        lengths = {c.n_tokens for c in self.chunks if c.kind is ChunkKind.PREFILL}
        first_chunk = not lengths
        decode_passes = count_passes(sorted(rows), layout.n_ubatch, True) if first_chunk else 0
        candidates = [n] + [k for k in lengths if len(lengths) == 1 and k < n
                            and fit_to_tile(k, request.uncached_tokens, room, self.tile) == k]
        for k in candidates:
            passes = count_passes(sorted([*rows, SeqRows(request.slot, k)]), layout.n_ubatch, True)
            if layout.allows(passes, decode_passes, first_chunk):
                return k
        self.layout_full = True
        return 0

    def _admit(self) -> None:
        q = self.queues
        limit = q.admission.admit_limit(len(q.running), q.slots.n_free)
        while self.may_admit and len(self.admitted) < limit and q.slots.can_assign():
            if q.admission.admits_only_with_budget and (self.budget <= 0 or self.layout_full):
                break
            request = q.waiting.pop_admissible(self._fits)
            if request is None:
                break
            self._assign(request)
            self._add_prefill(request)
        self.allowance = limit - len(self.admitted)

    def _fits(self, request: Request) -> bool:
        if request.lora != self.lora:
            return False
        acc = self.queues.slots.accountant
        need = self.fit_policy.tokens_to_admit(request, acc.seq_limit)
        if acc.can_hold(None, need):
            return True
        # Cached prefixes in free slots give their cells back when evicted.
        return acc.unified and acc.blocks_for(need) <= acc.free_blocks + self.queues.slots.cached_blocks

    def _assign(self, request: Request) -> None:
        q = self.queues
        acc = q.slots.accountant
        need = self.fit_policy.tokens_to_admit(request, acc.seq_limit)
        # Prompt logprobs need logits at every prompt position: no cached prefix may skip them.
        reusable = request.kv_key(len(request.all_tokens)) if request.params.prompt_logprobs is None else None
        # Room is made by evicting cached prefixes, never the one this request would reuse in place.
        spare = q.slots.reusable_slot(reusable) if not acc.can_hold(None, need) else None
        while not acc.can_hold(spare, need) and q.slots.evict_one(spare):
            pass
        sources = None
        if q.prefixes is not None:  # lazily: each source read costs a copy of its keys
            sources = ((r.slot, np.asarray(r.kv_key(r.computed_tokens), dtype=KEY_DTYPE))
                       for r in q.prefixes.sources_for(request, self.admitted) if r.slot is not None)
        assignment = q.slots.assign(reusable, sources)
        while not acc.can_hold(assignment.slot, need) and q.slots.evict_one():
            pass  # the spared prefix was not reused in place after all (a longer one was found elsewhere)
        request.slot = assignment.slot
        request.computed_tokens = assignment.reused_tokens
        # A resumed request may reuse its own output's KV too (an identical greedy request's): only prompt tokens count.
        request.cached_tokens = min(assignment.reused_tokens, len(request.prompt_tokens))
        acc.hold(assignment.slot, need)
        request.transition(RequestState.PREFILL)
        q.running.append(request)
        if q.prefixes is not None:
            q.prefixes.add(request)
        self.admitted.append(request.id)

    def _add(self, request: Request, n: int, kind: ChunkKind) -> None:
        assert request.slot is not None and n > 0
        self.chunks.append(Chunk(
            request_id=request.id, slot=request.slot, kind=kind, start=request.computed_tokens,
            n_tokens=n, context_tokens=request.n_context_tokens, yields_token=n == request.uncached_tokens,
        ))
        self.requests.append(request)
        self.budget -= n
