"""Async scheduling: plan and fill tick t+1 while tick t's decode runs, so a fast device waits for no host work.

The engine's thread runs the decodes back to back; llama_decode releases the GIL, so while one runs a host
thread does the rest: it puts the last decode's tokens in place, streams them, finishes requests, and plans
and fills the next batch. At that point each request counts the token the running decode will sample as a
stand-in (PENDING_TOKEN), so the next plan already gives it a decode row; when the decode returns, the
engine's thread samples, writes the tokens into those rows and launches the next batch at once. No thread has
to wake up between two decodes. The price: a request that hits a stop string or an end-of-generation token
rides one extra row, whose token is dropped. A request that reaches max_tokens or its context is known in
advance and gets no such row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cobali.backends.base import Backend, BatchArrays, DecodeError
from cobali.engine.batch_fill import Filled, fill_batch
from cobali.engine.plan import KvOp, MoveSlot, Plan, TickRecord
from cobali.engine.request import PENDING_TOKEN, FinishReason, Request, Sampled
from cobali.engine.scheduler import Scheduler

SWITCH_INTERVAL_S = 0.0001


class TickHost(Protocol):
    """The parts of a tick the engine (cobali.engine.engine.Engine) does for the pipeline."""

    backend: Backend
    clock: Callable[[], float]
    requests: dict[int, Request]
    scheduler: Scheduler
    n_cut: int

    def take_submissions(self, now: float) -> None: ...
    def fail_unrunnable_head(self, now: float) -> None: ...
    def advance(self, plan: Plan, filled: Filled, pending: bool = False) -> None: ...
    def sample(self, filled: Filled, logits: np.ndarray, cut_since: int | None = None) -> Sampled: ...
    def place_tokens(self, sampled: Sampled) -> None: ...
    def accept(self, sampled: Sampled, now: float) -> None: ...
    def finish(self, request: Request, reason: FinishReason, now: float, error: str | None = None) -> None: ...
    def close_tick(self, record: TickRecord, seconds: float | None) -> None: ...


@dataclass
class Staged:
    """A planned tick, its batch filled in one of the two buffers."""

    plan: Plan
    arrays: BatchArrays
    filled: Filled
    cuts_before: int  # the engine's n_cut when the batch was filled
    start: float
    n_running: int
    n_waiting: int
    # Found while the decode before it runs, so that decode's return waits for less: the rows whose token it
    # samples (PENDING_TOKEN stand-ins), their slots, and each one's place among its samplers (None when the
    # plan preempted a request: it may have come back in another slot).
    feed_rows: np.ndarray
    feed_slots: np.ndarray
    feed_src: np.ndarray | None


class Pipeline:
    """Drives an Engine's ticks: the decodes on the calling thread, everything else beside them on a host
    thread. Each step decodes one batch and returns its record; the host thread is idle between steps, so
    token callbacks never run while the caller looks at what they left."""

    def __init__(self, engine: TickHost) -> None:
        self.engine = engine
        n_batch = engine.backend.info.n_batch
        # Two buffers: the next batch is filled while the decode reads the other.
        self._buffers = [BatchArrays.zeros(n_batch), BatchArrays.zeros(n_batch)]
        self._fills = 0
        # One more entry than slots: the last one takes the tokens of requests that lost their slot.
        self._token_of_slot = np.full(engine.backend.info.n_seq_max + 1, PENDING_TOKEN, dtype=np.int32)
        self._row_of_slot = np.empty(engine.backend.info.n_seq_max, dtype=np.intp)  # _plan's scratch (host thread)
        self._host = ThreadPoolExecutor(1, thread_name_prefix="cobali-host")
        self._ready: Staged | None = None  # planned, filled and fed: the next decode
        self._unsettled: Sampled | None = None  # sampled by the last decode, not yet placed and streamed
        self._unpublished: tuple[TickRecord, float] | None = None  # the last decode's record, and its cost
        # A returning decode needs the GIL back from the host thread and the server's event loop, which by default
        # keep it up to 5 ms: as long as a GPU's decode step. (Process-wide; measured with 256 sleeping 5 ms decodes:
        # 6.4 ms a tick at 5 ms, 5.5 at 0.2 ms; through the server 0.92 of the engine's rate at 0.2 ms, 0.97 at 0.1.)
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    @property
    def in_flight(self) -> bool:
        return self._ready is not None or self._unsettled is not None

    def step(self) -> TickRecord | None:
        engine = self.engine
        if self._ready is None:  # the first tick, or the pipeline ran dry: catch up here
            self._catch_up()
            self._ready, kv_ops = self._plan()
            engine.kv_runner.run(kv_ops)
            if self._ready is None:
                engine.fail_unrunnable_head(engine.clock())
                return None
        staged, self._ready = self._ready, None
        host_work = self._host.submit(self._settle_and_plan, staged)
        launched = engine.clock()
        try:
            engine.kv_runner.run(staged.plan.kv_ops)
            b, n = staged.arrays, staged.filled.n_rows
            logits = engine.backend.decode(b.tokens[:n], b.positions[:n], b.seq_ids[:n], b.want_logits[:n])
        except DecodeError as err:
            upcoming, kv_ops = host_work.result()
            return self._recover(staged, upcoming, kv_ops, err, launched)
        decoded = engine.clock()
        upcoming, kv_ops = host_work.result()
        engine.kv_runner.run(kv_ops)  # a next plan with no batch: its KV operations wait for no decode
        sampled = engine.sample(staged.filled, logits, staged.cuts_before)
        if upcoming is not None:
            self._feed_sampled(upcoming, staged, sampled)
        self._ready, self._unsettled = upcoming, sampled
        record = TickRecord(staged.plan, staged.start, launched, decoded, engine.clock(),
                            n_running=staged.n_running, n_waiting=staged.n_waiting)
        # Published (learned from, recorded, handed to on_tick) by the host thread: its cost is what the clients
        # wait, the host work being hidden.
        self._unpublished = record, record.end - launched
        return record

    def _settle_and_plan(self, staged: Staged) -> tuple[Staged | None, tuple[KvOp, ...]]:
        """On the host thread, while `staged` decodes: the last decode's tokens put in place, staged's rows
        counted (with stand-ins for what it samples), the last tokens streamed, and the next tick planned.
        Streaming comes after the count: a request it finishes drops its stand-in with it."""
        # Checked here, not before the launch, where it would cost the time between two decodes.
        assert (staged.arrays.tokens[: staged.filled.n_rows] >= 0).all(), "a row feeds a token no decode sampled"
        self._publish()
        last, self._unsettled = self._unsettled, None
        if last is not None:
            self.engine.place_tokens(last)
        self.engine.advance(staged.plan, staged.filled, pending=True)
        if last is not None:
            self.engine.accept(last, self.engine.clock())
        return self._plan(staged)

    def _catch_up(self) -> None:
        """With no decode running: publish the last decode's record, place and stream its tokens, here."""
        self._publish()
        last, self._unsettled = self._unsettled, None
        if last is not None:
            self.engine.place_tokens(last)
            self.engine.accept(last, self.engine.clock())

    def _publish(self) -> None:
        if self._unpublished is not None:
            self.engine.close_tick(*self._unpublished)
            self._unpublished = None

    def _plan(self, decoding: Staged | None = None) -> tuple[Staged | None, tuple[KvOp, ...]]:
        """The next tick, planned on what the engine will know once the `decoding` batch is sampled, and its
        batch filled; or None and the KV operations of a plan with no batch (run once no decode runs)."""
        engine = self.engine
        start = engine.clock()
        engine.take_submissions(start)
        preemptions = engine.scheduler.preemptions
        plan = engine.scheduler.schedule(start)
        if plan.is_empty:
            return None, plan.kv_ops
        self._fills += 1  # alternate: the batch filled last may be the one decoding now
        arrays = self._buffers[self._fills % 2]
        filled = fill_batch(arrays, plan.rows, engine.requests, start, plan.drafts)
        feed_rows = np.flatnonzero(arrays.tokens[: filled.n_rows] == PENDING_TOKEN)
        feed_slots = arrays.seq_ids[feed_rows]
        feed_src = None
        # A preemption or a slot move changes which slot a request's stand-in feeds from.
        moved = any(isinstance(op, MoveSlot) for op in plan.kv_ops)
        if decoding is not None and engine.scheduler.preemptions == preemptions and not moved:
            rows, row_of_slot = decoding.filled.sample_rows, self._row_of_slot
            row_of_slot.fill(-1)
            row_of_slot[decoding.arrays.seq_ids[rows]] = np.arange(len(rows))
            feed_src = row_of_slot[feed_slots]
            assert (feed_src >= 0).all(), "a stand-in for a token the running decode does not sample"
        queues = engine.scheduler
        return Staged(plan, arrays, filled, engine.n_cut, start, len(queues.running), len(queues.waiting),
                      feed_rows, feed_slots, feed_src), ()

    def _feed_sampled(self, staged: Staged, decoded: Staged, sampled: Sampled) -> None:
        """Write the tokens just sampled (by `decoded`) over the stand-ins in the next batch's rows: a request
        has one row in it. A request whose sampler failed ends; its row gets any valid token and is dropped."""
        if sampled.requests is decoded.filled.samplers and not sampled.failures and staged.feed_src is not None:
            # Every sampler sampled: a stand-in's token is at its request's place among them. A request that
            # lost its slot meanwhile has no row to feed, and a new one in it feeds its prompt.
            staged.arrays.tokens[staged.feed_rows] = np.asarray(sampled.tokens)[staged.feed_src]
            return
        by_slot = self._token_of_slot
        by_slot.fill(PENDING_TOKEN)
        tokens_sampled = [0 if t is None else t for t in sampled.tokens] if sampled.failures else sampled.tokens
        slots = [-1 if r.slot is None else r.slot for r in sampled.requests]  # -1: preempted meanwhile
        by_slot[slots] = tokens_sampled
        by_slot[-1] = PENDING_TOKEN
        staged.arrays.tokens[staged.feed_rows] = by_slot[staged.feed_slots]

    def _recover(self, failed: Staged, upcoming: Staged | None, kv_ops: tuple[KvOp, ...], err: DecodeError,
                 launched: float) -> TickRecord:
        """The decode failed, and the next plan assumed it had not: that plan never runs. Its KV operations
        do; every request of either plan goes back to the queue to recompute (llama.cpp left the KV as
        before the failed batch). As without overlap, a failure that is not a full KV, or a lone request
        that cannot fit, fails the failed batch's requests."""
        engine = self.engine
        now = engine.clock()
        engine.kv_runner.run(upcoming.plan.kv_ops if upcoming is not None else kv_ops)
        in_batch = list({r.id: r for r in failed.filled.requests if not r.is_finished}.values())
        for request in in_batch:
            request.drop_pending_tokens()
        if not (err.no_kv_slot and len(in_batch) > 1):
            for request in in_batch:
                engine.finish(request, FinishReason.ERROR, now, f"decode failed: {err}")
        chunks = failed.plan.chunks + (upcoming.plan.chunks if upcoming is not None else ())
        for request_id in dict.fromkeys(c.request_id for c in chunks):
            engine.scheduler.preempt_newest(f"decode failed: {err}", among={request_id})
        record = TickRecord(failed.plan, failed.start, launched, now, engine.clock(),
                            n_running=failed.n_running, n_waiting=failed.n_waiting)
        engine.close_tick(record, None)
        return record
